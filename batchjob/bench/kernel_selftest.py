"""Every Triton kernel against its torch reference (batchjob.model.ops) on realistic shapes, with timings.

    from batchjob.bench.kernel_selftest import run_selftest
    from batchjob.bench.tables import format_selftest

    print(format_selftest(run_selftest("cuda")))

On a CPU it runs in Triton's interpreter with small=True (tiny shapes); the interpreter is switched on here if no
kernel module has been imported yet. Each row: kernel, case, dtype, shape, max_abs_err, tol, passed, triton_ms,
torch_ms, speedup (torch_ms / triton_ms), and error (a message when the kernel raised).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import accumulate

import torch

from batchjob import env
from batchjob.bench.measure import best_seconds

# (name, heads, kv_heads, head_dim, hidden, intermediate)
CONFIGS = [
    ("smollm2-135m", 9, 3, 64, 576, 1536),
    ("llama-8b", 32, 8, 128, 4096, 14336),
]
SMALL_CONFIGS = [
    ("h9-kv3-d64", 9, 3, 64, 96, 80),
    ("h8-kv2-d128", 8, 2, 128, 128, 72),
]
# encoders' attention (varlen_attention): (name, heads, head_dim)
ENCODER_CONFIGS = [("all-minilm-l6-v2", 12, 32), ("bert-base", 12, 64)]
SMALL_ENCODER_CONFIGS = [("h4-d32", 4, 32), ("h2-d48", 2, 48)]

# allclose-style: |a - b| <= atol + rtol * |b|
TOLS = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _err(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    ok = bool((diff <= atol + rtol * b.abs()).all()) and not bool(a.isnan().any())
    return float(diff.max()) if diff.numel() else 0.0, ok


def _row(
    kernel: str,
    case: str,
    dtype,
    shape: str,
    check: Callable,
    fast: Callable,
    slow: Callable,
    tol: str,
    device: str,
    reps: int,
) -> dict:
    """reps=0: check only, no timing."""
    row = dict(
        kernel=kernel,
        case=case,
        dtype=str(dtype).replace("torch.", ""),
        shape=shape,
        max_abs_err=None,
        tol=tol,
        passed=False,
        triton_ms=None,
        torch_ms=None,
        speedup=None,
        error=None,
    )
    try:
        row["max_abs_err"], row["passed"] = check()
        if reps:
            row["triton_ms"] = 1000 * best_seconds(fast, reps, device)
            row["torch_ms"] = 1000 * best_seconds(slow, reps, device)
            row["speedup"] = row["torch_ms"] / row["triton_ms"] if row["triton_ms"] else None
    except Exception as e:  # a failing kernel is a failed row, not a failed self-test run
        row["error"] = f"{type(e).__name__}: {e}"[:300]
        row["passed"] = False
    return row


def _add_kv_read_rate(row: dict, case, specs: list[tuple[int, int]], fp8: bool) -> None:
    """A timed decode row's KV read rate: what a decode must read, the whole context's K and V (and their fp8
    scales), per second, to set against the device's copy rate."""
    if row["triton_ms"]:
        _, _, kv_heads, head_dim = case.k_cache.shape
        per_token = 2 * kv_heads * (head_dim * case.k_cache.element_size() + (4 if fp8 else 0))
        row["kv_read_tb_per_s"] = per_token * sum(p + n for p, n in specs) / (row["triton_ms"] / 1000) / 1e12


def run_selftest(
    device: str = "cuda", small: bool = False, dtype: torch.dtype | None = None, reps: int | None = None
) -> list[dict]:
    """Run every kernel against batchjob.model.ops; see the module docstring for the row fields.
    small: tiny shapes (for the interpreter on a CPU). dtype: activations (default bf16 on CUDA, fp32 on a CPU).
    reps: timed repetitions after one warm-up call (default 10 on CUDA, 1 on a CPU); 0 checks without timing."""
    if device == "cpu":
        env.use_triton_interpreter()
    from batchjob.bench.kernel_cases import make_attention_case
    from batchjob.kernels import ops as kops
    from batchjob.kernels.attention import SPLIT_SIZE
    from batchjob.model import ops as ref

    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if reps is None:
        reps = 1 if device == "cpu" else 10
    rtol, atol = TOLS[dtype]
    tol = f"rtol={rtol:g} atol={atol:g}"
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    rows: list[dict] = []
    for name, H, KVH, D, hidden, inter in SMALL_CONFIGS if small else CONFIGS:
        T = 64 if small else 4096
        page = 16

        # RMSNorm with the fused residual add
        x, res, w = randn(T, hidden), randn(T, hidden), (1 + 0.1 * randn(hidden)).to(dtype)

        def check_rms():
            out, new_res = kops.rms_norm(x, w, 1e-5, res)
            r_out, r_res = ref.rms_norm(x, w, 1e-5, res)
            e1, ok1 = _err(out, r_out, rtol, atol)
            e2, ok2 = _err(new_res, r_res, 0.0, 0.0)
            return max(e1, e2), ok1 and ok2

        rows.append(
            _row(
                "rms_norm",
                f"{name} +residual",
                dtype,
                f"[{T}, {hidden}]",
                check_rms,
                lambda: kops.rms_norm(x, w, 1e-5, res),
                lambda: ref.rms_norm(x, w, 1e-5, res),
                tol,
                device,
                reps,
            )
        )

        # rotary on views of a fused qkv, as the model passes them
        qkv = randn(T, (H + 2 * KVH) * D)
        q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q, k = q.view(T, H, D), k.view(T, KVH, D)
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = torch.outer(torch.arange(8192, dtype=torch.float64), inv)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)
        positions = torch.randint(0, 8192, (T,), generator=g, device=device)

        def check_rotary():
            (a, b), (c, d) = kops.rotary(q, k, positions, cos_sin), ref.rotary(q, k, positions, cos_sin)
            (e1, ok1), (e2, ok2) = _err(a, c, rtol, atol), _err(b, d, rtol, atol)
            return max(e1, e2), ok1 and ok2

        rows.append(
            _row(
                "rotary",
                name,
                dtype,
                f"q[{T}, {H}, {D}] k[{T}, {KVH}, {D}]",
                check_rotary,
                lambda: kops.rotary(q, k, positions, cos_sin),
                lambda: ref.rotary(q, k, positions, cos_sin),
                tol,
                device,
                reps,
            )
        )

        # SiLU-and-mul
        gu = randn(T, 2 * inter, scale=3.0)
        rows.append(
            _row(
                "silu_and_mul",
                name,
                dtype,
                f"[{T}, {2 * inter}]",
                lambda: _err(kops.silu_and_mul(gu), ref.silu_and_mul(gu), rtol, atol),
                lambda: kops.silu_and_mul(gu),
                lambda: ref.silu_and_mul(gu),
                tol,
                device,
                reps,
            )
        )

        # KV store, plain and fp8
        num_blocks = T // page * 2
        slots = torch.randperm(num_blocks * page, generator=torch.Generator().manual_seed(1))[:T].to(device)
        slots[::7] = -1
        kk, vv = randn(T, KVH, D, scale=2.0), randn(T, KVH, D, scale=2.0)
        for fp8 in (False, True):
            cdt = ref.FP8_DTYPE if fp8 else dtype

            def caches():
                shape = (num_blocks, page, KVH, D)
                c = [
                    torch.zeros(shape, dtype=torch.uint8, device=device).view(cdt)
                    if fp8
                    else torch.zeros(shape, dtype=cdt, device=device)
                    for _ in range(2)
                ]
                if fp8:
                    c += [torch.zeros(shape[:3], device=device) for _ in range(2)]
                return c

            mine, theirs = caches(), caches()

            def check_store(mine=mine, theirs=theirs, fp8=fp8):
                kops.store_kv(kk, vv, mine[0], mine[1], slots, *mine[2:])
                ref.store_kv(kk, vv, theirs[0], theirs[1], slots, *theirs[2:])
                if not fp8:
                    return max(_err(a, b, 0.0, 0.0)[0] for a, b in zip(mine, theirs)), all(
                        torch.equal(a, b) for a, b in zip(mine, theirs)
                    )
                err, ok = 0.0, True
                for c in range(2):  # dequantized values; pass: scales equal, codes at most one step apart
                    da = mine[c].float() * mine[2 + c].unsqueeze(-1)
                    db = theirs[c].float() * theirs[2 + c].unsqueeze(-1)
                    err = max(err, float((da - db).abs().max()))
                    step = (mine[c].view(torch.uint8).int() - theirs[c].view(torch.uint8).int()).abs()
                    ok = ok and int(step.max()) <= 1 and torch.allclose(mine[2 + c], theirs[2 + c], rtol=1e-6, atol=0)
                return err, ok

            rows.append(
                _row(
                    "store_kv",
                    f"{name} {'fp8' if fp8 else 'plain'}",
                    dtype,
                    f"[{T}, {KVH}, {D}] -> {'fp8' if fp8 else str(cdt).replace('torch.', '')}",
                    check_store,
                    lambda m=mine: kops.store_kv(kk, vv, m[0], m[1], slots, *m[2:]),
                    lambda t=theirs: ref.store_kv(kk, vv, t[0], t[1], slots, *t[2:]),
                    "codes +-1, scales" if fp8 else "exact",
                    device,
                    reps,
                )
            )

        # paged attention: prefill chunks with prefix hits, long decodes, and a mix
        gen = torch.Generator().manual_seed(2)

        def ri(lo, hi):
            return int(torch.randint(lo, hi + 1, (1,), generator=gen))

        if small:
            prefill = [(0, 16), (ri(1, 40), 16), (32, 16), (ri(1, 20), 16)]
            decode = [(ri(10, 120), 1) for _ in range(7)] + [(SPLIT_SIZE + 20, 1)]
            mixed = prefill[:2] + decode[:4]
        else:
            prefill = [(0 if i % 2 == 0 else ri(16, 1024), 256) for i in range(16)]  # T = 4096
            decode = [(ri(1792, 2304), 1) for _ in range(256)]
            mixed = prefill[:8] + decode[:128]
        cases = [
            ("prefill", prefill, None),
            ("decode", decode, None),
            ("mixed", mixed, None),
            ("decode fp8", decode, ref.FP8_DTYPE),
        ]
        for case_name, specs, cache_dtype in cases:
            row_tol = tol if cache_dtype is None else f"rtol={rtol:g} atol={2 * atol:g}"
            try:
                c = make_attention_case(
                    specs,
                    heads=H,
                    kv_heads=KVH,
                    head_dim=D,
                    page=page,
                    dtype=dtype,
                    cache_dtype=cache_dtype,
                    device=device,
                    seed=len(specs),
                )
            except Exception as e:
                rows.append(
                    dict(kernel="paged_attention", case=f"{name} {case_name}", error=f"setup: {e}"[:300], passed=False)
                )
                continue
            n_tok = sum(n for _, n in specs)
            shape = f"{len(specs)} seqs, {n_tok} rows, ctx<={max(p + n for p, n in specs)}, H={H}/KVH={KVH}/D={D}"

            def check_attn(c=c, fp8=cache_dtype is not None):
                out = kops.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale, *c.scales)
                return _err(out, c.reference(), rtol, 2 * atol if fp8 else atol)

            rows.append(
                _row(
                    "paged_attention",
                    f"{name} {case_name}",
                    dtype,
                    shape,
                    check_attn,
                    lambda c=c: kops.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale, *c.scales),
                    lambda c=c: ref.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale, *c.scales),
                    row_tol,
                    device,
                    reps,
                )
            )
            if case_name.startswith("decode"):
                _add_kv_read_rate(rows[-1], c, specs, fp8=cache_dtype is not None)
            del c
            if device.startswith("cuda"):
                torch.cuda.empty_cache()

    # encoder attention: bidirectional over packed sequences of mixed lengths (one token to past a query tile; up to
    # 512 at full size, BERT's limit), q/k/v views of one fused qkv as BERT passes them
    gen = torch.Generator().manual_seed(3)
    for name, H, D in SMALL_ENCODER_CONFIGS if small else ENCODER_CONFIGS:
        lengths = [1, 70, 9, 33] if small else [1, 512, *torch.randint(2, 512, (62,), generator=gen).tolist()]
        T = sum(lengths)
        q, k, v = randn(T, 3 * H * D).view(T, 3, H, D).unbind(1)
        cu_seqlens = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)
        args = (q, k, v, cu_seqlens, D**-0.5)
        rows.append(
            _row(
                "varlen_attention",
                name,
                dtype,
                f"{len(lengths)} seqs, {T} rows, len<={max(lengths)}, H={H}/D={D}",
                lambda a=args: _err(kops.varlen_attention(*a), ref.varlen_attention(*a), rtol, atol),
                lambda a=args: kops.varlen_attention(*a),
                lambda a=args: ref.varlen_attention(*a),
                tol,
                device,
                reps,
            )
        )
    rows += _fused_moe_rows(kops, ref, device, small, dtype, reps, randn)
    return rows


# (experts, top-k, hidden, expert intermediate, token counts): Qwen3-30B-A3B's sparse layer, at a decode batch and a
# prefill chunk
MOE_CONFIG = ("qwen3-30b-a3b", 128, 8, 2048, 768, (256, 4096))
SMALL_MOE_CONFIG = ("e8-k2", 8, 2, 96, 80, (5, 40))


def _fused_moe_rows(kops, ref, device: str, small: bool, dtype, reps: int, randn: Callable) -> list[dict]:
    """The fused-MoE grouped GEMM (kernels/moe.py) against the per-expert matmuls of model/ops.py, the whole MLP:
    routing drawn as a router's softmax top-k, weights scaled so that every stage stays near unit size."""
    name, experts, top_k, hidden, inter, token_counts = SMALL_MOE_CONFIG if small else MOE_CONFIG
    rtol, atol = TOLS[dtype]
    gate, up = ([randn(inter, hidden, scale=hidden**-0.5) for _ in range(experts)] for _ in range(2))
    down = [randn(hidden, inter, scale=inter**-0.5) for _ in range(experts)]
    stacked, linears = kops.moe_experts(gate, up, down), ref.moe_experts(gate, up, down)
    del gate, up, down
    rows = []
    for t in token_counts:
        x = randn(t, hidden)
        probs = torch.softmax(randn(t, experts).float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        rows.append(
            _row(
                "fused_moe",
                f"{name} T={t}",
                dtype,
                f"[{t}, {hidden}] E={experts} k={top_k} I={inter}",
                lambda x=x, w=weights, i=ids: _err(
                    kops.fused_moe(x, stacked, w, i), ref.fused_moe(x, linears, w, i), rtol, atol
                ),
                lambda x=x, w=weights, i=ids: kops.fused_moe(x, stacked, w, i),
                lambda x=x, w=weights, i=ids: ref.fused_moe(x, linears, w, i),
                f"rtol={rtol:g} atol={atol:g}",
                device,
                reps,
            )
        )
        if device.startswith("cuda") and t == token_counts[0]:
            rows.append(
                _row(
                    "fused_moe",
                    f"{name} T={t} CUDA graph",
                    dtype,
                    f"[{t}, {hidden}] captured, replayed on other inputs",
                    lambda x=x, w=weights, i=ids: _graph_replay_err(kops, stacked, x, w, i),
                    None,
                    None,
                    "exact",
                    device,
                    0,
                )
            )
    return rows


def _graph_replay_err(kops, stacked, x, weights, ids) -> tuple[float, bool]:
    """fused_moe captured in a CUDA graph (a capture fails at any host synchronisation) and replayed on other
    inputs: the eager kernels' result on them, bit for bit."""
    static = [x.clone(), weights.clone(), ids.clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        kops.fused_moe(static[0], stacked, static[1], static[2])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kops.fused_moe(static[0], stacked, static[1], static[2])
    other = [x.flip(0), weights.flip(0), ids.flip(0)]
    for dst, src in zip(static, other):
        dst.copy_(src)
    graph.replay()
    return _err(out, kops.fused_moe(other[0], stacked, other[1], other[2]), 0.0, 0.0)


# The tuning sweep's configurations (issue 29: decode attention near the copy rate, fp32 prefill at head dim 128).
# 18 configurations: each compiles once, a second or two on the device, inside the kernels part's cap.
DECODE_SWEEP = [(split, block_n, warps) for split in (256, 512) for block_n in (32, 64, 128) for warps in (4, 8)]
FP32_PREFILL_SWEEP = [(64, 64, 4), (64, 32, 4), (32, 64, 4), (32, 32, 4), (32, 32, 8), (16, 32, 4)]


def run_tuning(
    device: str = "cuda", small: bool = False, reps: int | None = None, until: float | None = None
) -> list[dict]:
    """The paged attention kernel's knobs swept on the largest shape, each configuration checked against the torch
    reference and timed: decode in bf16 (split size, key tile, warps; with the KV bytes read per second) and prefill
    in fp32 at head dim 128 (varlen tiles, warps). Rows as run_selftest's, the configuration in `case`; the default
    configuration is marked. What a device run of it says is what the defaults should be. Past `until` (a
    perf_counter time) the configurations left are not run: a last row, not failed, counts them."""
    if device == "cpu":
        env.use_triton_interpreter()
    from batchjob.bench.kernel_cases import make_attention_case
    from batchjob.kernels.attention import DECODE_BLOCK_N, SPLIT_SIZE, paged_attention_impl, varlen_tiles
    from batchjob.model import ops as ref

    if reps is None:
        reps = 1 if device == "cpu" else 10
    name, H, KVH, D, _, _ = (SMALL_CONFIGS if small else CONFIGS)[-1]
    gen = torch.Generator().manual_seed(3)
    if small:
        decode = [(int(torch.randint(10, 700, (1,), generator=gen)), 1) for _ in range(4)]
        prefill = [(0, 16), (24, 16)]
        decode_sweep, prefill_sweep = [(256, 32, 4), (SPLIT_SIZE, DECODE_BLOCK_N, 4)], [(32, 32, 4)]
    else:
        decode = [(int(torch.randint(1792, 2304, (1,), generator=gen)), 1) for _ in range(256)]
        prefill = [(0 if i % 2 == 0 else 512, 256) for i in range(16)]
        decode_sweep, prefill_sweep = DECODE_SWEEP, FP32_PREFILL_SWEEP
    rows: list[dict] = []
    skipped = 0
    for dtype, specs, sweep in ((torch.bfloat16, decode, decode_sweep), (torch.float32, prefill, prefill_sweep)):
        dtype = dtype if not small else torch.float32  # the interpreter's half-precision dots are not reliable
        rtol, atol = TOLS[dtype]
        c = make_attention_case(specs, heads=H, kv_heads=KVH, head_dim=D, page=16, dtype=dtype, device=device)
        shape = f"{len(specs)} seqs, ctx<={max(p + n for p, n in specs)}, H={H}/KVH={KVH}/D={D}"
        for config in sweep:
            if until is not None and time.perf_counter() > until:
                skipped += 1
                continue
            if specs is decode:
                split, block_n, warps = config
                knobs = dict(split_size=split, decode_block_n=block_n, decode_warps=warps)
                default = config == (SPLIT_SIZE, DECODE_BLOCK_N, 4)
                case = f"{name} decode split={split} block_n={block_n} warps={warps}"
            else:
                block_m, block_n, warps = config
                knobs = dict(varlen_block=(block_m, block_n), varlen_warps=warps)
                default = (block_m, block_n) == varlen_tiles(4, D, H // KVH) and warps == 4
                case = f"{name} prefill tiles={block_m}x{block_n} warps={warps}"

            def attend(c=c, knobs=knobs):
                return paged_attention_impl(c.q, c.k_cache, c.v_cache, c.meta, c.scale, **knobs)

            rows.append(
                _row(
                    "paged_attention tuning",
                    case + (" (default)" if default else ""),
                    dtype,
                    shape,
                    lambda attend=attend, c=c: _err(attend(), c.reference(), rtol, atol),
                    attend,
                    lambda c=c: ref.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale),
                    f"rtol={rtol:g} atol={atol:g}",
                    device,
                    reps,
                )
            )
            if specs is decode:
                _add_kv_read_rate(rows[-1], c, specs, fp8=False)
        del c
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if skipped:
        note = f"{skipped} of {len(decode_sweep) + len(prefill_sweep)} configurations not run: the time cap came first"
        rows.append(dict(kernel="paged_attention tuning", case="sweep cut short", passed=None, error=note))
    return rows
