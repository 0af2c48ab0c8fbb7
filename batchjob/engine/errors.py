"""The engine layer's errors, importable without torch: the CLI maps them to exit codes before any model loads."""


class DeviceSettingError(ValueError):
    """A setting the device cannot meet: `device: cuda` where torch sees no CUDA device, or a
    kv_cache_memory_fraction that leaves no room for the KV cache."""
