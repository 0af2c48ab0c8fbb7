from __future__ import annotations

import pytest

from batchjob.engine.block_manager import BlockManager, KVPoolExhausted
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.sequence import Sequence


def seq(tokens, i=0):
    return Sequence(Request(str(i), tokens, SamplingParams()), i)


def run(bm, s):
    """Allocate and 'compute' all of a sequence's tokens."""
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)


def test_prefix_hit_reuses_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, 4)
    a = seq(list(range(12)))
    run(bm, a)
    b = seq(list(range(12)), 1)
    assert bm.match_prefix(b) == 8  # 3 full blocks, but the last token must be computed: 2 blocks
    assert b.block_table == a.block_table[:2] and bm.ref_count[a.block_table[0]] == 2
    c = seq(list(range(8)) + [99, 98, 97, 96, 95], 2)
    assert bm.match_prefix(c) == 8
    d = seq([0, 1, 2, 99] + list(range(4, 12)), 3)
    assert bm.match_prefix(d) == 0  # chained hash: a different first block invalidates the rest


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])
    run(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    b = seq([1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4
    bm.free(b)
    big = seq([7] * 8, 1)  # needs all 4 blocks: both cached ones are evicted
    run(bm, big)
    assert bm.hash_to_block and all(bm.block_tokens[blk] == (7, 7) for blk in bm.hash_to_block.values())
    assert bm.match_prefix(seq([1, 2, 3, 4, 9], 2)) == 0


def test_double_free_is_caught():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3])
    run(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    run(bm, a)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], 1)) == 0 and not bm.hash_to_block


def test_an_exhausted_pool_is_named_and_nothing_is_taken():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])
    run(bm, a)  # 3 of the 4 blocks
    b = seq([6, 7, 8], 1)
    assert not bm.can_allocate(b, 3)
    with pytest.raises(KVPoolExhausted, match="needs 2 more blocks, 1 of 4 are free"):
        bm.allocate(b, 3)
    assert b.block_table == [] and bm.num_free_blocks == 1
