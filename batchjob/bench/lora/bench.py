"""`batchjob bench --loras N`: the workload's rows spread over N random LoRA adapters (PEFT folders of the model's
shapes, every projection at `--lora-rank`) in one engine, against the same rows on the base model in the same engine,
and against N runs one after another, each a fresh engine holding one adapter and running that adapter's rows (what
a job per adapter costs, model load included, process start not). Rounds interleaved, medians reported."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchjob.bench.workloads import Workload
from batchjob.engine.engine import Engine
from batchjob.model.config import ModelConfig
from batchjob.model.lora.files import CONFIG_FILE, WEIGHTS_FILE
from batchjob.model.lora.weights import in_features, targets

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = {"gate_proj", "up_proj", "down_proj"}


def write_random_adapter(folder: Path, c: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder of `c`'s shapes on every projection (A ~ N(0, 1/in), B ~ N(0, 0.02^2)), as peft saves one."""
    g = torch.Generator().manual_seed(seed)
    known, tensors = targets(c), {}
    for layer in range(c.num_hidden_layers):
        for name in PROJECTIONS:
            matmul, start, end = known[name]
            inp = in_features(c, matmul)
            block = "mlp" if name in MLP else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(end - start, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def run_lora_bench(model: str, overrides: dict, wl: Workload, n: int, rank: int, root: Path, repeats: int) -> dict:
    probe = Engine(model, **overrides)
    config = probe.model_config
    del probe
    adapters = {f"lora-{i}": str(write_random_adapter(root / f"lora-{i}", config, rank, i)) for i in range(n)}
    engine = Engine(model, **overrides, lora={"adapters": adapters, "max_loras": n})
    prompts = [r.prompt_token_ids for r in wl.requests]
    params = [r.params for r in wl.requests]
    names = [f"lora-{i % n}" for i in range(len(prompts))]
    engine.generate([prompts[0][:8]], params[0].model_copy(update={"max_tokens": 2}), use_tqdm=False)  # warm-up

    def one_engine(loras) -> tuple[float, int]:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False, lora=loras)
        return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)

    def jobs() -> tuple[float, int]:
        t0, tokens = time.perf_counter(), 0
        for name, path in adapters.items():
            mine = [i for i, x in enumerate(names) if x == name]
            alone = Engine(model, **overrides, lora={"adapters": {name: path}, "max_loras": 1})
            outs = alone.generate([prompts[i] for i in mine], [params[i] for i in mine], use_tqdm=False, lora=name)
            tokens += sum(len(o.token_ids) for o in outs)
            del alone
        return time.perf_counter() - t0, tokens

    runs: dict[str, list[tuple[float, int]]] = {"mixed adapters": [], "base model": [], "a job per adapter": []}
    for r in range(repeats):
        order = list(runs)[r % 3 :] + list(runs)[: r % 3]
        for system in order:
            if system == "a job per adapter":
                runs[system].append(jobs())
            else:
                runs[system].append(one_engine(names if system == "mixed adapters" else None))
    report = {"model": model, "workload": wl.name, "adapters": n, "rank": rank, "rows": len(prompts), "systems": {}}
    prompt_tokens = wl.prompt_tokens
    for system, rounds in runs.items():
        wall = statistics.median(t for t, _ in rounds)
        out = rounds[0][1]
        report["systems"][system] = {
            "wall_s": [round(t, 2) for t, _ in rounds],
            "total_tok_s": round((prompt_tokens + out) / wall, 1),
            "output_tokens": out,
        }
    base = report["systems"]["base model"]["total_tok_s"]
    for s in report["systems"].values():
        s["ratio_to_base"] = round(s["total_tok_s"] / base, 3)
    return report


def format_lora(report: dict) -> str:
    lines = [f"{report['rows']} rows of {report['workload']}, {report['adapters']} adapters of rank {report['rank']}"]
    mixed = report["systems"]["mixed adapters"]["total_tok_s"]
    for system, s in report["systems"].items():
        lines.append(
            f"{system:>18}: {s['total_tok_s']:8.1f} total tok/s  ({s['ratio_to_base']:.2f}x the base model; "
            f"mixed is {mixed / s['total_tok_s']:.2f}x this)  rounds {s['wall_s']} s"
        )
    return "\n".join(lines)
