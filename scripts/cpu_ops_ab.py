"""Usage: python scripts/cpu_ops_ab.py
   [steps|prof|gemm|int8|gguf|weight-only|run|attention|job|dtype|weights|int8-quality|invariance|sampler]
   (env: REPS, DECODE_SEQS, ROUNDS, N, SYN, PROFILE_STEPS, TOP, DTYPE, BASELINE, ROWS, HEAD, BITS, ALPHA,
   SMOOTH, FLOAT_DOWN, SHAPES, WEIGHTS)

A/B measurements of the CPU path, each interleaved in one process (the host is noisy: only same-run ratios count):
- steps (default): one forward pass per step shape (decode, prefill, mixed) on the real model and KV pool, the torch
  ops (BATCHJOB_CPU_OPS=torch) against the C++ kernels; `prof` adds a torch-profiler table per path and phase.
  DTYPE sets the engine's dtype (default: its own).
- gemm: a decoder layer's four matmuls at the model's shapes, F.linear against the weights packed for oneDNN's GEMM
  (model/matmul/linear.py), at 8 to 2,048 rows.
- int8: the same matmuls (and with HEAD=1 the LM head) per row count (ROWS, default 1 to 2,048), interleaved in one
  run: float32 and bfloat16 packed for oneDNN (matmul/linear.py), W8A8 through oneDNN's int8 GEMM on packed weights
  (model/matmul/int8_linear.py, activation quantization and scaling included) and through torch._int_mm: GFLOP/s and the
  ratio to float32. Under BATCHJOB_CPU_ISA=avx2 (oneDNN and MKL capped at AVX2) the bf16 column is left out.
- gguf: bf16 matmuls of Llama-3.2-1B's shapes (MLP up, down, qkv, the LM head) on GGUF blocks (Q4_K, Q6_K, Q8_0;
  matmul/gguf_linear.py) against oneDNN's packed bf16 GEMM on the weights dequantized, per row count (ROWS, default
  1,16,64,512), interleaved: GFLOP/s and the ratio.
- weight-only: a decoder layer's four matmuls at SHAPES' shapes (smollm2, default, or llama1b), float32 x, per row
  count (ROWS, default 1,16,64,256,2048), interleaved: oneDNN's float32 GEMM on W packed once (matmul/linear.py)
  against the weight-only blocks (Q8_0: int8, Q4_0, Q4_1: int4; matmul/weight_only.py) and torch's
  _weight_int8pack_mm (int8, one scale per output channel) and _weight_int4pack_mm_for_cpu (int4, groups of 32):
  ms per call summed over the four, and each path's ratio to float32's.
- run: N (64) prompts of 256 random tokens, 64 greedy tokens each, through the engine with the torch ops, the C++
  kernels, and the C++ kernels with packed matmuls: wall time, process CPU time, decode-only step time per round.
- attention: the C++ paged attention alone at SmolLM2's shapes (9 query heads, 3 KV heads of 64), best of 15 calls:
  causal GFLOP/s of prefills and chunks, and the cache bytes/s of a decode step over a 1.5 GiB pool (more than L3):
  blocks at random places, each sequence's blocks in one run, 32- and 64-token blocks, and every sequence on the same
  blocks (in cache: the kernel's compute alone).
  DTYPE=bfloat16: the same on a bf16 pool and queries (half the bytes a decode reads).
- job: the summarize job's rows through the engine, per round: wall time, prefill and decode-only step times, and
  torch-profiler lines for chosen steps (where a real step's time goes: its TOP ops, default 6). DTYPE sets the
  engine's dtype.
- dtype: N (64) prompts of 256 random tokens, 64 greedy tokens each (`batchjob bench --num-prompts 64 --input-len
  256 --output-len 64`'s workload, through the bench's run_engine), ROUNDS rounds of: the engine in float32, in
  bfloat16, and in bfloat16 with the LM head in bf16 too (bf16 logits): tok/s, prefill and decode-only step times,
  and the greedy outputs' agreement with float32 (whole sequences, first tokens).
- weights: the summarize job's first N (64) rows, ROUNDS rounds of the engine with `weights: dequantize` and
  `weights: WEIGHTS` (w8a8, int8 or int4; default w8a8) interleaved (DTYPE sets both engines' dtype, default auto):
  wall time, tok/s, prefill and decode-only step times, and how many greedy outputs the two share.
- int8-quality: `bench --quality`'s NLL without its transformers part: the summarize job's first N (24) rows, the
  fp32 engine's greedy continuations scored by the fp32 engine and by the w8a8 one (float32 otherwise) with 8-bit and
  with 7-bit weights (a CPU without VNNI's; BITS=8 or 7 for one): mean NLL per token and its difference to fp32's.
  Variants: ALPHA (SmoothQuant's migration strength, default model/smoothing.py's), SMOOTH=0 (no smoothing: the
  scales all 1), FLOAT_DOWN=1 (the down projection kept float).
- invariance: 32 prompts (as tests/engine/test_engine.py's) per dtype, 12 greedy tokens: how many equal the prompt's
  tokens alone when run in one batch, and in 64-token steps (chunked prefill).
- sampler: one step of N (64) rows over SmolLM2's vocabulary per sampling setting (temperature, top-p, top-k,
  penalties, seeds), the engine's sampler against BASELINE (a sampler.py file, e.g. an older commit's from
  `git show REV:batchjob/engine/sampler.py > /tmp/old_sampler.py`), ROUNDS rounds interleaved: ms a step."""

import os
import random
import statistics
import sys
import time

from batchjob.env import configure_threads

configure_threads()  # before torch loads: the OpenMP settings, and BATCHJOB_CPU_ISA's caps on oneDNN, MKL and ATen

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import batchjob.model.matmul.linear as linear
from batchjob.bench.quality import continuation_nll
from batchjob.bench.systems import run_engine
from batchjob.bench.workloads import job_workload, synthetic
from batchjob.engine.engine import Engine, SamplingParams
from batchjob.job.spec import load_job
from batchjob.model import llama, smoothing
from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.cpu_native import native_ops
from batchjob.model.matmul import int8_linear
from batchjob.model.matmul.int8_linear import Int8Linear, quantize_rows, quantize_weight

MODE = sys.argv[1] if len(sys.argv) > 1 else "steps"
rng = random.Random(0)


def set_ops(path: str) -> None:
    os.environ["BATCHJOB_CPU_OPS"] = "torch" if path == "torch" else ""


def dtype_setting() -> dict:
    """The engine's dtype from DTYPE, else its default."""
    return {"dtype": os.environ["DTYPE"]} if "DTYPE" in os.environ else {}


def random_step(runner, specs):
    """Inputs of one forward pass: specs give (cached context, query rows) per sequence, blocks drawn at random from
    the runner's pool, random token ids."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    ids, pos, slots, ql, sl, tables = [], [], [], [], [], []
    for ctx, n in specs:
        length = ctx + n
        t = [free.pop() for _ in range(-(-length // bs))]
        tables.append(t)
        ql.append(n)
        sl.append(length)
        for p in range(ctx, length):
            ids.append(rng.randrange(1000, 40000))
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
    w = max(map(len, tables))
    meta = AttentionMetadata.build(ql, sl, [t + [-1] * (w - len(t)) for t in tables], slots)
    return torch.tensor(ids), torch.tensor(pos), meta


def steps_ab() -> None:
    engine = Engine("smollm2-135m-instruct", **dtype_setting())
    runner = engine.runner
    model, caches = runner.model, runner.kv_caches

    def run(path, inputs):
        set_ops(path)
        ids, pos, meta = inputs
        meta.plan_cache.clear()
        t = time.perf_counter()
        with torch.inference_mode():
            model.forward(ids, pos, meta, caches)
        return time.perf_counter() - t

    n_dec = int(os.environ.get("DECODE_SEQS", "100"))
    phases = {
        f"decode {n_dec} seqs, context 300-500": random_step(
            runner, [(rng.randint(300, 500), 1) for _ in range(n_dec)]
        ),
        "prefill 8 x 256": random_step(runner, [(0, 256)] * 8),
        "mixed: 2 prefill chunks of 256 after 256 cached + 60 decodes (ctx 200-600)": random_step(
            runner, [(256, 256)] * 2 + [(rng.randint(200, 600), 1) for _ in range(60)]
        ),
    }
    for name, inputs in phases.items():
        run("native", inputs)
        run("torch", inputs)  # warm-up
        ts = {"torch": [], "native": []}
        for r in range(int(os.environ.get("REPS", "3"))):
            for path in ("torch", "native") if r % 2 == 0 else ("native", "torch"):
                ts[path].append(run(path, inputs))
        a, b = statistics.median(ts["torch"]), statistics.median(ts["native"])
        tokens = len(inputs[0])
        print(
            f"{name}: torch ops {a * 1e3:.0f} ms ({tokens / a:.0f} tok/s), "
            f"C++ kernels {b * 1e3:.0f} ms ({tokens / b:.0f} tok/s): x{a / b:.2f}  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    if MODE == "prof":
        for name, inputs in phases.items():
            for path in ("torch", "native"):
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    run(path, inputs)
                rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
                total = sum(e.self_cpu_time_total for e in rows)
                top = ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.1f}%" for e in rows[:7])
                print(f"[profile] {name} / {path}: {total / 1e3:.0f} ms self CPU: {top}", flush=True)


def gemm_ab() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
    weights = [torch.randn(n, k, generator=g) for n, k in shapes]
    packed = [linear.Linear(w, keep_weight=True) for w in weights]
    for rows in (8, 32, 64, 128, 256, 512, 2048):
        xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
        reps, ta, tb = max(2, 200 // rows), 0.0, 0.0
        for r in range(6):
            for which in ("plain", "packed") if r % 2 == 0 else ("packed", "plain"):
                t = time.perf_counter()
                for _ in range(reps):
                    for x, w, lin in zip(xs, weights, packed):
                        F.linear(x, w) if which == "plain" else lin(x)
                dt = time.perf_counter() - t
                ta, tb = (ta + dt, tb) if which == "plain" else (ta, tb + dt)
        flops = sum(2 * rows * n * k for n, k in shapes) * reps * 6
        print(
            f"{rows} rows: F.linear {flops / ta / 1e9:.0f} GFLOP/s, packed {flops / tb / 1e9:.0f} GFLOP/s "
            f"(x{ta / tb:.2f})  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def int8_ab() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] + ([(49152, 576)] if os.environ.get("HEAD") else [])
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in shapes]
    fp32 = [linear.Linear(w, keep_weight=True) for w in weights]
    int8 = [Int8Linear(w) for w in weights]
    # torch._int_mm: int8 x int8 -> int32 on W [K, N] as it lies (no packing), the same quantization and scaling
    int_mm = [(q.T.contiguous(), s) for q, s in map(quantize_weight, weights)]

    def int_mm_linear(x, i):
        q, s = quantize_rows(x)
        w, sw = int_mm[i]
        return torch._int_mm((q.view(torch.int8) ^ -128).view(torch.int8), w).float().mul_(s).mul_(sw)

    paths = {"fp32": lambda x, i: fp32[i](x), "int8 onednn": lambda x, i: int8[i](x), "int8 _int_mm": int_mm_linear}
    if os.environ.get("BATCHJOB_CPU_ISA") != "avx2" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = [linear.Linear(w.bfloat16()) for w in weights]
        paths["bf16"] = lambda x, i: bf16[i](x)
    for rows in [int(r) for r in os.environ.get("ROWS", "1,8,64,256,2048").split(",")]:
        xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
        inputs = {name: [x.bfloat16() for x in xs] if name == "bf16" else xs for name in paths}
        reps, secs = max(2, 400 // rows), dict.fromkeys(paths, 0.0)
        for r in range(6):  # interleaved, alternating order: the host's load shifts in between
            for name in paths if r % 2 == 0 else reversed(paths):
                t = time.perf_counter()
                for _ in range(reps):
                    for i, x in enumerate(inputs[name]):
                        paths[name](x, i)
                secs[name] += time.perf_counter() - t
        flops = sum(2 * rows * n * k for n, k in shapes) * reps * 6
        rates = "  ".join(f"{name} {flops / s / 1e9:.0f}" for name, s in secs.items())
        ratios = " ".join(f"{name} {secs['fp32'] / s:.2f}" for name, s in secs.items() if name != "fp32")
        print(f"{rows} rows: {rates} GFLOP/s; x fp32: {ratios}  load {os.getloadavg()[0]:.1f}", flush=True)


def gguf_ab() -> None:
    """bf16 matmuls of Llama-3.2-1B's shapes on GGUF blocks (GGUFLinear) against oneDNN's packed GEMM on the same
    weights dequantized, per row count (ROWS), interleaved."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from batchjob.model.matmul.gguf_linear import GGUFLinear, QuantizedWeight

    g = torch.Generator().manual_seed(0)
    shapes = [(16384, 2048, "Q4_K"), (2048, 8192, "Q6_K"), (3072, 2048, "Q8_0"), (128256, 2048, "Q6_K")]
    paths = {}
    for n, k, name in shapes:
        kind = GGMLQuantizationType[name]
        block, size = GGML_QUANT_SIZES[kind]
        raw = torch.randint(0, 256, (n, k // block, size), generator=g, dtype=torch.uint8)
        offset = 208 if name == "Q6_K" else 0  # the blocks' fp16 scale d: a trained model's magnitude
        raw[..., offset : offset + 2] = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8)
        q = QuantizedWeight(raw.view(n, -1), int(kind), k, torch.bfloat16)
        paths[f"{name} {n}x{k}"] = (GGUFLinear([q]), linear.Linear(q.dequantize()), k, n)
    for rows in [int(r) for r in os.environ.get("ROWS", "1,16,64,512").split(",")]:
        for label, (blocks, onednn, k, n) in paths.items():
            x = torch.randn(rows, k, generator=g).bfloat16()
            reps, secs = max(2, int(2e9 / (2 * rows * n * k))), {"gguf": 0.0, "onednn": 0.0}
            for r in range(4):
                for which in ("gguf", "onednn") if r % 2 == 0 else ("onednn", "gguf"):
                    t = time.perf_counter()
                    for _ in range(reps):
                        (blocks if which == "gguf" else onednn)(x)
                    secs[which] += time.perf_counter() - t
            flops = 2 * rows * n * k * reps * 4
            print(
                f"{rows} rows {label}: gguf {flops / secs['gguf'] / 1e9:.0f}, oneDNN bf16 "
                f"{flops / secs['onednn'] / 1e9:.0f} GFLOP/s (x{secs['onednn'] / secs['gguf']:.2f})  "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def weight_only_ab() -> None:
    from batchjob.model.matmul.gguf_linear import GGUFLinear
    from batchjob.model.matmul.weight_only import quantize_weight as block_quantize

    shapes = {
        "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
        "llama1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    }[os.environ.get("SHAPES", "smollm2")]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in shapes]

    def int4pack(w: torch.Tensor, group: int = 32):  # torch's layout: [K / group, N, 2] scales and zeros
        groups = w.view(w.shape[0], -1, group)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (hi - lo).clamp(min=1e-6) / 15
        q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).view(w.shape)
        zeros = (lo + 8 * scale).squeeze(-1)
        scales_zeros = torch.stack([scale.squeeze(-1), zeros], -1).transpose(0, 1).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), group, scales_zeros

    def int8pack(w: torch.Tensor):
        scale = w.abs().amax(1) / 127
        return torch.round(w / scale[:, None]).to(torch.int8), scale

    paths = {
        "fp32": [linear.Linear(w.clone()) for w in weights],
        **{f"{kind} blocks": [GGUFLinear([block_quantize(w, kind)]) for w in weights] for kind in ("int8", "int4")},
    }
    packed8, packed4 = [int8pack(w) for w in weights], [int4pack(w) for w in weights]
    paths["int8pack_mm"] = [lambda x, p=p: torch.ops.aten._weight_int8pack_mm(x, *p) for p in packed8]
    paths["int4pack_mm"] = [lambda x, p=p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, *p) for p in packed4]
    for rows in [int(r) for r in os.environ.get("ROWS", "1,16,64,256,2048").split(",")]:
        xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
        best = dict.fromkeys(paths, float("inf"))
        for r in range(4):  # interleaved, alternating order: the host's load shifts in between
            for name in paths if r % 2 == 0 else reversed(paths):
                t = time.perf_counter()
                for f, x in zip(paths[name], xs):
                    f(x)
                best[name] = min(best[name], time.perf_counter() - t)
        ms = "  ".join(f"{name} {s * 1e3:.2f}" for name, s in best.items())
        ratios = " ".join(f"{name} {s / best['fp32']:.2f}" for name, s in best.items() if name != "fp32")
        print(f"{rows} rows: ms {ms}; x fp32: {ratios}  load {os.getloadavg()[0]:.1f}", flush=True)


def run_ab() -> None:
    n = int(os.environ.get("N", "64"))
    real = linear._packable
    linear._packable = lambda w: False  # an engine whose matmuls are plain F.linear
    plain = Engine("smollm2-135m-instruct", enable_prefix_caching=False, kv_cache_memory_gb=1)
    linear._packable = real
    packed = Engine("smollm2-135m-instruct", enable_prefix_caching=False, kv_cache_memory_gb=1)
    prompts = [[rng.randrange(1000, 40000) for _ in range(256)] for _ in range(n)]
    sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    configs = {"torch ops": (plain, "torch"), "C++ kernels": (plain, ""), "C++ kernels + packed GEMM": (packed, "")}
    first = {}
    for name, (engine, path) in configs.items():  # warm-up: builds, first touch of each KV pool
        set_ops(path)
        first[name] = [o.token_ids for o in engine.generate(prompts[:8], sp, use_tqdm=False)]
    print("greedy tokens equal to the torch ops':", {k: v == first["torch ops"] for k, v in first.items()})
    for r in range(int(os.environ.get("ROUNDS", "2"))):
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            engine, path = configs[name]
            set_ops(path)
            steps = []
            engine.add_step_callback(steps.append)
            c0, t0 = time.process_time(), time.perf_counter()
            engine.generate(prompts, sp, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            engine.remove_step_callback(steps.append)
            decode = sum(m.step_time for m in steps if not m.num_prefill_tokens)
            print(
                f"round {r} {name}: {wall:.1f} s wall ({n * 320 / wall:.0f} tok/s), {cpu:.1f} s CPU, decode-only "
                f"steps {decode:.1f} s  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def attention() -> None:
    ops = native_ops()
    h, kvh, d = 9, 3, 64
    dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
    pool_tokens = 1_024_000  # K and V of 12 KiB a 16-token block (fp32): 1.5 GiB, larger than the L3 cache
    pools = {}

    def case(specs, bs, layout):  # (cached context, query rows) per sequence; blocks at random places, in one run
        nblocks = pool_tokens // bs  # per sequence, or the same few blocks for every sequence (cache-resident)
        if bs not in pools:
            pools[bs] = [torch.randn(nblocks, bs, kvh, d).to(dtype) for _ in range(2)], torch.randperm(nblocks).tolist()
        free = pools[bs][1]
        tables, lens, starts = [], [], [0]
        for ctx, n in specs:
            need = -(-(ctx + n) // bs)
            first = 0 if layout == "shared" else rng.randrange(nblocks - need)
            tables.append(list(range(first, first + need)) if layout != "random" else [free.pop() for _ in range(need)])
            lens.append(ctx + n)
            starts.append(starts[-1] + n)
        w = max(map(len, tables))
        table = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32)
        meta = (table, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32))
        return torch.randn(starts[-1], h, d).to(dtype), meta

    decode = [(700, 1)] * 64
    for name, specs, bs, layout in [
        ("prefill 1 x 1024", [(0, 1024)], 16, "random"),
        ("prefill chunk of 1024 after 1024 cached", [(1024, 1024)], 16, "random"),
        ("prefill 8 x 256", [(0, 256)] * 8, 16, "random"),
        ("decode 64 x context 700", decode, 16, "random"),
        ("decode 64 x context 700, each sequence's blocks in one run", decode, 16, "run"),
        ("decode 64 x context 700, 32-token blocks", decode, 32, "random"),
        ("decode 64 x context 700, 64-token blocks", decode, 64, "random"),
        ("decode 64 x context 700, every sequence on the same blocks (in cache)", decode, 16, "shared"),
    ]:
        cases = [case(specs, bs, layout) for _ in range(15 if name.startswith("decode") else 1)]  # new blocks a call
        k_cache, v_cache = pools[bs][0]
        times = []
        for i in range(15):
            q, meta = cases[i % len(cases)]
            t = time.perf_counter()
            ops.paged_attention(q, k_cache, v_cache, *meta, d**-0.5)
            times.append(time.perf_counter() - t)
        best = min(times)
        flops = sum(4 * h * d * sum(ctx + i + 1 for i in range(n)) for ctx, n in specs)
        kv_bytes = sum((ctx + n) * kvh * d * dtype.itemsize * 2 for ctx, n in specs)
        print(
            f"{name}: {best * 1e3:.2f} ms, {flops / best / 1e9:.0f} GFLOP/s, cache read {kv_bytes / best / 1e9:.1f} "
            f"GB/s  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def job_phases() -> None:
    """The summarize job's first N rows (or, with SYN=1, N x 256 / 64 random tokens) through the engine as the bench
    sends them, ROUNDS times: wall time and the time of its prefill (and mixed) and decode-only steps; with
    PROFILE_STEPS=30,40 a torch-profiler line for each of those steps."""
    job = load_job("jobs/summarize.yaml")
    engine = Engine(job.model, **{**job.engine.model_dump(exclude_unset=True), **dtype_setting()})
    n = int(os.environ.get("N", "64"))
    vocab = engine.model_config.vocab_size
    wl = synthetic(vocab, n, 256, 64) if os.environ.get("SYN") else job_workload(job, engine, n)
    profile_steps = {int(x) for x in os.environ.get("PROFILE_STEPS", "").split(",") if x}
    execute, calls = engine.runner.execute, [0]

    def profiled(out, **kw):
        calls[0] += 1
        if calls[0] not in profile_steps:
            return execute(out, **kw)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            result = execute(out, **kw)
        rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[: int(os.environ.get("TOP", "6"))]
        top = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f} ms" for e in rows)
        total = sum(e.self_cpu_time_total for e in p.key_averages()) / 1e3
        tokens = f"{out.num_prefill_tokens} prefill + {out.num_decode_tokens} decode tokens"
        print(f"[step {calls[0]}: {tokens}, {total:.0f} ms] {top}")
        return result

    engine.runner.execute = profiled
    for r in range(int(os.environ.get("ROUNDS", "2"))):
        calls[0] = 0
        steps = []
        engine.add_step_callback(steps.append)
        res = run_engine(engine, wl)
        engine.remove_step_callback(steps.append)
        decode = [m.step_time for m in steps if not m.num_prefill_tokens]
        print(
            f"round {r}: {res.wall:.1f} s wall, prefill and mixed steps {res.prefill_time:.1f} s, {res.decode_steps} "
            f"decode-only steps {res.decode_time:.1f} s (median {statistics.median(decode) * 1e3:.0f} ms)  "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def dtype_ab() -> None:
    n = int(os.environ.get("N", "64"))
    fp32 = Engine("smollm2-135m-instruct", dtype="float32")
    bf16 = Engine("smollm2-135m-instruct", dtype="bfloat16")
    bf16_head = Engine("smollm2-135m-instruct", dtype="bfloat16")
    model = bf16_head.runner.model  # the LM head packed in bf16, logits rounded to bf16 before the sampler
    model.lm_head = linear.Linear(model.embed, keep_weight=True)
    configs = {"float32": fp32, "bfloat16": bf16, "bfloat16, bf16 LM head": bf16_head}
    wl = synthetic(fp32.model_config.vocab_size, n, 256, 64)
    for engine in configs.values():  # warm-up: builds, first touch of each KV pool
        run_engine(engine, synthetic(fp32.model_config.vocab_size, 8, 256, 8, seed=1))
    for r in range(int(os.environ.get("ROUNDS", "2"))):
        outs = {}
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            res = run_engine(configs[name], wl)
            outs[name] = res.outputs
            print(
                f"round {r} {name}: {res.wall:.1f} s wall ({(res.prompt_tokens + res.output_tokens) / res.wall:.0f} "
                f"tok/s in+out, {res.output_tokens / res.wall:.0f} out), prefill and mixed steps "
                f"{res.prefill_time:.1f} s, decode-only steps {res.decode_time:.1f} s  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        ref = outs["float32"]
        for name, out in outs.items():
            same = sum(out[k] == ref[k] for k in ref)
            first = sum(out[k][0] == ref[k][0] for k in ref)
            print(f"round {r} {name}: greedy equal to float32 {same}/{len(ref)}, first token {first}/{len(ref)}")


def weights_ab() -> None:
    n = int(os.environ.get("N", "64"))
    other = os.environ.get("WEIGHTS", "w8a8")
    engines = {w: Engine("smollm2-135m-instruct", weights=w, **dtype_setting()) for w in ("dequantize", other)}
    job = load_job("jobs/summarize.yaml")
    wl = job_workload(job, engines[other], n)
    for engine in engines.values():  # warm-up: builds, first touch of each KV pool
        run_engine(engine, job_workload(job, engine, 4))
    for r in range(int(os.environ.get("ROUNDS", "2"))):
        outs = {}
        for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
            res = run_engine(engines[name], wl)
            outs[name] = res.outputs
            print(
                f"round {r} {name} ({engines[name].numerics['dtype']}, {engines[name].numerics['matmul']}): "
                f"{res.wall:.1f} s wall ({(res.prompt_tokens + res.output_tokens) / res.wall:.0f} tok/s in+out), "
                f"prefill and mixed steps {res.prefill_time:.1f} s, decode-only steps {res.decode_time:.1f} s  "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        ref = outs["dequantize"]
        same = sum(outs[other][k] == ref[k] for k in ref)
        print(f"round {r}: {other} greedy equal to dequantize {same}/{len(ref)}", flush=True)


def int8_quality() -> None:
    job = load_job("jobs/summarize.yaml")
    fp32 = Engine(job.model, dtype="float32", weights="dequantize")
    wl = job_workload(job, fp32, int(os.environ.get("N", "24")))
    continuations = run_engine(fp32, wl).outputs
    ref = continuation_nll(fp32, wl, continuations)
    print(f"fp32: mean NLL {ref['mean_nll']:.5f} over {ref['tokens']} tokens", flush=True)
    smoothing.ALPHA = float(os.environ.get("ALPHA", smoothing.ALPHA))
    if os.environ.get("SMOOTH", "1") == "0":  # the scales all 1: the unsmoothed W8A8 of before
        llama.smoothing_scales = lambda x_absmax, weight, alpha=None: torch.ones(weight.shape[1])
    if os.environ.get("FLOAT_DOWN") == "1":  # the down projection (input: intermediate) kept float
        inter = fp32.model_config.intermediate_size
        llama.Int8Linear = lambda w, b=None: (linear.Linear if w.shape[1] == inter else Int8Linear)(w, b)
    smooth, down = os.environ.get("SMOOTH", "1"), os.environ.get("FLOAT_DOWN", "0")
    print(f"smoothing {smooth}, alpha {smoothing.ALPHA}, float down {down}", flush=True)
    bits = os.environ.get("BITS", "8,7").split(",")
    for qmax in [{"8": int8_linear.QMAX, "7": int8_linear.QMAX_WITHOUT_VNNI}[b] for b in bits]:
        int8_linear.weight_qmax = lambda qmax=qmax: qmax  # exact either way here: this CPU sums both in int32
        w8a8 = Engine(job.model, dtype="float32", weights="w8a8")
        nll = continuation_nll(w8a8, wl, continuations)["mean_nll"]
        print(f"{w8a8.numerics['matmul']}: mean NLL {nll:.5f}, {100 * (nll / ref['mean_nll'] - 1):+.3f} % against fp32")


def invariance() -> None:
    docs = pq.read_table("sample_data/documents.parquet").column("text").to_pylist()
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        engine = Engine("smollm2-135m-instruct", dtype=dtype)
        words = [" ".join(docs[i].split()[: 8 + (i * 37) % 260]) for i in range(32)]
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + w}]) for w in words]
        alone = [engine.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
        batched = [o.token_ids for o in engine.generate(prompts, sp, use_tqdm=False)]
        chunked_engine = Engine("smollm2-135m-instruct", dtype=dtype, max_num_batched_tokens=64)
        chunked = [o.token_ids for o in chunked_engine.generate(prompts, sp, use_tqdm=False)]
        print(
            f"{dtype}: one batch equals alone {sum(a == b for a, b in zip(alone, batched))}/32, 64-token steps "
            f"{sum(a == b for a, b in zip(alone, chunked))}/32",
            flush=True,
        )


def sampler_ab() -> None:
    import importlib.util

    from batchjob.engine.outputs import Request
    from batchjob.engine.sampler import Sampler
    from batchjob.engine.sequence import Sequence

    samplers = {"engine": Sampler}
    if "BASELINE" in os.environ:
        spec = importlib.util.spec_from_file_location("baseline_sampler", os.environ["BASELINE"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        samplers["baseline"] = module.Sampler
    n, vocab = int(os.environ.get("N", 64)), 49152
    settings = {
        "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
        "temperature 0.7": SamplingParams(temperature=0.7),
        "temperature 0.8, top_k 50, repetition 1.1": SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.1),
        "temperature 0.7, top_p 0.9, seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    }
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    for name, params in settings.items():
        seqs = [Sequence(Request(str(i), list(range(100, 400)), params), i) for i in range(n)]
        times = {label: [] for label in samplers}
        for _ in range(int(os.environ.get("ROUNDS", 3))):
            for label, make in samplers.items():
                sampler = make(0)
                sampler(logits.clone(), seqs)
                start = time.perf_counter()
                for _ in range(3):
                    sampler(logits.clone(), seqs)
                times[label].append((time.perf_counter() - start) / 3 * 1000)
        print(f"{name}: " + "; ".join(f"{k} {', '.join(f'{t:.0f}' for t in v)} ms" for k, v in times.items()))


def roofline() -> None:
    """A prefill step and a decode step per op (torch profiler, self CPU time), against the rates this machine
    reaches in the same run: the step's own matmuls alone (the model's packed weights, the step's row count) and a
    memory copy larger than L3. Prefill: the whole step's FLOPs (matmuls and causal attention) per second as a share
    of the matmul rate; decode: attention's K/V bytes per second against the copy's."""
    engine = Engine("smollm2-135m-instruct", **dtype_setting())
    runner = engine.runner
    model, caches, c = runner.model, runner.kv_caches, runner.model.config
    h, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    seqs, length = (int(x) for x in os.environ.get("PREFILL", "2x1024").split("x"))
    n_dec = int(os.environ.get("DECODE_SEQS", "64"))
    phases = {
        f"prefill {seqs} x {length}": random_step(runner, [(0, length)] * seqs),
        f"decode {n_dec} seqs, context 300-700": random_step(
            runner, [(rng.randint(300, 700), 1) for _ in range(n_dec)]
        ),
    }
    layer, size = model.layers[0], runner.kv_caches[0][0].element_size()
    shapes = {"qkv": ((h + 2 * kvh) * d, c.hidden_size), "o": (c.hidden_size, h * d)}
    shapes |= {"gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    reps = int(os.environ.get("REPS", "3"))
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)  # 256 MiB: past L3
    dst = torch.empty_like(src)
    for name, (ids, pos, meta) in phases.items():
        rows, last = len(ids), meta.query_start_loc[1:].long() - 1

        def forward():
            meta.plan_cache.clear()
            with torch.inference_mode():
                model.compute_logits(model.forward(ids, pos, meta, caches)[last])

        def layer_matmuls():
            with torch.inference_mode():
                for key in shapes:
                    layer[key](xs[key])
                model.lm_head(head_x)

        xs = {k: torch.randn(rows, shape[1]).to(runner.dtype) for k, shape in shapes.items()}
        head_x = torch.randn(len(last), c.hidden_size)
        mm_flops = 2 * rows * sum(n * k for n, k in shapes.values())
        head_flops = 2 * len(last) * c.vocab_size * c.hidden_size
        qlens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        attn_flops = sum(4 * h * d * q * (q + 1) // 2 for q in qlens if q > 1)
        kv_bytes = sum(2 * n * kvh * d * size for n, q in zip(meta.seq_lens.tolist(), qlens) if q == 1)
        forward(), layer_matmuls()  # warm-up
        t_step, t_mm, t_copy = [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            forward()
            t_step.append(time.perf_counter() - t)
            t = time.perf_counter()
            layer_matmuls()
            t_mm.append(time.perf_counter() - t)
            t = time.perf_counter()
            dst.copy_(src)
            t_copy.append(time.perf_counter() - t)
        step_s, copy_bps = min(t_step), src.numel() / min(t_copy)
        gemm = (mm_flops + head_flops) / min(t_mm)  # FLOP/s of one layer's matmuls and the LM head, alone
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                forward()
        ops = {e.key: e.self_cpu_time_total / reps / 1e6 for e in prof.key_averages()}
        total = sum(ops.values())
        step_flops = c.num_hidden_layers * (mm_flops + attn_flops) + head_flops
        print(
            f"{name} ({rows} tokens, {runner.dtype}, {os.environ.get('BATCHJOB_CPU_ISA') or 'native ISA'}): "
            f"step {step_s * 1e3:.1f} ms; matmul rate alone {gemm / 1e9:.1f} GFLOP/s, memory copy "
            f"{copy_bps / 1e9:.1f} GB/s; the step's FLOPs {step_flops / step_s / 1e9:.1f} GFLOP/s = "
            f"{100 * step_flops / step_s / gemm:.0f} % of the matmul rate  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for key, secs in sorted(ops.items(), key=lambda kv: -kv[1])[: int(os.environ.get("TOP", "8"))]:
            note = ""
            if "linear" in key:
                note = f": {(c.num_hidden_layers * mm_flops + head_flops) / secs / 1e9:.1f} GFLOP/s"
            elif "paged_attention" in key and attn_flops:
                note = f": {c.num_hidden_layers * attn_flops / secs / 1e9:.1f} GFLOP/s causal"
            elif "paged_attention" in key:
                rate = c.num_hidden_layers * kv_bytes / secs
                note = f": {rate / 1e9:.1f} GB/s of K/V, {rate / copy_bps:.2f} x the copy's rate"
            print(f"  {key}: {secs * 1e3:.1f} ms, {100 * secs / total:.0f} %{note}", flush=True)


{
    "sampler": sampler_ab,
    "steps": steps_ab,
    "prof": steps_ab,
    "gemm": gemm_ab,
    "int8": int8_ab,
    "gguf": gguf_ab,
    "weight-only": weight_only_ab,
    "run": run_ab,
    "attention": attention,
    "job": job_phases,
    "dtype": dtype_ab,
    "weights": weights_ab,
    "int8-quality": int8_quality,
    "invariance": invariance,
    "roofline": roofline,
}[MODE]()
