"""`batchjob bench --quality`: what bf16 (issue 26's measure), W8A8 matmuls (`--weights w8a8`, issue 35) or
weight-only int8/int4 (`--weights int8`/`int4`, issue 44) cost in quality on a job's real rows. The fp32 engine's
greedy continuations, scored teacher-forced under the fp32 engine and under the other one: mean NLL per token, held
to within NLL_BOUND of each other. Where greedy outputs first part: the other engine against fp32, and the fp32
engine against transformers in fp32 (the exact mode); for bf16 also the bf16 engine against transformers in bf16 (is
our bf16 as good as the reference's?) and transformers' bf16 against its fp32."""

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

# The `--weights` set against fp32 in float32 (the matmuls the one change): W8A8, weight-only int8 and int4.
QUALITY_WEIGHTS = ("w8a8", "int8", "int4")
NLL_BOUND = 0.01  # the issues': the NLL of the fp32 continuations within 1 % of fp32's
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


def quality_label(engine: Engine) -> str:
    """The engine set against fp32, as the report names it: its weights (`w8a8`, `int8`, `int4`) or its dtype
    (`bf16`)."""
    weights = engine.numerics.get("weights")
    return weights if weights in QUALITY_WEIGHTS else DTYPE_LABELS[engine.dtype]


DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def run_quality(fp32: Engine, other: Engine, wl: Workload, batch_size: int) -> dict:
    """The NLL comparison and the greedy agreements (those with transformers where it is installed), with each
    phase's wall time."""
    seconds: dict[str, float] = {}
    label = quality_label(other)

    def timed(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        seconds[name] = time.perf_counter() - t0
        return result

    greedy = {
        "engine fp32": timed("engine fp32 greedy", lambda: run_engine(fp32, wl).outputs),
        f"engine {label}": timed(f"engine {label} greedy", lambda: run_engine(other, wl).outputs),
    }
    reference = greedy["engine fp32"]
    nll = {
        "fp32": timed("score fp32", lambda: continuation_nll(fp32, wl, reference)),
        label: timed(f"score {label}", lambda: continuation_nll(other, wl, reference)),
    }
    rel = (nll[label]["mean_nll"] - nll["fp32"]["mean_nll"]) / nll["fp32"]["mean_nll"]
    skipped = {k: v for k, v in peer_status().items() if k == "hf" and v}
    pairs = [(f"engine {label}", "engine fp32")]
    if not skipped:
        hf_model = load_hf_model(fp32, fp32.model_path)  # fp32 on a CPU
        greedy["hf fp32"] = timed("hf fp32 greedy", lambda: hf_greedy(wl, batch_size, hf_model, fp32.eos_token_ids))
        if label not in QUALITY_WEIGHTS:  # transformers in the other dtype: the reference's own cost of it
            hf_model.to(other.dtype)
            greedy[f"hf {label}"] = timed(
                f"hf {label} greedy", lambda: hf_greedy(wl, batch_size, hf_model, other.eos_token_ids)
            )
            pairs += [(f"engine {label}", f"hf {label}"), (f"hf {label}", "hf fp32")]
        pairs += [("engine fp32", "hf fp32")]
    return {
        "workload": wl.name,
        "requests": len(wl.requests),
        "label": label,
        "dtypes": {"fp32": fp32.numerics, label: other.numerics},
        "nll": nll,
        "nll_relative_difference": rel,
        "nll_bound": NLL_BOUND,
        "nll_passed": abs(rel) <= NLL_BOUND,
        "divergence": {f"{a} vs {b}": divergence(greedy[a], greedy[b]) for a, b in pairs},
        "hf_batch_size": batch_size,
        "seconds": seconds,
        "skipped": skipped,
    }
