"""The results cache across runs: keys, entries (untrusted when read back) and the store."""
