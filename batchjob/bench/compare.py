"""`batchjob bench`: one workload through this engine and through baselines in the same process, interleaved in
rounds so that machine drift cancels, reported as ratios to this engine.

Systems: `engine` (continuous batching); `unconstrained` (the engine on the same requests without their output
constraint, each held to the tokens its constrained run made: the same work token for token, so that the ratio is
what constrained decoding costs); `static` (the seed's fixed batch: prompts padded to the batch's longest,
the whole batch decoded until its longest request is done, then the next batch; it reproduces padding's cost, not
its masking); `hf` (transformers `generate` at a fixed batch, left-padded); `vllm` when installed; `llama-server`
(llama.cpp built for this CPU, its parallel slots kept full, on the engine's GGUF or on it requantized).
The sweep instead runs this engine at several fixed token budgets and at `auto` (token_budget.py); `--quality`
measures bf16 against fp32 instead of speed (quality.py).

Workloads: synthetic random tokens as vLLM's benchmark, or a job file's real rows, prompts and sampling.

`--task embed` instead runs the Embedder (`embedder`) against sentence-transformers `encode` (`st`, at its default
batch size and at a tuned one) on texts of mixed lengths cut from real documents, by input tokens/s. `--task score`
runs teacher-forced scoring (scoring.py): Engine.score against transformers' forward and vLLM's prompt_logprobs, by
scored tokens/s, on whole documents, a job's rows or random tokens. `--task image` runs rows of a picture and a caption
prompt through a vision-language model (vision/image_rows.py): the engine against transformers' generate and vLLM."""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pydantic
import torch
import torch.nn.functional as F

from batchjob.bench import llama_server
from batchjob.bench.gguf_export import dummy_gguf_apart
from batchjob.bench.lora.bench import format_lora, run_lora_bench
from batchjob.bench.measure import Result, agreement, interleaved_rounds, roofline
from batchjob.bench.quality import QUALITY_WEIGHTS, run_quality
from batchjob.bench.scoring import run_score_bench
from batchjob.bench.systems import (
    load_hf_model,
    load_sentence_transformer,
    load_vllm,
    peer_status,
    run_embedder,
    run_engine,
    run_hf,
    run_sentence_transformer,
    run_static,
    run_vllm,
)
from batchjob.bench.tables import (
    format_embed,
    format_image,
    format_quality,
    format_report,
    format_score,
    format_sweep,
)
from batchjob.bench.vision.image_rows import image_rows, run_image_bench
from batchjob.bench.vision.vlm_export import idefics3_folder
from batchjob.bench.workloads import (
    DOCUMENTS,
    EMBED_CHARS,
    Workload,
    document_workload,
    embed_texts,
    job_workload,
    synthetic,
    unconstrained,
)
from batchjob.engine.embedder import Embedder
from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.spec import JobFileError, load_job
from batchjob.model.cpu_features import cpu_kind


@dataclass(frozen=True)
class LlamaServerOptions:
    slots: int = 64  # llama-server's parallel slots, and its clients
    requantize: str | None = None  # a llama-quantize type the peer runs the GGUF as (e.g. Q8_0)


def run_bench(
    engine: Engine,
    model_path,
    wl: Workload,
    systems: list[str],
    batch_size: int,
    repeats: int,
    threads: int,
    llama: LlamaServerOptions = LlamaServerOptions(),
    vllm_dtype: str | None = None,
) -> dict:
    """Every system once per round, rounds interleaved in rotating order; the median wall time per system is
    reported."""
    skipped = {k: v for k, v in peer_status().items() if k in systems and v}
    if "llama-server" in systems and "llama-server" not in skipped:
        if engine.config.load_format == "dummy":
            skipped["llama-server"] = "load_format dummy: llama.cpp would read other weights than the engine's"
        elif model_path.suffix != ".gguf":
            skipped["llama-server"] = f"it runs GGUF files; the engine's model is {model_path}"
    constrained = sum(r.params.grammar_key is not None for r in wl.requests)
    if "unconstrained" in systems and not constrained:
        skipped["unconstrained"] = "no request of the workload has an output constraint"
    elif "unconstrained" in systems and "engine" not in systems:
        skipped["unconstrained"] = "it runs the engine's requests at their lengths: needs the engine in --systems"
    systems = [s for s in systems if s not in skipped]
    engine.generate([wl.requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if "vllm" in systems and engine.config.load_format == "dummy":
        skipped["vllm"] = "load_format dummy: vLLM would draw other random weights"
        systems.remove("vllm")
    hf_model = None
    longest = max(len(r.prompt_token_ids) + r.params.max_tokens for r in wl.requests)
    vllm = load_vllm(engine, model_path, longest, vllm_dtype) if "vllm" in systems else None
    if "llama-server" in systems:
        server = llama_server.ensure_built() / "llama-server"
        gguf = llama_server.requantized(model_path, llama.requantize) if llama.requantize else model_path
        weights = f"weights {llama_server.weight_types(gguf)}" + (
            f" (requantized from {llama_server.weight_types(model_path)})" if llama.requantize else ""
        )
    # With the unconstrained peer, an untimed constrained run first: it compiles the grammars, warms the engine up at
    # the workload's shapes and gives the lengths the unconstrained requests are held to.
    free = unconstrained(wl, run_engine(engine, wl).sample_tokens) if "unconstrained" in systems else None

    def run(system: str) -> Result:
        nonlocal hf_model
        if system == "engine":
            return run_engine(engine, wl)
        if system == "unconstrained":
            result = run_engine(engine, free, system)
            result.outputs = None  # other text by design: not compared
            return result
        if system == "static":
            return run_static(engine, wl, batch_size)
        if system == "hf":
            if hf_model is None:
                hf_model = load_hf_model(engine, model_path)
            return run_hf(wl, batch_size, hf_model)
        if system == "vllm":
            return run_vllm(vllm, engine, wl)
        if system == "llama-server":
            return llama_server.run_llama_server(server, gguf, wl, llama.slots, threads, weights)
        raise ValueError(f"unknown system {system!r}")

    if vllm is not None:
        # vLLM's init compiles and commits GiBs of RAM; whatever runs first after it paid for that in its first round
        # (one engine round 28 s, the other 34 s in one run). An untimed round of every system first.
        for system in systems:
            run(system)
    runs, results = interleaved_rounds(systems, repeats, run)
    rows = [results[s].row() for s in systems]
    for row, s in zip(rows, systems):
        row["round_walls"] = [r.wall for r in runs[s]]  # in the order run: the spread a noisy host gives
    base = results.get("engine")
    for row in rows:
        # By requests/s, i.e. wall time on the same requests: the baselines decode every request to max_tokens, so
        # on a workload that stops at EOS their token counts would credit them with tokens the engine never needed.
        row["ratio_to_engine"] = (row["requests_per_s"] / base.row()["requests_per_s"]) if base else None
    report = {
        "workload": wl.name,
        "cpu": cpu_kind(),
        "systems": rows,
        "skipped": skipped,
        "repeats": repeats,
        "batch_size": batch_size,
        "threads": threads,
        "engine_config": engine.config.model_dump(),
        "num_kv_blocks": engine.num_kv_blocks,
    }
    if "unconstrained" in results:
        cpu = {s: statistics.median(r.cpu_s for r in runs[s]) for s in ("engine", "unconstrained")}
        report["constrained"] = {
            "requests": constrained,
            "total": len(wl.requests),
            "ratio": results["unconstrained"].wall / base.wall,
            "cpu_ratio": cpu["unconstrained"] / cpu["engine"],
            "round_ratios": [f.wall / e.wall for e, f in zip(runs["engine"], runs["unconstrained"])],
            "constraint_share": statistics.median(r.constraint_s / r.wall for r in runs["engine"]),
        }
        rows[systems.index("unconstrained")]["note"] = (
            f"engine at {report['constrained']['ratio']:.2f}x of this (constrained: {constrained}/{len(wl.requests)})"
        )
    if base:
        report["roofline"] = roofline(engine, base)
        report["agreement"] = {
            s: agreement(base.outputs, r.outputs) for s, r in results.items() if s != "engine" and r.outputs
        }
    return report


def run_sweep(engine: Engine, wl: Workload, budgets: list[int], repeats: int) -> dict:
    """The engine at each fixed token budget and at `auto` (a fresh tuner each run, as at the start of a job), in
    interleaved rounds whose order rotates so that no setting always runs first. Each setting is compared with the
    best fixed budget by its median wall time and, separately, by its median CPU time, which other processes on a
    shared host disturb far less (the engine's threads are this process's)."""
    settings: list[int | str] = [*budgets, "auto"]
    engine.generate([wl.requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    tuners: list[dict] = []

    def run(setting: int | str) -> Result:
        engine.set_token_budget(setting)
        result = run_engine(engine, wl, f"budget {setting}")
        if setting == "auto":
            tuners.append(engine.auto_budget.summary())
        return result

    runs, results = interleaved_rounds(settings, repeats, run)
    cpu = {s: statistics.median(x.cpu_s for x in r) for s, r in runs.items()}
    rows = [{**results[s].row(), "median_cpu_s": cpu[s]} for s in settings]
    best = max((r for r, s in zip(rows, settings) if s != "auto"), key=lambda r: r["requests_per_s"])
    best_cpu = min(cpu[s] for s in budgets)
    for row, setting in zip(rows, settings):
        row["ratio_to_best_fixed"] = row["requests_per_s"] / best["requests_per_s"]
        row["cpu_ratio_to_best_fixed"] = best_cpu / cpu[setting]
    return {
        "workload": wl.name,
        "cpu": cpu_kind(),
        "systems": rows,
        "best_fixed": best["system"],
        "best_fixed_cpu": f"budget {min(budgets, key=cpu.get)}",
        "auto_ratio": rows[-1]["ratio_to_best_fixed"],
        "auto_cpu_ratio": rows[-1]["cpu_ratio_to_best_fixed"],
        "auto_tuner": tuners,
        "repeats": repeats,
        "budget_cap": engine.budget_cap,
        "engine_config": engine.config.model_dump(),
        "num_kv_blocks": engine.num_kv_blocks,
    }


def run_embed_bench(
    embedder: Embedder, folder, texts: list[str], systems: list[str], batch_sizes: list[int], repeats: int
) -> dict:
    """The Embedder and sentence-transformers `encode` at each batch size on the same texts, each once per round,
    rounds interleaved in rotating order; the median wall time per system is reported. Every system is credited with
    the same tokens: the texts' as the Embedder's tokenizer gives them, cut at max_seq_length."""
    skipped = {k: v for k, v in peer_status().items() if k in systems and v}
    tokens = sum(len(t.token_ids) for t in embedder.encoder.tokenize(texts))
    wanted = "st" in systems and "st" not in skipped
    st_model = load_sentence_transformer(folder, embedder.device.type) if wanted else None
    runners = {}
    if "embedder" in systems:
        runners["embedder"] = lambda: run_embedder(embedder, texts, tokens)
    for b in batch_sizes if st_model is not None else []:
        runners[f"st batch {b}"] = lambda b=b: run_sentence_transformer(st_model, texts, b, tokens)
    # A warm-up of each on a few texts: the first call of either pays for allocations and lazy initialisation.
    embedder.embed(texts[:8], use_tqdm=False)
    if st_model is not None:
        st_model.encode(texts[:8], show_progress_bar=False)
    names = list(runners)
    runs, results = interleaved_rounds(names, repeats, lambda name: runners[name]())
    rows = [results[s].row() for s in names]
    base = results.get("embedder")
    for row, s in zip(rows, names):
        row["round_walls"] = [r.wall for r in runs[s]]
        row["ratio_to_embedder"] = base.wall / results[s].wall if base else None  # same tokens: by tokens/s
    cosine = {}
    if base:
        for s, r in results.items():
            if s != "embedder":
                c = F.cosine_similarity(base.embeddings, r.embeddings)
                cosine[s] = {"min": float(c.min()), "row": int(c.argmin()), "mean": float(c.mean())}
    lo, hi = EMBED_CHARS
    return {
        "workload": f"embed: {len(texts)} texts of {lo}-{hi} characters cut from {DOCUMENTS}, {tokens:,} tokens "
        f"(cut at max_seq_length {embedder.max_seq_length})",
        "cpu": cpu_kind(),
        "systems": rows,
        "skipped": skipped,
        "repeats": repeats,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "cosine": cosine,
        "embedder_config": embedder.config.model_dump(),
    }


@dataclass(frozen=True)
class BenchOptions:
    """`batchjob bench`'s options (cli.py documents each)."""

    task: str
    model: str | None  # None with --task image only: its SmolVLM-256M-shaped default
    job_file: str | None
    num_prompts: int | None
    input_len: int | None
    output_len: int
    range_ratio: float
    prefix_len: int
    systems: str | None
    batch_size: int | None
    repeats: int
    max_num_seqs: int | None
    max_num_batched_tokens: str | None
    budgets: list[int]
    load_format: str | None
    dtype: str | None
    enforce_eager: bool
    weights: str | None
    quality: bool
    json_path: str | None
    slots: int = LlamaServerOptions.slots
    requantize: str | None = None
    dummy_gguf: str | None = None
    labels: str | None = None
    loras: int | None = None
    lora_rank: int = 8
    vllm_dtype: str | None = None


QUALITY_JOB = "jobs/summarize.yaml"  # --quality's default workload: real documents, chat prompts, 64 tokens
QUALITY_ROWS = 200  # the count
INPUT_LEN = 256  # synthetic prompts' tokens
NUM_PROMPTS = 64  # synthetic prompts, and --task score's documents
BATCH_SIZE = 64  # of the static and hf baselines, and --task embed's tuned sentence-transformers batch
EMBED_TEXTS = 1000  # --task embed's default count of texts
ST_DEFAULT_BATCH = 32  # sentence-transformers encode's default batch size
QUALITY_HF_BATCH = 16  # transformers' batches with --quality: prompts of similar length (sorted), up to 2k tokens


def _engine(model: str, overrides: dict) -> Engine:
    try:
        return Engine(model, **overrides)
    except pydantic.ValidationError as e:
        raise JobFileError(f"bench: {e}") from None


def _embed_report(o: BenchOptions) -> dict:
    """`--task embed`: the Embedder on the --model folder, the texts and the comparison."""
    unused = [f for f, v in (("--job", o.job_file), ("--quality", o.quality), ("--sweep-budgets", o.budgets)) if v]
    if unused:
        raise JobFileError(f"bench --task embed: {', '.join(unused)}: for --task generate only")
    systems = [s.strip() for s in (o.systems or "embedder,st").split(",") if s.strip()]
    if unknown := sorted(set(systems) - {"embedder", "st"}):
        raise JobFileError(f"bench --task embed: unknown systems {unknown} (expected embedder, st)")
    config = {k: v for k, v in (("dtype", o.dtype), ("max_num_batched_tokens", o.max_num_batched_tokens)) if v}
    try:
        embedder = Embedder(o.model, **config)
    except pydantic.ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise JobFileError(f"bench --task embed: {why}") from None
    batch_sizes = sorted({ST_DEFAULT_BATCH, o.batch_size or BATCH_SIZE})
    texts = embed_texts(o.num_prompts or EMBED_TEXTS)
    return run_embed_bench(embedder, embedder.model_path, texts, systems, batch_sizes, o.repeats)


SCORE_SYSTEMS = ("engine", "hf", "vllm")


def _score_systems(o: BenchOptions) -> list[str]:
    """--task score's systems, after refusing the options that do not apply to it."""
    given = (("--quality", o.quality), ("--sweep-budgets", o.budgets), ("--requantize", o.requantize))
    if unused := [f for f, v in given if v]:
        raise JobFileError(f"bench --task score: {', '.join(unused)}: for --task generate only")
    if o.labels is not None and not all(label.strip() for label in o.labels.split(",")):
        raise JobFileError(f"bench --labels {o.labels!r}: a comma list of non-empty labels expected")
    if o.input_len is None and not o.job_file and (o.range_ratio or o.prefix_len):
        raise JobFileError("bench --task score: --range-ratio and --prefix-len shape random prompts: give --input-len")
    systems = [s.strip() for s in (o.systems or "engine,hf").split(",") if s.strip()]
    if unknown := sorted(set(systems) - set(SCORE_SYSTEMS)):
        raise JobFileError(f"bench --task score: unknown systems {unknown} (expected {', '.join(SCORE_SYSTEMS)})")
    return systems


def _score_report(o: BenchOptions, engine: Engine, wl: Workload) -> dict:
    """--task score on the workload's prompts: those of 2 tokens or more (a row's first token is not scored)."""
    rows = [r.prompt_token_ids for r in wl.requests if len(r.prompt_token_ids) >= 2]
    if not rows:
        raise JobFileError("bench --task score: no row of the workload has the 2 tokens or more a score needs")
    if too_long := sum(len(r) > engine.max_model_len for r in rows):
        raise JobFileError(f"bench --task score: {too_long} rows exceed the model's context ({engine.max_model_len})")
    short = len(wl.requests) - len(rows)
    name = f"score: {wl.name}" + (f"; {short} rows of one token left out" if short else "")
    labels = None
    if o.labels is not None:
        # each label's tokens as they follow a prompt: a leading space, no special tokens
        texts = [" " + label.strip() for label in o.labels.split(",")]
        labels = [engine.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        if too_long := sum(len(r) + max(map(len, labels)) > engine.max_model_len for r in rows):
            raise JobFileError(f"bench --labels: {too_long} rows and their longest label exceed the model's context")
        name += f"; each row with {len(labels)} labels ({o.labels})"
    systems = _score_systems(o)
    return run_score_bench(
        engine, engine.model_path, rows, name, systems, o.batch_size, o.repeats, labels, o.vllm_dtype
    )


IMAGE_ROWS = 32  # --task image's default rows
IMAGE_SYSTEMS = ("engine", "hf", "vllm")


def _image_report(o: BenchOptions) -> dict:
    """`--task image`: the engine on --model (default: a random-weight SmolVLM-256M-Instruct-shaped Idefics3, built
    once into the cache) and the rows, after refusing the options that do not apply."""
    given = (
        ("--job", o.job_file),
        ("--quality", o.quality),
        ("--sweep-budgets", o.budgets),
        ("--input-len", o.input_len),
        ("--range-ratio", o.range_ratio),
        ("--prefix-len", o.prefix_len),
        ("--load-format", o.load_format),
        ("--gguf", o.dummy_gguf),
        ("--requantize", o.requantize),
        ("--loras", o.loras),
        ("--labels", o.labels),
    )
    if unused := [f for f, v in given if v]:
        raise JobFileError(f"bench --task image: {', '.join(unused)}: not for image rows")
    systems = [s.strip() for s in (o.systems or "engine,hf").split(",") if s.strip()]
    if unknown := sorted(set(systems) - set(IMAGE_SYSTEMS)):
        raise JobFileError(f"bench --task image: unknown systems {unknown} (expected {', '.join(IMAGE_SYSTEMS)})")
    overrides = {
        k: v
        for k, v in (
            ("max_num_seqs", o.max_num_seqs),
            ("max_num_batched_tokens", o.max_num_batched_tokens),
            ("dtype", o.dtype),
            ("weights", o.weights),
            ("enforce_eager", o.enforce_eager or None),
        )
        if v is not None
    }
    engine = _engine(o.model or str(idefics3_folder()), overrides)
    if engine.image_prompter is None:
        raise JobFileError(f"bench --task image: {engine.model_path} is not a vision-language model")
    rows = image_rows(engine.image_prompter.processor, o.num_prompts or IMAGE_ROWS)
    folder, hf_batch = engine.model_path, o.batch_size
    return run_image_bench(engine, folder, rows, o.output_len, systems, hf_batch, o.repeats, o.vllm_dtype)


def bench(o: BenchOptions) -> str:
    """Build the engine and the workload the options name, run the comparison (or the budget sweep), write the JSON
    report where asked, and return the table."""
    if o.task == "embed":
        report = _embed_report(o)
        _write_json(o.json_path, report)
        return format_embed(report)
    if o.task == "image":
        report = _image_report(o)
        _write_json(o.json_path, report)
        return format_image(report)
    if o.task == "score":
        _score_systems(o)  # its refusals before the engine loads
    elif o.labels is not None:
        raise JobFileError("bench --labels: for --task score only")
    overrides = {
        k: v
        for k, v in (
            ("max_num_seqs", o.max_num_seqs),
            ("max_num_batched_tokens", o.max_num_batched_tokens),
            ("load_format", o.load_format),
            ("dtype", o.dtype),
            ("weights", o.weights),
            ("enforce_eager", o.enforce_eager or None),  # a flag: absent leaves the job file's setting
        )
        if v is not None
    }
    if o.budgets:
        overrides["max_num_batched_tokens"] = "auto"  # sizes the engine's memory for every budget it may run at
    if o.requantize and o.requantize not in llama_server.QUANT_TYPES:
        raise JobFileError(f"bench --requantize {o.requantize}: not one of {', '.join(llama_server.QUANT_TYPES)}")
    if o.quality and o.dtype:
        raise JobFileError("bench --quality runs the engine in float32 and in bfloat16: --dtype does not apply")
    if o.quality and o.weights not in (None, *QUALITY_WEIGHTS):
        raise JobFileError(
            "bench --quality: --weights int8, int4 or w8a8 sets that engine against fp32; other values do not apply"
        )
    model, job = o.model, None
    if o.dummy_gguf:
        if o.load_format != "dummy":
            raise JobFileError("bench --gguf TYPE writes the dummy weights as a GGUF: give --load-format dummy too")
        if o.dummy_gguf not in llama_server.QUANT_TYPES:
            raise JobFileError(f"bench --gguf {o.dummy_gguf}: not one of {', '.join(llama_server.QUANT_TYPES)}")
        model = str(dummy_gguf_apart(o.model, 0, o.dummy_gguf))
        overrides.pop("load_format")  # every system reads the file
    job_file = o.job_file or (QUALITY_JOB if o.quality else None)
    if job_file:
        job = load_job(job_file)
        if job.task != "generate":  # its rows are not generation requests (--task embed benches an embedder)
            raise JobFileError(f"bench --job: {job_file} is a task '{job.task}' job; --job takes a generation job")
        model = job.model
        overrides = {**job.engine.model_dump(exclude_unset=True), **overrides}
    quality_fp32 = {**overrides, "dtype": "float32", "weights": "dequantize"}
    engine = _engine(model, quality_fp32 if o.quality else overrides)
    if job:
        wl = job_workload(job, engine, o.num_prompts or (QUALITY_ROWS if o.quality else None))
    elif o.task == "score" and o.input_len is None:
        wl = document_workload(engine, o.num_prompts or NUM_PROMPTS)
    else:
        vocab = engine.model_config.vocab_size
        input_len = o.input_len or INPUT_LEN
        wl = synthetic(vocab, o.num_prompts or NUM_PROMPTS, input_len, o.output_len, o.range_ratio, o.prefix_len)
    if o.loras:
        del engine  # each system below builds its own
        with tempfile.TemporaryDirectory(prefix="batchjob-bench-lora-") as root:
            report = run_lora_bench(model, overrides, wl, o.loras, o.lora_rank, Path(root), max(o.repeats, 1))
        text = format_lora(report)
    elif o.task == "score":
        report = _score_report(o, engine, wl)
        text = format_score(report)
    elif o.quality:
        # int8, int4 or w8a8 in float32 (its matmuls the one change from fp32), or bf16 with the weights as the job
        # sets them
        other = {**quality_fp32, "weights": o.weights} if o.weights else {**overrides, "dtype": "bfloat16"}
        report = run_quality(engine, _engine(model, other), wl, o.batch_size or QUALITY_HF_BATCH)
        text = format_quality(report)
    elif o.budgets:
        report = run_sweep(engine, wl, o.budgets, o.repeats)
        text = format_sweep(report)
    else:
        systems = [s.strip() for s in (o.systems or "engine,static,hf").split(",") if s.strip()]
        batch = o.batch_size or BATCH_SIZE
        llama = LlamaServerOptions(o.slots, o.requantize)
        threads = torch.get_num_threads()
        report = run_bench(engine, engine.model_path, wl, systems, batch, o.repeats, threads, llama, o.vllm_dtype)
        text = format_report(report)
    _write_json(o.json_path, report)
    return text


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
