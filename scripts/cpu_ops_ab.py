"""Usage: python scripts/cpu_attention_ab.py [prof]   (env: REPS, DECODE_SEQS)

Per-step A/B of the model forward: torch attention path vs the C++ op, on the real model and KV pool, interleaved
in one process; then a torch-profiler table per path and phase."""

import os
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchjob.engine.engine import Engine
from batchjob.model.attention_metadata import AttentionMetadata

engine = Engine("smollm2-135m-instruct")
runner = engine.runner
model, caches, bs = runner.model, runner.kv_caches, runner.block_size
print("KV pool blocks:", runner.num_blocks, "block size", bs, flush=True)
rng = random.Random(0)


def step(specs):
    """specs: (cached context, query rows) per sequence, blocks drawn at random from the pool."""
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    ids, pos, slots, ql, sl, tables = [], [], [], [], [], []
    for ctx, n in specs:
        L = ctx + n
        t = [free.pop() for _ in range(-(-L // bs))]
        tables.append(t)
        ql.append(n)
        sl.append(L)
        for p in range(ctx, L):
            ids.append(rng.randrange(1000, 40000))
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
    w = max(map(len, tables))
    meta = AttentionMetadata.build(ql, sl, [t + [-1] * (w - len(t)) for t in tables], slots)
    return torch.tensor(ids), torch.tensor(pos), meta


def run(path, inputs):
    if path == "torch":
        os.environ["BATCHJOB_CPU_OPS"] = "torch"
    else:
        os.environ.pop("BATCHJOB_CPU_OPS", None)
    ids, pos, meta = inputs
    meta.plan_cache.clear()
    t = time.perf_counter()
    with torch.inference_mode():
        model.compute_logits(model.forward(ids, pos, meta, caches))
    return time.perf_counter() - t


n_dec = int(os.environ.get("DECODE_SEQS", "100"))
phases = {
    f"decode {n_dec} seqs, context 300-500": step([(rng.randint(300, 500), 1) for _ in range(n_dec)]),
    "prefill 8 x 256": step([(0, 256)] * 8),
    "mixed: 2 prefill chunks of 256 after 256 cached + 60 decodes (ctx 200-600)": step(
        [(256, 256)] * 2 + [(rng.randint(200, 600), 1) for _ in range(60)]
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
        f"{name}: torch path {a * 1e3:.0f} ms ({tokens / a:.0f} tok/s), "
        f"C++ op {b * 1e3:.0f} ms ({tokens / b:.0f} tok/s): x{a / b:.2f}  load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
if "prof" in sys.argv:
    for name, inputs in phases.items():
        for path in ("torch", "native"):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                run(path, inputs)
            rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in rows)
            top = ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.1f}%" for e in rows[:7])
            print(f"[profile] {name} / {path}: {total / 1e3:.0f} ms self CPU: {top}", flush=True)
