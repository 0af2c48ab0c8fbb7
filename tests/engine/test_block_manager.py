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


def test_a_block_repeated_at_another_position_is_not_a_hit():
    """A block's key chains on its parent's: the same tokens after another prefix (or at the start, where they
    followed something before) are other K/V (positions and context differ) and must be computed again."""
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    run(bm, a)
    assert bm.match_prefix(seq([5, 6, 7, 8, 1, 2, 3, 4, 0], 1)) == 0  # a's second block, now first
    assert bm.match_prefix(seq([9, 9, 9, 9, 5, 6, 7, 8, 0], 2)) == 0  # a's second block after another first
    b = seq([1, 2, 3, 4, 1, 2, 3, 4, 0], 3)  # a's first block twice: only the first is a hit
    assert bm.match_prefix(b) == 4 and b.block_table == a.block_table[:1]


def test_freed_cached_blocks_are_reused_then_taken_for_new_tokens():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])
    run(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    b = seq([1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4
    bm.free(b)
    big = seq([7] * 8, 1)  # needs all 4 blocks: both cached ones are evicted
    run(bm, big)
    assert bm.hash_to_block and all(bm.block_tokens[blk] == (7, 7) for blk in bm.hash_to_block.values())
    assert bm.match_prefix(seq([1, 2, 3, 4, 9], 2)) == 0


def grow(bm, s, tokens):
    """Decode `tokens` more tokens of a sequence whose tokens are all computed."""
    for t in tokens:
        s.token_ids.append(t)
        bm.allocate(s, 1)
        s.num_computed_tokens += 1


def test_each_sequence_grows_in_one_run_while_others_grow_too():
    bm = BlockManager(64, 4)
    a, b = (Sequence(Request(str(i), [i] * 8, SamplingParams(max_tokens=8)), i) for i in range(2))
    run(bm, a)
    run(bm, b)  # each placed with room for its 8 more tokens: 4 blocks apart
    for _ in range(8):  # interleaved decode steps
        grow(bm, a, [1])
        grow(bm, b, [2])
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    bm.free(a)
    c = Sequence(Request("2", [3] * 12, SamplingParams(max_tokens=4)), 2)
    run(bm, c)  # the sweep goes on past b rather than back into a's freed run
    assert c.block_table == [8, 9, 10]


def test_a_fragmented_pool_still_gives_every_free_block():
    bm = BlockManager(8, 2)
    seqs = [seq([i] * 2, i) for i in range(8)]  # one block each, every other freed: no two free blocks in a row
    for s in seqs:
        bm.allocate(s, 2)
    freed = [b for s in seqs[::2] for b in s.block_table]
    for s in seqs[::2]:
        bm.free(s)
    big = seq([9] * 8, 9)
    bm.allocate(big, 8)
    assert sorted(big.block_table) == sorted(freed) and len(freed) == 4
    assert bm.num_free_blocks == 0


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


def test_a_drained_pool_places_from_its_first_block_again():
    bm = BlockManager(64, 4)
    a = seq([1] * 8)
    run(bm, a)
    bm.free(a)
    b = seq([2] * 8, 1)
    run(bm, b)  # a's run was 18 blocks (8 tokens + 64 max_tokens); its two full blocks stay cached
    assert b.block_table[0] == 2 and len(bm.hash_to_block) == 4


@pytest.mark.parametrize("huge", [10**13, 2**63 - 1, 2**70])
def test_a_huge_max_tokens_sizes_no_run_past_the_context(huge):
    """A new run is sized by prompt plus max_tokens, capped by the context (4 blocks here): a huge max_tokens
    neither sizes a search pattern by it nor takes the whole pool for one sequence."""
    bm = BlockManager(16, 4, max_model_len=16)
    a, b = (Sequence(Request(str(i), [i] * 5, SamplingParams(max_tokens=huge)), i) for i in range(2))
    run(bm, a)
    run(bm, b)
    assert a.block_table == [0, 1] and b.block_table == [4, 5]  # each run holds room to the context, no more
    alone = BlockManager(3, 4)  # without a context the pool is the cap
    c = Sequence(Request("c", [1] * 5, SamplingParams(max_tokens=huge)), 2)
    run(alone, c)
    assert c.block_table == [0, 1]
