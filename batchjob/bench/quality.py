"""`batchjob bench --quality`: what bf16 costs in quality on a job's real rows (issue 26's measure). The fp32
engine's greedy continuations, scored teacher-forced under the fp32 and the bf16 engine: mean NLL per token, held to
within NLL_BOUND of each other. Where greedy outputs first part: the bf16 engine against transformers in bf16 (is our
bf16 as good as the reference's?), bf16 against fp32 in each, and the fp32 engine against transformers in fp32 (the
exact mode)."""

from __future__ import annotations

import statistics
import time

import torch

from batchjob.bench.measure import agreement
from batchjob.bench.systems import dtype_name, hf_greedy, load_hf_model, peer_status, run_engine
from batchjob.bench.workloads import Workload
from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sequence import Sequence

NLL_BOUND = 0.01  # the issue's: bf16's NLL of the fp32 continuations within 1 % of fp32's
HIST_BIN = 8  # output tokens per bin of the first-divergence histogram


def continuation_nll(engine: Engine, wl: Workload, continuations: dict[str, list[int]]) -> dict:
    """Each request's continuation teacher-forced after its prompt, one sequence a step through the engine's own
    forward (its KV cache, kernels and fp32 logits): the total NLL, the tokens scored, their mean."""
    runner = engine.step_runner()
    total, tokens = 0.0, 0
    for r in wl.requests:
        ids = continuations[r.request_id]
        seq = Sequence(Request(r.request_id, r.prompt_token_ids + ids, r.params), 0)
        total -= runner.score(seq, len(r.prompt_token_ids)).double().sum().item()
        tokens += len(ids)
    return {"dtype": dtype_name(engine.dtype), "nll": total, "tokens": tokens, "mean_nll": total / tokens}


def divergence(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict:
    """agreement(), with the first differences' quartiles and a histogram by HIST_BIN output tokens."""
    a = agreement(ours, theirs)
    at = a["first_difference_at"]
    a["quartiles"] = statistics.quantiles(at, n=4, method="inclusive") if len(at) > 1 else at
    hist: dict[str, int] = {}
    for i in at:
        lo = i // HIST_BIN * HIST_BIN
        key = f"{lo}-{lo + HIST_BIN - 1}"
        hist[key] = hist.get(key, 0) + 1
    a["histogram"] = hist
    return a


def run_quality(fp32: Engine, bf16: Engine, wl: Workload, batch_size: int) -> dict:
    """The NLL comparison and the greedy agreements (those with transformers where it is installed), with each
    phase's wall time."""
    seconds: dict[str, float] = {}

    def timed(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        seconds[name] = time.perf_counter() - t0
        return result

    greedy = {
        "engine fp32": timed("engine fp32 greedy", lambda: run_engine(fp32, wl).outputs),
        "engine bf16": timed("engine bf16 greedy", lambda: run_engine(bf16, wl).outputs),
    }
    reference = greedy["engine fp32"]
    nll = {
        "fp32": timed("score fp32", lambda: continuation_nll(fp32, wl, reference)),
        "bf16": timed("score bf16", lambda: continuation_nll(bf16, wl, reference)),
    }
    rel = (nll["bf16"]["mean_nll"] - nll["fp32"]["mean_nll"]) / nll["fp32"]["mean_nll"]
    skipped = {k: v for k, v in peer_status().items() if k == "hf" and v}
    pairs = [("engine bf16", "engine fp32")]
    if not skipped:
        hf_model = load_hf_model(fp32, fp32.model_path)  # fp32 on a CPU
        greedy["hf fp32"] = timed("hf fp32 greedy", lambda: hf_greedy(wl, batch_size, hf_model, fp32.eos_token_ids))
        hf_model.to(torch.bfloat16)
        greedy["hf bf16"] = timed("hf bf16 greedy", lambda: hf_greedy(wl, batch_size, hf_model, bf16.eos_token_ids))
        pairs += [("engine bf16", "hf bf16"), ("hf bf16", "hf fp32"), ("engine fp32", "hf fp32")]
    return {
        "workload": wl.name,
        "requests": len(wl.requests),
        "dtypes": {"fp32": fp32.numerics, "bf16": bf16.numerics},
        "nll": nll,
        "nll_relative_difference": rel,
        "nll_bound": NLL_BOUND,
        "nll_passed": abs(rel) <= NLL_BOUND,
        "divergence": {f"{a} vs {b}": divergence(greedy[a], greedy[b]) for a, b in pairs},
        "hf_batch_size": batch_size,
        "seconds": seconds,
        "skipped": skipped,
    }
