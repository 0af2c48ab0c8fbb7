"""What a run measured (`Result`), the interleaved rounds the systems run in, the machine's reference rates a run is
compared with, and the agreement of two systems' greedy outputs."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from batchjob.bench.workloads import Workload
from batchjob.engine.engine import Engine
from batchjob.engine.outputs import StepMetrics


@dataclass
class Result:
    system: str
    wall: float
    prompt_tokens: int
    output_tokens: int
    num_requests: int
    mean_batch: float = 0.0
    max_batch: int = 0
    mean_kv_usage: float = 0.0
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_kv_usage: float = 0.0  # the KV pool's used fraction summed over decode-only steps: what their attention read
    token_budget: int | None = None  # the engine's at the end of the run: what `auto` chose
    cpu_s: float = 0.0  # this process's CPU time: steadier than wall time on a host shared with other work
    constraint_s: float = 0.0  # of the wall time, spent on output constraints (grammar masks and matchers)
    note: str = ""  # how the system was run, where it differs from its defaults or from the others
    peak_rss: int | None = None  # bytes: the system's process's peak resident memory during the run, where measured
    outputs: dict[str, list[int]] | None = None  # output token ids by request id, to compare systems' greedy outputs
    sample_tokens: dict[str, int] | None = None  # by request id, its longest sample's output tokens
    embeddings: torch.Tensor | None = None  # --task embed: the texts' embeddings [texts, hidden], in input order
    logprobs: list[torch.Tensor] | None = None  # --task score: each row's scored tokens' logprobs, in row order

    def row(self) -> dict:
        d = dict(self.__dict__)
        d.pop("outputs")
        d.pop("sample_tokens")
        d.pop("embeddings")
        d.pop("logprobs")
        d.update(
            requests_per_s=self.num_requests / self.wall,
            total_tokens_per_s=(self.prompt_tokens + self.output_tokens) / self.wall,
            output_tokens_per_s=self.output_tokens / self.wall,
        )
        return d


def descendants() -> list[int]:
    """The pids of this process's children and theirs (read from Linux's /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:  # the parent's pid is the 2nd field after the command's ")"
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@contextlib.contextmanager
def paused(pids: list[int]):
    """The processes `pids` stopped (SIGSTOP) for the block, and continued after it whatever happens."""
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)


def interleaved_rounds(names: list, repeats: int, run: Callable) -> tuple[dict, dict]:
    """`run(name)` for every name once a round, the order rotating so that none always runs first: each name's
    results in the order run, and its median round by wall time. The processes this one has started by then (vLLM's
    engine core and workers, which poll while idle: beside them the engine ran image rows 1.8x slower) are stopped
    while any other system runs, so that each system runs as it would alone."""
    peers = descendants() if "vllm" in names else []  # no other peer leaves processes between its rounds
    runs: dict = {s: [] for s in names}
    for k in range(repeats):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            with paused([] if name == "vllm" else peers):
                runs[name].append(run(name))
    return runs, {s: sorted(r, key=lambda x: x.wall)[len(r) // 2] for s, r in runs.items()}


def summarize(system: str, wall: float, wl: Workload, output_tokens: int, steps: list[StepMetrics]) -> Result:
    batch = [s.num_seqs for s in steps] or [0]
    r = Result(
        system,
        wall,
        wl.prompt_tokens,
        output_tokens,
        len(wl.requests),
        statistics.mean(batch),
        max(batch),
        statistics.mean(s.kv_cache_usage for s in steps) if steps else 0.0,
        sum(s.num_preemptions for s in steps),
    )
    if steps:
        r.prefix_hit_rate = steps[-1].prefix_cache_hit_rate
    for s in steps:  # a mixed step counts as prefill: it carries the prompt work
        if s.num_prefill_tokens:
            r.prefill_time += s.step_time
            r.prefill_tokens += s.num_prefill_tokens + s.num_decode_tokens
        else:
            r.decode_time += s.step_time
            r.decode_tokens += s.num_decode_tokens
            r.decode_steps += 1
            r.decode_kv_usage += s.kv_cache_usage
    return r


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, reps: int, device: torch.device | str) -> float:
    """The fastest of `reps` timed calls after one untimed (a warm-up, a compile): on a shared host the slower
    ones timed the neighbours. The one timing helper of the bench, the device check and the kernels' self-test."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(engine: Engine, rows: int, reps: int = 5) -> float:
    """The machine's measured fp32 matmul FLOP/s at the model's weight shapes for `rows` tokens, through the model's
    own matmuls (packed for the CPU's GEMM where they are): the best this machine does at those shapes."""
    model = engine.model
    linears = model.linears(0)
    xs = [torch.randn(rows, lin.shape[1], dtype=model.dtype, device=engine.device) for lin in linears]
    secs = best_seconds(lambda: [lin(x) for x, lin in zip(xs, linears)], reps, engine.device)
    return 2 * rows * sum(lin.shape.numel() for lin in linears) / secs


def memory_read_rate(engine: Engine, nbytes: int = 1 << 30, reps: int = 3) -> float:
    """Bytes/s at which the engine's threads read a buffer larger than any cache, front to back (a 1 GiB sum): the
    bound on a decode step's attention, which reads every running sequence's K and V once. Paged KV blocks lie at
    random places in the pool, where they read at a lower rate than this (docs/perf-history.md)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=engine.device)
    return nbytes / best_seconds(buf.sum, reps, engine.device)


def model_flops_per_token(engine: Engine) -> int:
    """Matmul FLOPs of one token through the decoder layers (the logits rows are few and left out)."""
    m = engine.model
    return 2 * sum(lin.shape.numel() for i in range(len(m.layers)) for lin in m.linears(i))


def scoring_floor(engine: Engine, decoder_tokens: int, scored_tokens: int) -> dict:
    """The least time a scoring run can take here: its matmul FLOPs (every token it computes through the decoder,
    every scored position through the LM head) at the rate the model's own matmuls reach in this run at a step's
    rows."""
    c = engine.model.config
    flops = model_flops_per_token(engine) * decoder_tokens + 2 * c.vocab_size * c.hidden_size * scored_tokens
    rate = matmul_flops(engine, engine.token_budget)
    return {"flops": flops, "matmul_gflops": rate / 1e9, "rows": engine.token_budget, "seconds": flops / rate}


def roofline(engine: Engine, result: Result, peaks: dict | None = None) -> dict:
    """Each phase's achieved matmul FLOP/s against the machine's: on a CPU the model's own matmuls timed at the
    phase's rows; with `peaks` (the device check's) the device's measured matmul and copy rates. Decode has a
    second bound, the bytes a step reads (the KV of every running sequence, and on a GPU every weight once)."""
    per_token = model_flops_per_token(engine)
    out = {}
    for phase, tokens, secs, rows in (
        ("prefill", result.prefill_tokens, result.prefill_time, engine.token_budget),
        (
            "decode",
            result.decode_tokens,
            result.decode_time,
            max(1, round(result.decode_tokens / max(1, result.decode_steps))),
        ),
    ):
        if not tokens or not secs:
            continue
        achieved = per_token * tokens / secs
        peak = peaks["matmul_flops"] if peaks else matmul_flops(engine, rows)
        out[phase] = {
            "achieved_gflops": achieved / 1e9,
            "matmul_gflops": peak / 1e9,
            # the matmuls' own: int8 ones under w8a8 (matmul_flops runs the model's); weight-only int8/int4 compute in
            # the engine's dtype
            "dtype": "int8" if engine.numerics.get("weights") == "w8a8" else str(engine.dtype).replace("torch.", ""),
            "rows": rows,
            "fraction": achieved / peak,
        }
    if "decode" in out and (result.decode_kv_usage or peaks):
        pool_bytes = engine.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token
        kv_bytes = result.decode_kv_usage * pool_bytes
        weight_bytes = engine.model.weight_bytes() * result.decode_steps if peaks else 0  # a CPU's caches hold them
        read_rate = peaks["copy_bytes_per_s"] if peaks else memory_read_rate(engine)
        bound = per_token * result.decode_tokens / (out["decode"]["matmul_gflops"] * 1e9)
        bound += (kv_bytes + weight_bytes) / read_rate
        out["decode"] |= {
            "kv_gb_per_step": kv_bytes / result.decode_steps / 1e9,
            "read_gb_per_s": read_rate / 1e9,
            "achieved_read_gb_per_s": (kv_bytes + weight_bytes) / result.decode_time / 1e9,
            "bound_fraction": bound / result.decode_time,
        }
    return out


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Where two outputs first part (the shorter one's length where it is a prefix of the other); None if equal."""
    if ours == theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict:
    """How many requests have token-for-token equal outputs, and where the first difference lies in the others."""
    differ = {k: first_difference(v, theirs[k]) for k, v in ours.items() if v != theirs.get(k)}
    return {"equal": len(ours) - len(differ), "total": len(ours), "first_difference_at": sorted(differ.values())}
