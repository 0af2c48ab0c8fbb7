"""Builders of paged-attention steps, shared by the tests and the self-test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.model import ops as ref
from batchjob.model.attention_metadata import AttentionMetadata


@dataclass
class AttentionCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    meta: AttentionMetadata
    scale: float
    step_k: torch.Tensor  # [T, KVH, D]: this step's K/V rows (already stored in the caches)
    step_v: torch.Tensor

    @property
    def scales(self) -> tuple:
        return () if self.k_scale is None else (self.k_scale, self.v_scale)

    def reference(self, **options) -> torch.Tensor:
        """batchjob.model.ops.paged_attention (with `options`: sliding_window, logits_soft_cap) on copies of the caches
        with the NaN fill of unwritten slots zeroed: the torch form reads whole padded blocks (and masks them), so NaNs
        there would reach its output as 0 * NaN."""

        def clean(c):
            if c is None:
                return None
            if c.dtype == ref.FP8_DTYPE:
                b = c.view(torch.uint8).clone()
                b[(b & 0x7F) == 0x7F] = 0
                return b.view(ref.FP8_DTYPE)
            return torch.nan_to_num(c, nan=0.0)

        scales = () if self.k_scale is None else (clean(self.k_scale), clean(self.v_scale))
        k, v = clean(self.k_cache), clean(self.v_cache)
        return ref.paged_attention(self.q, k, v, self.meta, self.scale, *scales, **options)


def make_attention_case(
    specs: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page: int,
    dtype=torch.float32,
    cache_dtype=None,
    device="cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> AttentionCase:
    """A step of sequences given as (cached prefix length, query rows): each sequence's context is its prefix plus
    its query rows. Blocks are handed out in a shuffled order, so that tables are not contiguous; the whole context
    (prefix and this step's rows) is written with the torch store_kv, as the model does before attention."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)  # block order, on the host
    gd = torch.Generator(device=device).manual_seed(seed)  # values, drawn where they are used (big on a GPU)
    seq_lens = [p + n for p, n in specs]
    q_lens = [n for _, n in specs]
    n_blocks = [-(-s // page) for s in seq_lens]
    num_blocks = sum(n_blocks) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(n_blocks + [1])
    tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(n_blocks):
        tables[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb

    def slots_of(i: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return tables[i, pos // page].long() * page + pos % page

    all_slots = torch.cat([slots_of(i, 0, p + n) for i, (p, n) in enumerate(specs)])
    step_slots = torch.cat([slots_of(i, p, p + n) for i, (p, n) in enumerate(specs)])
    total = len(all_slots)
    k_all = torch.randn(total, kv_heads, head_dim, generator=gd, device=device).to(dtype)
    v_all = torch.randn(total, kv_heads, head_dim, generator=gd, device=device).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, generator=gd, device=device).to(dtype)
    shape = (num_blocks, page, kv_heads, head_dim)
    # NaN fill: any read of a slot this step does not own would show up in the output
    if cache_dtype == ref.FP8_DTYPE:
        k_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(ref.FP8_DTYPE)
        v_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(ref.FP8_DTYPE)
        k_scale = torch.full(shape[:3], float("nan"), dtype=torch.float32, device=device)
        v_scale = torch.full(shape[:3], float("nan"), dtype=torch.float32, device=device)
    else:
        k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
        k_scale = v_scale = None
    all_slots_t = all_slots.to(device)
    extra = () if k_scale is None else (k_scale, v_scale)
    ref.store_kv(k_all, v_all, k_cache, v_cache, all_slots_t, *extra)
    # the step's own K/V rows, in step order
    step_idx, at = [], 0
    for p, n in specs:
        step_idx.append(torch.arange(at + p, at + p + n))
        at += p + n
    step_idx_t = torch.cat(step_idx).to(device)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, step_slots, device)
    return AttentionCase(
        q, k_cache, v_cache, k_scale, v_scale, meta, head_dim**-0.5, k_all[step_idx_t], v_all[step_idx_t]
    )
