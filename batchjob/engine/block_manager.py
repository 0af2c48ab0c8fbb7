"""Paged KV-cache blocks: placement, reference counts, and prefix caching by chained block hashes.

A full block is keyed by hash(parent block's hash, its token ids and the digests of the images that start in it).
When its last user frees it, a hashed block stays cached and is reused by a later request with the same prefix, until
its place is taken for new tokens.

Placement keeps each sequence's blocks in one run of the pool where it can: a decode step reads every sequence's K/V,
and the CPU attention kernel reads a sequence's blocks faster where they lie in one run than at random places
(`python scripts/cpu_ops_ab.py attention`). A sequence's next block is the one after its last if no one holds that;
otherwise a new run is sought from a cursor that sweeps the pool, long enough for the sequence's remaining tokens
(prompt plus max_tokens, within the context and the pool), and the cursor moves past all of it so that the sequence
grows into the rest of the run while other sequences start further on. Runs of blocks that cache nothing are sought
first, so that cached prefixes outlive free space; cached blocks nobody holds are taken when there are none, as the
sweep reaches them. When every block is free again the sweep starts over at the first block: the pool is mapped lazily
(host_memory.py), and a first write to a page costs a fault: a K/V store into new pages is several times slower than
into mapped ones."""

from __future__ import annotations

from batchjob.engine.sequence import Sequence


class KVPoolExhausted(RuntimeError):
    """More blocks were asked for than the pool has free (cached blocks included): the caller should have checked
    can_allocate, or must split its work."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_model_len: int | None = None
    ):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        # No sequence grows past the context, nor past the pool: a run is never sought longer than that, whatever
        # max_tokens a request asks for.
        self.max_blocks_per_seq = min(num_blocks, -(-(max_model_len or num_blocks * block_size) // block_size))
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple | None] = [None] * num_blocks  # its Sequence.block_key, to verify a hash hit
        self.hash_to_block: dict[int, int] = {}
        self._free = bytearray(b"\x01") * num_blocks  # 1 where no sequence holds the block (cached or not)
        self._blank = bytearray(b"\x01") * num_blocks  # 1 where it is free and caches nothing
        self._num_free = num_blocks
        self._cursor = 0  # where the search for a new run starts

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def is_free(self, block: int) -> bool:
        return bool(self._free[block])

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _find_run(self, blocks: bytearray, length: int) -> int:
        """The first of `length` blocks in a row marked in `blocks`, from the cursor on, then from the start; or -1."""
        run = b"\x01" * length
        start = blocks.find(run, self._cursor)
        return start if start >= 0 else blocks.find(run, 0)

    def _next_block(self, seq: Sequence, needed: int) -> int:
        if seq.block_table:
            after = seq.block_table[-1] + 1
            if after < self.num_blocks and self._free[after]:
                return after
        final = min(-(-(seq.num_prompt_tokens + seq.max_tokens) // self.block_size), self.max_blocks_per_seq)
        want = max(needed, final - len(seq.block_table))
        for blocks, length in ((self._blank, want), (self._free, want), (self._free, needed), (self._free, 1)):
            start = self._find_run(blocks, length)
            if start >= 0:
                self._cursor = (start + length) % self.num_blocks
                return start
        raise AssertionError("no free block although the count said so")

    def _take(self, block: int) -> None:
        if self.block_hash[block] is not None:  # cached, held by no one: its prefix is forgotten
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = self.block_tokens[block] = None
        self._free[block] = self._blank[block] = 0
        self._num_free -= 1
        self.ref_count[block] = 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for `num_new_tokens` more tokens of `seq`, all or none: raises KVPoolExhausted when the pool has
        fewer free blocks than that."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise KVPoolExhausted(
                f"KV pool exhausted: sequence {seq.request_id} needs {needed} more blocks, {self.num_free_blocks} of "
                f"{self.num_blocks} are free"
            )
        for left in range(needed, 0, -1):
            block = self._next_block(seq, left)
            self._take(block)
            seq.block_table.append(block)

    def match_prefix(self, seq: Sequence) -> int:
        """On admission of a sequence that holds no blocks: reuse cached full blocks of its prefix, up to its
        prefix_cache_limit (tokens whose logits are needed are computed). Returns the number of tokens found."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        parent = seq.prefix_root
        hits = 0
        for start in range(0, seq.prefix_cache_limit - self.block_size + 1, self.block_size):
            chunk = seq.block_key(start, self.block_size)
            h = hash((parent, chunk))
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != chunk:
                break
            if self.ref_count[block] == 0:
                self._free[block] = 0
                self._num_free -= 1
            self.ref_count[block] += 1
            seq.block_table.append(block)
            parent = h
            hits += self.block_size
        seq.num_computed_tokens = hits
        seq.num_hashed_blocks, seq.last_block_hash = len(seq.block_table), parent
        return hits

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """`child` (holding no blocks) shares the full blocks of `parent`'s computed tokens; the last, partial block
        is computed again by the child, since both write into it next. Returns the number of tokens shared."""
        full = parent.num_computed_tokens // self.block_size
        for block in parent.block_table[:full]:
            self.ref_count[block] += 1
        child.block_table = parent.block_table[:full]
        child.num_computed_tokens = full * self.block_size
        if parent.num_hashed_blocks >= full:
            child.num_hashed_blocks, child.last_block_hash = full, parent.last_block_hash
        return child.num_computed_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """After a step: key every newly completed block of `seq` so that later requests can share it."""
        if not self.enable_prefix_caching:
            return
        parent = seq.last_block_hash
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size):
            block = seq.block_table[i]
            chunk = seq.block_key(i * self.block_size, self.block_size)
            parent = hash((parent, chunk))
            if parent not in self.hash_to_block:  # a twin computed in the same step keeps the first as the key
                self.hash_to_block[parent] = block
                self.block_hash[block], self.block_tokens[block] = parent, chunk
            seq.num_hashed_blocks, seq.last_block_hash = i + 1, parent

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks that no sequence holds, as vLLM's reset_prefix_cache: so that a benchmark's next
        run over the same prompts computes them again."""
        for h, block in list(self.hash_to_block.items()):
            if not self.ref_count[block]:
                del self.hash_to_block[h]
                self.block_hash[block] = self.block_tokens[block] = None
                self._blank[block] = 1

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                self._free[block] = 1
                self._blank[block] = self.block_hash[block] is None
                self._num_free += 1
        if self._num_free == self.num_blocks:  # drained: start again where the pages are already mapped
            self._cursor = 0
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        seq.last_block_hash = seq.prefix_root
