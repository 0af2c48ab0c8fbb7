"""The KV pool a job's requests need on a CPU, and the prefix cache a pool of some size would keep.

The block manager hands out blank blocks before it reuses cached ones, so that cached prefixes live long, and so a
long run makes every block of its pool resident: a pool larger than the job needs is memory the run holds for
nothing. A job's pool is sized from its requests (Engine.fit_kv_pool shrinks the default pool to it) so that it never
runs slower: the scheduler runs at most max_num_seqs sequences at once, and a pool that holds the largest such set
whole, below the admission watermark, plus the prefix blocks that later requests read from the cache, never makes it
wait for blocks or preempt."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from batchjob.job.contracts import JobEngine
from batchjob.job.input.planner import Work, job_planner
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobSpec

# Engine.kv_pool_sized_by, as plan and _summary.json say it
SIZED_BY = {
    "job": "sized from the job's requests",
    "default": "the default: 2 GiB, or half the memory available after the load where less",
    "num_kv_blocks": "engine.num_kv_blocks",
    "kv_cache_memory_gb": "engine.kv_cache_memory_gb",
    "gpu_memory": "engine.kv_cache_memory_fraction of the GPU's memory",
}


def max_output_tokens(engine: JobEngine, work: Work) -> int:
    """The most tokens a request can generate: its max_tokens, within the model's context (as the engine caps it)."""
    return min(work.params.max_tokens, max(engine.max_model_len - len(work.token_ids), 0))


def block_keys(token_ids: list[int], block_size: int, images: Sequence[tuple[int, bytes]] = ()) -> Iterator[int]:
    """The prefix cache's key of each full block of a prompt, each folding in the blocks before it. `images`: each of
    a row's images' first image token's position and digest, which the engine folds into the block that holds that
    token (and so into every block after it): their placeholder tokens are the same for any image of a size."""
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digests = tuple(d for first, d in images if start <= first < start + block_size)
        parent = hash((parent, tuple(token_ids[start : start + block_size]), digests))
        yield parent


class PrefixCacheModel:
    """Which full prompt blocks an LRU prefix cache of the engine's size would already hold, in planned order; and
    the most blocks it held at once that a later request read (`most_reused`)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.capacity, self.block_size = num_blocks, block_size
        self.blocks: OrderedDict[int, bool] = OrderedDict()  # by key: whether a later request read it
        self.reused = self.most_reused = 0

    def hit_tokens(self, token_ids: list[int], images: Sequence[tuple[int, bytes]] = ()) -> int:
        hits, hitting = 0, True
        for key in block_keys(token_ids, self.block_size, images):
            if hitting and key in self.blocks:
                hits += self.block_size
                self.blocks.move_to_end(key)
                if not self.blocks[key]:
                    self.blocks[key] = True
                    self.reused += 1
                    self.most_reused = max(self.most_reused, self.reused)
                continue
            hitting = False
            self.blocks[key] = False
            if len(self.blocks) > self.capacity:
                self.reused -= self.blocks.popitem(last=False)[1]
        return hits


class PoolNeed:
    """The KV blocks a job's requests need at once at most: the max_num_seqs largest sequences whole (a request of
    n samples is n sequences), plus the prefix blocks the cache keeps for later requests, over the watermark."""

    def __init__(self, max_num_seqs: int, block_size: int, watermark: float, cache_blocks: int):
        self.max_num_seqs, self.block_size, self.watermark = max_num_seqs, block_size, watermark
        self.largest: list[int] = []  # a min-heap of the largest sequences' blocks
        self.largest_total = 0
        self.cache = PrefixCacheModel(cache_blocks, block_size)

    def add(self, token_ids: list[int], max_tokens: int, n: int, images: Sequence[tuple[int, bytes]] = ()) -> None:
        self.cache.hit_tokens(token_ids, images)
        blocks = -(-(len(token_ids) + max_tokens) // self.block_size)
        for _ in range(min(n, self.max_num_seqs)):
            if len(self.largest) < self.max_num_seqs:
                heapq.heappush(self.largest, blocks)
                self.largest_total += blocks
            elif blocks > self.largest[0]:
                self.largest_total += blocks - heapq.heapreplace(self.largest, blocks)

    @property
    def blocks(self) -> int:
        """The pool's blocks: the admission watermark stops new prefills above its share of the pool."""
        return math.ceil((self.largest_total + self.cache.most_reused) / self.watermark)


def job_pool_blocks(engine: JobEngine, works: Iterable[Work]) -> int:
    """The blocks the planned `works` need at once at most (PoolNeed), or the engine's pool where they need at least
    that: the pass stops there, so a large job is not read through for a pool that cannot shrink."""
    config = engine.config
    need = PoolNeed(config.max_num_seqs, config.block_size, config.kv_watermark, engine.num_kv_blocks)
    for work in works:
        images = list(zip(work.images.firsts, work.images.digests)) if work.images is not None else []
        need.add(work.token_ids, max_output_tokens(engine, work), work.params.n, images)
        if need.blocks >= engine.num_kv_blocks:
            return engine.num_kv_blocks
    return need.blocks


def fit_job_pool(job: JobSpec, engine: JobEngine, rows: Iterable[Row]) -> None:
    """Shrink the engine's default CPU pool to what a generating job's pending `rows` need (job_pool_blocks), before
    any runs; a pool a setting sized stays. A job that reads images keeps the default: sizing would read each image
    twice."""
    if engine.kv_pool_sized_by != "default":
        return
    planner = job_planner(job, engine, lambda row, error: None)  # the run reports the failing rows
    if planner.images is None:
        engine.fit_kv_pool(job_pool_blocks(engine, planner.works(rows)))


def pool_report(engine: JobEngine) -> dict:
    """The KV pool's size and what sized it, for `plan` and _summary.json."""
    blocks = engine.num_kv_blocks
    return {
        "kv_pool_blocks": blocks,
        "kv_pool_bytes": blocks * engine.config.block_size * engine.kv_bytes_per_token,
        "kv_pool_sized_by": SIZED_BY[engine.kv_pool_sized_by],
    }
