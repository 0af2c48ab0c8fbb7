"""The torch paged attention against plain causal attention over each sequence's dense K/V (the C++ op is checked
against the torch path in test_cpu_ops.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchjob.model import ops
from batchjob.model.attention_metadata import AttentionMetadata


def dense_reference(q, ks, vs, query_lens, scale):
    """Sequence by sequence: its query rows are the last of its context; heads repeated for GQA."""
    out, row = [], 0
    for k, v, n in zip(ks, vs, query_lens):
        c, kvh, _ = k.shape
        g = q.shape[1] // kvh
        qs = q[row : row + n].transpose(0, 1)  # [H, n, D]
        kk, vv = (x.repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))  # [H, C, D]
        mask = torch.arange(c).view(1, -1) <= torch.arange(c - n, c).view(-1, 1)
        out.append(F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_matches_dense_attention_on_a_mixed_step(seed):
    """Decodes and prefill chunks (some after a cached prefix) of very different lengths, so that the step is split
    into several padded calls; blocks scattered over the pool."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 4, 512
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables, ks, vs = [], [], [], [], []
    for _ in range(12):
        seq_len = rng.choice([1, 3, 17, 40, 95, 200])
        n = rng.choice([1, seq_len, max(1, seq_len // 3)])  # a decode, a whole prompt, a later chunk
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        k, v = torch.randn(seq_len, kv_heads, dim), torch.randn(seq_len, kv_heads, dim)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        ops.store_kv(k, v, k_cache, v_cache, slots)
        query_lens.append(n), seq_lens.append(seq_len), ks.append(k), vs.append(v)
        tables.append(blocks)
    width = max(map(len, tables))
    meta = AttentionMetadata.build(
        query_lens, seq_lens, [t + [-1] * (width - len(t)) for t in tables], [0] * sum(query_lens)
    )
    q = torch.randn(sum(query_lens), heads, dim)
    out = ops.paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, dense_reference(q, ks, vs, query_lens, 0.25), atol=1e-5, rtol=1e-5)
    [groups] = meta.plan_cache.values()
    assert len(groups) > 2  # the lengths above do not fit in one padded call per kind
    torch.testing.assert_close(ops.paged_attention(q, k_cache, v_cache, meta, 0.25), out)  # the kept plan
    dense = dense_reference(q, ks, vs, query_lens, 0.25)
    torch.testing.assert_close(ops.paged_attention(q, k_cache, v_cache, meta, 0.25), dense, atol=1e-5, rtol=1e-5)


def test_buckets_bound_the_padding():
    sizes = [300, 10, 290, 250, 199, 120, 11, 9]
    buckets = ops.size_buckets(sizes)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    for b in buckets:
        assert all(sizes[i] >= ops._BUCKET_FILL * max(sizes[j] for j in b) for i in b)
    assert buckets == [[0, 2, 3], [4], [5], [6, 1, 7]]


def test_varlen_attention_matches_each_sequence_alone():
    """The padded SDPA of packed sequences against plain bidirectional SDPA on each sequence's rows: q, k and v as
    strided views of one fused qkv, as BERT passes them."""
    torch.manual_seed(0)
    lengths, heads, dim = [1, 30, 7, 64, 2], 3, 24
    t = sum(lengths)
    q, k, v = torch.randn(t, 3, heads, dim).unbind(1)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = ops.varlen_attention(q, k, v, cu_seqlens, 0.3)
    starts = cu_seqlens.tolist()
    for s, e in zip(starts, starts[1:]):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        alone = F.scaled_dot_product_attention(qs, ks, vs, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[s:e], alone, atol=1e-6, rtol=1e-5)
