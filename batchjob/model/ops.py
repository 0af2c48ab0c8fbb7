"""The model's numeric ops, in torch: the reference of the other backends. The model calls only these, so that the
Triton kernels (package `kernels`) replace them on a CUDA device behind the same signatures, and on a CPU the C++
kernels of cpu_ops.py where they are built. None of these writes its input activations."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby, pairwise

import torch
import torch.nn.functional as F

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.fp8 import FP8_DTYPE, quantize_fp8
from batchjob.model.lora.slots import lora_add  # noqa: F401 (an op of the backend: the torch form)
from batchjob.model.moe import ExpertLinears

# store_kv and paged_attention's plan read device values on the host (masks, lengths): no CUDA graph can hold a step
CAPTURABLE = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm; with `residual`, first adds it to x and returns (normed, x + residual) as HF's decoder layer does."""
    if residual is not None:
        x = x + residual
        residual = x
    # Normalise in fp32 and round before the weight, as HF's LlamaRMSNorm does.
    out = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotary embedding in the neox/HF layout (halves, not interleaved pairs).
    q [T, H, D], k [T, KVH, D], cos_sin_cache [max_pos, R]: cos in the first R/2 columns, sin in the rest. The first
    R dims of each head turn (R < D: partial rotary, as Phi-4-mini's) and the other D - R pass as they are."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    r = cos_sin_cache.shape[-1]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :r].float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:].float()), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holds gate then up; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def count_greater(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """x [R, V], threshold [R, 1]: how many of each row's values exceed its threshold (int64 [R]); a prompt token's
    rank less one, from its row of logprobs."""
    return (x > threshold).sum(-1)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holds gate then up; returns gelu_tanh(gate) * up (Gemma's MLP, HF's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def moe_experts(gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]) -> ExpertLinears:
    """A sparse layer's experts, each expert's gate [I, H], up [I, H] and down [H, I], laid out for fused_moe: a
    gate_up and a down Linear an expert (packed for the CPU's GEMM where they can be)."""
    return ExpertLinears(gate, up, down)


def fused_moe(
    x: torch.Tensor, experts: ExpertLinears, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; each row's k experts topk_ids [T, k] and their weights [T, k] -> [T, H]: the sum over the row's
    experts of weight * down(silu(gate) * up)."""
    return per_expert_moe(x, experts, topk_weights, topk_ids, silu_and_mul)


def per_expert_moe(x, experts: ExpertLinears, topk_weights, topk_ids, act_and_mul) -> torch.Tensor:
    """fused_moe with a backend's own silu_and_mul: the step's (row, expert) pairs sorted by expert, so that each
    active expert's rows lie together, one gate_up and one down matmul an active expert, sized from the per-expert
    counts read on the host."""
    t, k = topk_ids.shape
    flat = topk_ids.flatten()  # pair p = (row p // k, its p % k-th expert)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the host read
    rows = x[order // k]
    out = torch.empty_like(rows)
    start = 0
    for (gate_up, down), n in zip(experts.pairs, counts):
        if n:
            out[start : start + n] = down(act_and_mul(gate_up(rows[start : start + n])))
            start += n
    out *= topk_weights.flatten()[order].unsqueeze(-1)
    # back to pair order, then each row's k terms summed in a fixed order (no atomics: the same sums on a GPU)
    pairs = torch.empty_like(out)
    pairs[order] = out
    return pairs.view(t, k, x.shape[-1]).sum(dim=1)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale_cache=None, v_scale_cache=None) -> None:
    """Write the step's K/V rows into the paged cache [num_blocks, block_size, KVH, D] at slot_mapping
    (slots < 0 are skipped). An fp8 cache also stores per-(slot, head) scales [num_blocks, block_size, KVH]."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8_DTYPE:
        (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
        # index_copy_ has no fp8 kernel on CPU: copy the raw bytes.
        flat_k.view(torch.uint8).index_copy_(0, slot_mapping, kq.view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slot_mapping, vq.view(torch.uint8))
        k_scale_cache.view(-1, k_scale_cache.shape[-1]).index_copy_(0, slot_mapping, ks)
        v_scale_cache.view(-1, v_scale_cache.shape[-1]).index_copy_(0, slot_mapping, vs)
    else:
        flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, scale_cache: torch.Tensor | None, blocks: torch.Tensor, dtype) -> torch.Tensor:
    """The cache's blocks [B, nb] as [B, KVH, nb * block_size, D] in dtype (dequantized when fp8). Whole blocks are
    copied: far faster than gathering slot by slot."""
    b, nb = blocks.shape
    flat = blocks.flatten()
    if cache.dtype == FP8_DTYPE:
        out = cache.view(torch.uint8).index_select(0, flat).view(FP8_DTYPE).to(torch.float32)
        out = out * scale_cache.index_select(0, flat).unsqueeze(-1)
    else:
        out = cache.index_select(0, flat)
    return out.to(dtype).view(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


@dataclass
class _Group:
    """One batched attention call of a step (a bucket of its decodes or of its prefill chunks); the same for every
    layer."""

    rows: torch.Tensor  # the group's query rows of q, sequence after sequence
    blocks: torch.Tensor  # [B, nb] block ids, padding clamped to block 0 (masked out)
    mask: torch.Tensor  # [B, 1, max_q * G, C]: (query row, head in group) sees key position c
    valid_q: torch.Tensor  # [B, max_q]: which padded query slots are real rows
    max_q: int


_BUCKET_FILL = 2 / 3  # a sequence joins a call only if it needs at least this share of the call's padded size


def size_buckets(sizes: list[int]) -> list[list[int]]:
    """Indexes of `sizes` in calls whose members are padded to the call's largest size: largest first, a new call
    whenever the next size falls below _BUCKET_FILL of the current call's, so that padding wastes at most a third
    of the memory traffic (which bounds decode attention on a CPU), at the price of one more call."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and sizes[i] >= _BUCKET_FILL * sizes[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _plan(meta: AttentionMetadata, block_size: int, g: int, sliding_window: int | None = None) -> list[_Group]:
    """Built at the first layer and kept on `meta`: indexes and masks cost as much as the attention itself when
    every layer rebuilds them. Decodes and prefill chunks go to separate calls, each bucketed by padded size. With a
    sliding window, a query at position p sees the keys in (p - window, p]."""
    key = (block_size, g, sliding_window)
    if key in meta.plan_cache:
        return meta.plan_cache[key]
    device = meta.seq_lens.device
    all_seq_lens = meta.seq_lens.to(torch.long)
    qlens, seq_lens_host, starts = meta.query_lens_host, meta.seq_lens_host, meta.query_start_loc.tolist()
    decodes = [i for i, n in enumerate(qlens) if n == 1]
    prefills = [i for i, n in enumerate(qlens) if n > 1]
    groups = []
    for kind, size in ((decodes, lambda i: seq_lens_host[i]), (prefills, lambda i: qlens[i] * seq_lens_host[i])):
        for bucket in size_buckets([size(i) for i in kind]):
            group = [kind[b] for b in bucket]
            idx = torch.tensor(group, dtype=torch.long, device=device)
            seq_lens = all_seq_lens[idx]
            q_lens = torch.tensor([qlens[i] for i in group], device=device)
            nb = -(-max(seq_lens_host[i] for i in group) // block_size)
            max_q = max(qlens[i] for i in group)
            pos = torch.arange(nb * block_size, device=device)
            # Query row j of a sequence sits at absolute position seq_len - q_len + j.
            j = torch.arange(max_q, device=device)
            valid_q = j.unsqueeze(0) < q_lens.unsqueeze(1)
            qpos = (seq_lens - q_lens).unsqueeze(1) + j.unsqueeze(0)
            mask = pos.view(1, 1, -1) <= qpos.unsqueeze(-1)  # [B, max_q, C]
            mask &= pos.view(1, 1, -1) < seq_lens.view(-1, 1, 1)
            if sliding_window is not None:
                mask &= pos.view(1, 1, -1) > qpos.unsqueeze(-1) - sliding_window
            mask[:, :, 0] |= ~valid_q  # padding rows see one key so that softmax stays finite; they are dropped
            groups.append(
                _Group(
                    rows=torch.cat([torch.arange(starts[i], starts[i] + qlens[i], device=device) for i in group]),
                    blocks=meta.block_tables[idx, :nb].to(torch.long).clamp(min=0),
                    mask=mask.repeat_interleave(g, dim=1).unsqueeze(1),
                    valid_q=valid_q,
                    max_q=max_q,
                )
            )
    meta.plan_cache[key] = groups
    return groups


def _softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """SDPA with the scores soft-capped before the mask, as HF's Gemma 2 does: cap * tanh(scores / cap)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    k_scale_cache=None,
    v_scale_cache=None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the step's query rows q [T, H, D] over each sequence's cached context, read through its
    block table, in a few batched calls (see _plan): each call gathers its blocks, then SDPA. The G query heads that
    share a KV head are folded into query rows, so K/V are never expanded to H heads. `sliding_window` limits a query
    at position p to the keys in (p - window, p]; `logits_soft_cap` maps the scaled scores s to cap * tanh(s / cap)."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    out = torch.empty_like(q)
    for grp in _plan(meta, k_cache.shape[1], g, sliding_window):
        b, max_q = grp.blocks.shape[0], grp.max_q
        k = _gather(k_cache, k_scale_cache, grp.blocks, q.dtype)  # [B, KVH, C, D]
        v = _gather(v_cache, v_scale_cache, grp.blocks, q.dtype)
        if max_q == 1:
            qb = q[grp.rows].unsqueeze(1)
        else:
            qb = q.new_zeros(b, max_q, h, d)
            qb[grp.valid_q] = q[grp.rows]
        # [B, max_q, KVH, G, D] -> [B, KVH, max_q * G, D]: rows of one KV head are (query row, head in group).
        qb = qb.view(b, max_q, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, max_q * g, d)
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=grp.mask, scale=scale)
        else:
            o = _softcapped_attention(qb, k, v, grp.mask, scale, logits_soft_cap)
        o = o.view(b, kvh, max_q, g, d).permute(0, 2, 1, 3, 4).reshape(b, max_q, h, d)
        out[grp.rows] = o[grp.valid_q]
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention of packed sequences, an encoder's: q, k, v [T, H, D] hold the sequences' rows end to
    end, sequence i in rows cu_seqlens[i]:cu_seqlens[i + 1] (int32, on q's device); each query attends to every key
    of its own sequence (flash-attn's flash_attn_varlen_func without causal). Returns [T, H, D].

    One SDPA call per run of sequences of one length lying end to end, unpadded (the embedder sorts texts by length,
    so a pass holds a few runs): a sequence is then computed by the same kernel on the same shape whatever else is
    in its pass. Padded to a pass's longest, SDPA summed a row in another order as the longest changed, and a bf16
    embedding differed by up to 1e-3 between passes (a resumed job's from the uninterrupted one's). A call per run,
    not per sequence: a call per sequence and layer ran several times slower on short texts."""
    bounds = cu_seqlens.tolist()
    outs, start = [], 0
    for length, run in groupby(b - a for a, b in pairwise(bounds)):
        count = sum(1 for _ in run)
        if not length:  # empty sequences: no rows
            continue
        end = start + count * length
        # [sequences of the run, H, length, D]: views into the packed rows
        qs, ks, vs = (x[start:end].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).flatten(0, 1))
        start = end
    return torch.cat(outs) if outs else torch.empty_like(q)
