"""The `batchjob` command: run, plan and status for job files; generate, bench, report and selftest."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

from batchjob.engine.errors import DeviceSettingError
from batchjob.env import configure_threads
from batchjob.job.exit_codes import EXIT_CHECKS_FAILED, EXIT_INTERNAL, EXIT_IO, EXIT_LOCKED, EXIT_OK, EXIT_USAGE
from batchjob.job.input.reader import InputError
from batchjob.job.output.lease import LeaseLost
from batchjob.job.output.lock import LockHeld, describe
from batchjob.job.output.state import OutputDir, StateError
from batchjob.job.output.storage import is_url
from batchjob.job.plan import plan_job
from batchjob.job.run.runner import run_job
from batchjob.job.spec import JobFileError, JobSpec, load_job
from batchjob.job.telemetry.progress import LogProgress, RichProgress
from batchjob.model.builtin import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from batchjob.model.errors import CacheDirError, ModelError

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job-file setting, e.g. --set engine.max_num_seqs=32 (repeatable).",
)


def _load(job_file: str, overrides: tuple[str, ...]) -> JobSpec:
    try:
        return load_job(job_file, overrides)
    except JobFileError as e:
        _fail(str(e), EXIT_USAGE)


def _fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def _failures() -> Iterator[None]:
    """A condition the user can act on gets one line and its exit code; anything else is a bug, whose traceback goes
    to a log file that the one line names."""
    try:
        yield
    except (LockHeld, LeaseLost) as e:
        _fail(str(e), EXIT_LOCKED)
    except (InputError, StateError, JobFileError, ModelError, DeviceSettingError, CacheDirError) as e:
        _fail(str(e), EXIT_USAGE)
    except OSError as e:  # a read-only folder, a full disk, a file that went away
        _fail(f"cannot read or write a file: {e}", EXIT_IO)
    except Exception as e:
        with tempfile.NamedTemporaryFile("w", prefix="batchjob-error-", suffix=".log", delete=False) as log:
            traceback.print_exc(file=log)
        _fail(f"internal error: {type(e).__name__}: {e} (the traceback is in {log.name})", EXIT_INTERNAL)


@click.group()
@click.version_option(package_name="batchjob")
def main() -> None:
    """Offline LLM batch inference: continuous batching, paged KV cache, resumable Parquet output."""
    configure_threads()  # before any command imports torch


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--restart", is_flag=True, help="Discard the output folder's earlier results and start over.")
@click.option(
    "--allow-numerics-change",
    is_flag=True,
    help="Resume even where the earlier results were computed under another device, dtype or ops backend "
    "(recorded in _job.json); refused otherwise.",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Where the engines run: this process, or Ray workers (the job file's `ray:` section); "
    "default: the job file's `executor`.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Periodic log lines (used when stdout is not a terminal, and always with json).",
)
@click.option("--log-interval", type=float, default=10.0, show_default=True, help="Seconds between log lines.")
@click.option(
    "--grace",
    type=float,
    default=10.0,
    show_default=True,
    help="On SIGINT/SIGTERM/SIGHUP, seconds that requests in flight get to finish before they are dropped.",
)
def run(
    job_file: str,
    overrides: tuple[str, ...],
    restart: bool,
    allow_numerics_change: bool,
    executor: str | None,
    log_format: str,
    log_interval: float,
    grace: float,
) -> None:
    """Run JOB_FILE: read its input, generate, and commit results to its output folder; resumes by itself.

    Exit codes: 0 all rows done; 2 usage, job-file, input, model or setting error; 3 finished but some rows
    failed (with fail_on_row_errors); 70 internal error (the message names the log with the traceback); 74 a file
    cannot be read or written (read-only folder, full disk); 75 another run holds the output folder; 129/130/143
    interrupted (SIGHUP/SIGINT/SIGTERM), resumable."""
    job = _load(job_file, overrides + ((f"executor={executor}",) if executor else ()))
    progress = (
        RichProgress()
        if sys.stdout.isatty() and log_format == "text"
        else LogProgress(interval=log_interval, json_lines=log_format == "json")
    )
    with _failures():
        code = run_job(job, progress, restart=restart, allow_numerics_change=allow_numerics_change, grace=grace)
    sys.exit(code)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--no-calibrate", is_flag=True, help="Skip the short measured run; no time estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job_file: str, overrides: tuple[str, ...], no_calibrate: bool, as_json: bool) -> None:
    """Show what JOB_FILE will cost without running it: tokens, prefix sharing, KV memory, time."""
    job = _load(job_file, overrides)
    with _failures():
        report = plan_job(job, calibrate=not no_calibrate)
    click.echo(json.dumps(report, indent=2) if as_json else _plan_text(report))


def _plan_text(r: dict) -> str:
    lines = [("rows", f"{r['rows']:,} ({r['rows_failing_before_the_model']:,} fail before the model)")]
    if "rows_from_results_cache" in r:
        lines.append(("results cache", f"{r['rows_from_results_cache']:,} rows taken from it, left out below"))
    if r.get("task") == "embed":
        return _plan_embedding_text(r, lines)
    if r.get("task") == "score":
        return _plan_scoring_text(r, lines)
    if r["requests"]:
        lines += [
            ("requests", f"{r['requests']:,} ({r['duplicate_rows_computed_once']:,} duplicate rows computed once)"),
            (
                "prompt tokens",
                f"total {r['prompt_tokens_total']:,} | p50 {r['prompt_tokens_p50']:,} | p99 {r['prompt_tokens_p99']:,}",
            ),
            ("output tokens", f"expected {r['output_tokens_expected']:,} (at most {r['output_tokens_max']:,})"),
            ("constrained", f"{r['constrained_rows']:,} rows by {r['distinct_grammars']:,} distinct grammars"),
            *(
                [
                    (
                        "images",
                        f"{r['images']:,} in {r['image_rows']:,} rows with images, {r['image_tokens_total']:,} image "
                        "tokens",
                    )
                ]
                if "image_rows" in r
                else []
            ),
            ("prefix sharing", f"{100 * r['prefix_sharing_ratio']:.1f}% of prompt tokens hit cached blocks"),
            (
                "KV per sequence",
                f"mean {_mib(r['kv_bytes_per_sequence_mean'])} | max {_mib(r['kv_bytes_per_sequence_max'])}",
            ),
            (
                "sequences that fit",
                f"{r['sequences_that_fit']:,} in {r['kv_cache_tokens']:,} KV tokens (max_num_seqs {r['max_num_seqs']})",
            ),
            (
                "KV pool",
                f"{r['kv_pool_bytes'] / 2**30:.2f} GiB, {r['kv_pool_blocks']:,} blocks: {r['kv_pool_sized_by']}",
            ),
        ]
    if "calibration" in r:
        c = r["calibration"]
        lines += [
            (
                "calibration",
                f"{c['requests']} requests: prefill {c['prefill_tokens_per_s']:,.0f} tok/s, "
                f"decode step {1000 * c['decode_step_s']:.1f} ms at batch {c['decode_batch_size']}",
            ),
            ("estimated time", f"{r['estimated_time_s']:,.0f} s"),
        ]
    return _table(lines + _peak_memory_line(r))


def _peak_memory_line(r: dict) -> list[tuple[str, str]]:
    predicted = r.get("peak_rss_bytes_predicted")
    return [] if predicted is None else [("peak memory", f"{predicted / 2**30:.2f} GiB resident (predicted)")]


def _plan_embedding_text(r: dict, lines: list[tuple[str, str]]) -> str:
    if r["requests"]:
        lines += [
            ("inputs", f"{r['requests']:,} ({r['rows_truncated']:,} rows cut at {r['max_seq_length']:,} tokens)"),
            (
                "input tokens",
                f"total {r['prompt_tokens_total']:,} | p50 {r['prompt_tokens_p50']:,} | p99 {r['prompt_tokens_p99']:,}",
            ),
            ("embeddings", f"{r['dimension']:,} values each"),
        ]
    if "calibration" in r:
        c = r["calibration"]
        lines += [
            ("calibration", f"{c['inputs']:,} inputs: {c['tokens_per_s']:,.0f} tok/s"),
            ("estimated time", f"{r['estimated_time_s']:,.0f} s"),
        ]
    return _table(lines)


def _plan_scoring_text(r: dict, lines: list[tuple[str, str]]) -> str:
    if r["requests"]:
        lines += [
            ("requests", f"{r['requests']:,} ({r['duplicate_rows_computed_once']:,} duplicate rows computed once)"),
            (
                "tokens read",
                f"total {r['prompt_tokens_total']:,} | p50 {r['prompt_tokens_p50']:,} | p99 {r['prompt_tokens_p99']:,}",
            ),
            ("tokens scored", f"{r['scored_tokens_total']:,}"),
            (
                "prefill",
                f"{r['prefill_tokens_expected']:,} tokens"
                + (f" (one prefill of each prompt for its {r['labels']} labels)" if "labels" in r else ""),
            ),
        ]
    if "calibration" in r:
        c = r["calibration"]
        estimate = "?" if r["estimated_time_s"] is None else f"{r['estimated_time_s']:,.0f} s"
        lines += [
            ("calibration", f"{c['requests']} requests: prefill {c['prefill_tokens_per_s']:,.0f} tok/s"),
            ("estimated time", estimate),
        ]
    return _table(lines + _peak_memory_line(r))


def _table(lines: list[tuple[str, str]]) -> str:
    return "\n".join(f"{k:<20}{v}" for k, v in lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@main.command()
@click.argument("folder")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(folder: str, as_json: bool) -> None:
    """Show the progress of the job writing to FOLDER (its output.path, a local folder or a URL such as
    s3://bucket/run, with credentials from the environment), running or stopped."""
    if not is_url(folder) and not Path(folder).is_dir():
        _fail(f"{folder} is not a folder", EXIT_USAGE)
    with _failures():
        s = OutputDir(folder).status()
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    state = s["state"] + (f" ({describe(s['holder'])})" if s["holder"] else "")
    total = s["rows_total"]
    pct = f" ({100 * s['rows_done'] / total:.1f}%)" if total else ""
    click.echo(f"{s['folder']}: {state}")
    click.echo(f"rows: {s['rows_done']:,} of {'?' if total is None else total} done{pct}, {s['rows_failed']:,} failed")
    click.echo(f"tokens: prompt {s['prompt_tokens']:,}, output {s['output_tokens']:,}")
    if s["cache_hits"] or s["cache_misses"]:
        click.echo(f"results cache: {s['cache_hits']:,} rows taken from it, {s['cache_misses']:,} computed")
    if s["lora"] is not None:
        click.echo(f"rows by LoRA adapter: {_by_adapter(s['lora'], s['lora_unrecorded_rows'])}")
    if s["parts"]:
        click.echo(f"parts: {s['parts']}, last commit {s['last_commit_s_ago']} s ago")
    if s["summary"]:
        click.echo(f"summary: {json.dumps(s['summary'])}")


def _by_adapter(lora: dict, unrecorded: int, shown: int = 8) -> str:
    """ "base 8, alpha 4 (1 failed), beta 4": the base model's rows and the adapters' with most rows first."""
    counts = [("base", lora["base_model"]), *lora["adapters"].items()]
    counts.sort(key=lambda item: -item[1]["rows"])
    text = ", ".join(
        f"{n} {c['rows']:,}" + (f" ({c['failed']:,} failed)" if c["failed"] else "") for n, c in counts[:shown]
    )
    more = f" (+{len(counts) - shown} more: --json lists them)" if len(counts) > shown else ""
    # parts written before parts recorded their adapters
    return text + more + (f"; {unrecorded:,} rows in parts that record no adapter" if unrecorded else "")


@main.command()
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="built-in name, GGUF file or HF folder")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--seed", default=None, type=int)
@click.option("--system", default=None, help="system message for the chat template")
@click.option("--no-chat", is_flag=True, help="send the prompt as raw text, without the chat template")
def generate(prompt, model, max_tokens, temperature, seed, system, no_chat) -> None:
    """Complete one PROMPT with the model and print the text."""
    from batchjob.engine.engine import Engine, SamplingParams

    with _failures():
        engine = Engine(model)
        tok = engine.tokenizer
        if no_chat:
            ids = tok.encode(prompt)
        elif tok.chat_template is None:
            _fail(f"{model} has no chat template: add --no-chat to send the prompt as it is", EXIT_USAGE)
        else:
            system_turn = [{"role": "system", "content": system}] if system else []
            try:
                ids = tok.encode_chat([*system_turn, {"role": "user", "content": prompt}])
            except Exception as e:  # the template is the model's code: some refuse a system turn, for one
                _fail(f"the model's chat template refused this prompt: {e}", EXIT_USAGE)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        [out] = engine.generate([ids], params, use_tqdm=False)
    click.echo(out.text)


def _budgets(ctx, param, text: str | None) -> list[int]:
    """The fixed budgets of --sweep-budgets; `auto` always runs too, so naming it is allowed and changes nothing."""
    try:
        budgets = [int(b) for b in (text or "").split(",") if b.strip() not in ("", "auto")]
    except ValueError:
        budgets = [0]
    if text and (not budgets or min(budgets) < 16):
        raise click.BadParameter("expected fixed budgets (numbers >= 16) separated by commas")
    return budgets


@main.command()
@click.option(
    "--task",
    default="generate",
    show_default=True,
    type=click.Choice(["generate", "embed", "score", "image"]),
    help="embed: the Embedder against sentence-transformers encode on texts cut from sample_data/documents.parquet "
    "(--model: a sentence-transformers folder or built-in name); score: Engine.score against transformers' forward "
    "and vLLM's prompt_logprobs by scored tokens/s, on sample_data/documents.parquet's documents (or --job's rows, or "
    "random tokens with --input-len); image: rows of a generated picture and a caption prompt through a "
    "vision-language model, against transformers' generate and vLLM, by output tokens/s",
)
@click.option(
    "--model",
    default=None,
    help=f"default: {DEFAULT_MODEL}, or {DEFAULT_EMBEDDING_MODEL} with --task embed, or with --task image a "
    "random-weight Idefics3 of SmolVLM-256M-Instruct's shape (built once into the cache)",
)
@click.option(
    "--job",
    "job_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="the workload is this job file's rows, prompts, sampling, model and engine settings",
)
@click.option(
    "--num-prompts",
    "--rows",
    "num_prompts",
    default=None,
    type=click.IntRange(min=1),
    help="synthetic prompts (default 64), or the job's first rows (default all; with --quality 200), or with --task "
    "embed texts (default 1000), or with --task score documents (default 64), or with --task image rows (default 32)",
)
@click.option(
    "--input-len",
    default=None,
    type=click.IntRange(min=1),
    help="synthetic prompts' tokens (default 256); with --task score, scores random tokens instead of documents",
)
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--range-ratio",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="lengths uniform in len*(1-r)..len*(1+r)",
)
@click.option("--prefix-len", default=0, show_default=True, type=click.IntRange(min=0), help="shared prefix tokens")
@click.option(
    "--systems",
    default=None,
    help="comma list of engine, unconstrained, static, hf, vllm, llama-server (default engine,static,hf); with --task "
    "embed of embedder, st (default both); with --task score or image of engine, hf, vllm (default engine,hf)",
)
@click.option(
    "--batch-size",
    default=None,
    type=click.IntRange(min=1),
    help="fixed batch size of the static and hf baselines (default 64), or of transformers with --quality (default "
    "16), or with --task embed sentence-transformers' tuned batch (default 64; its default 32 runs too), or with "
    "--task score or image transformers' one batch (default: it tries 1, 4, 16 and 64 and reports each)",
)
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--max-num-seqs", default=None, type=int)
@click.option("--max-num-batched-tokens", default=None, help="a number, or 'auto'")
@click.option(
    "--sweep-budgets",
    "budgets",
    default=None,
    metavar="N,N,...",
    callback=_budgets,
    help="instead of --systems: this engine at each fixed token budget and at 'auto', on the workload",
)
@click.option(
    "--load-format",
    default=None,
    type=click.Choice(["auto", "dummy"]),
    help="dummy: random weights with the model's config (a built-in or shipped name, or a config.json)",
)
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    help="the engine's (and vLLM's) dtype; default: the job file's, else auto",
)
@click.option(
    "--vllm-dtype",
    default=None,
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="vLLM's dtype, where it should differ from the engine's (vLLM's own default for SmolLM2 is bfloat16)",
)
@click.option(
    "--weights",
    default=None,
    type=click.Choice(["auto", "dequantize", "quantized", "int8", "int4", "w8a8"]),
    help="the engine's matmuls: in its dtype on dequantized weights, on a GGUF's quantized blocks, on weights "
    "quantized to int8 or int4 at load (weight-only), or W8A8 (w8a8); default: the job file's, else auto; with "
    "--quality, int8, int4 or w8a8 measures that engine against fp32 instead of bf16",
)
@click.option("--enforce-eager", is_flag=True, help="decode without CUDA graphs (vLLM's flag)")
@click.option(
    "--quality",
    is_flag=True,
    help="instead of throughput: the bf16 (or with --weights int8, int4 or w8a8 that) engine's NLL of the fp32 "
    "engine's greedy continuations against fp32's, and "
    "where greedy outputs first differ (engine and transformers, bf16 and fp32), on a job's rows "
    "(default --job jobs/summarize.yaml)",
)
@click.option(
    "--slots",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="llama-server's parallel slots (-np), kept full by as many concurrent requests",
)
@click.option(
    "--requantize",
    default=None,
    metavar="TYPE",
    help="llama-server runs the engine's GGUF requantized to TYPE (Q8_0, Q4_0, ..., BF16, F16) by llama.cpp's "
    "llama-quantize",
)
@click.option(
    "--gguf",
    "dummy_gguf",
    default=None,
    metavar="TYPE",
    help="with --load-format dummy: the dummy weights written as a GGUF by llama.cpp's convert_hf_to_gguf.py and "
    "quantized to TYPE (Q8_0, Q4_K_M, ...) by its llama-quantize (cached); the engine and llama-server load that "
    "file, vLLM its HF export: the very same weights at a model's real shape",
)
@click.option(
    "--labels",
    default=None,
    metavar="A,B,...",
    help="with --task score: a classification, each row scored with each label as its continuation (Engine.score's "
    "labels; transformers and vLLM one sequence per row and label), credited with the labels' tokens",
)
@click.option(
    "--loras",
    default=None,
    type=click.IntRange(1, 256),
    help="the rows spread over N random LoRA adapters in one engine, against the same rows on the base model and "
    "against N runs one after another, a fresh engine with one adapter each (a job per adapter)",
)
@click.option("--lora-rank", default=8, show_default=True, type=click.IntRange(1, 1024), help="with --loras")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="write the report as JSON")
def bench(**options) -> None:
    """Throughput of this engine against baselines on one workload, in one process (with --task embed the
    Embedder's, with --task score Engine.score's); or with --quality what bf16 costs in quality."""
    from batchjob.bench.compare import BenchOptions
    from batchjob.bench.compare import bench as run_bench

    embedding = options["task"] == "embed"
    if options["task"] != "image":  # image rows' default model is built by the bench
        options["model"] = options["model"] or (DEFAULT_EMBEDDING_MODEL if embedding else DEFAULT_MODEL)
    with _failures():
        click.echo(run_bench(BenchOptions(**options)))


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--output-dir", default=None, type=click.Path(file_okay=False), help="default: FOLDER/report")
def report(folder, output_dir) -> None:
    """Draw the job output FOLDER: batch size, KV usage and tokens/s over time, TTFT/TPOT, row lengths; PNGs and one
    self-contained HTML page."""
    from batchjob.job.telemetry.report import render

    with _failures():
        try:
            paths = render(folder, output_dir)
        except FileNotFoundError as e:  # not a job's output folder
            _fail(str(e), EXIT_USAGE)
    for path in paths:
        click.echo(str(path))


@main.command()
@click.option("--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]))
@click.option("--load-format", default="dummy", show_default=True, type=click.Choice(["auto", "dummy"]))
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="write every figure as JSON")
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Path(exists=True),
    help="A GGUF file or HF model folder for the real-model part, besides the built-in models found here (repeatable).",
)
def selftest(device, load_format, json_path, models) -> None:
    """The device check: Triton kernels against torch, Triton-vs-torch greedy equality of the engine, decode
    through CUDA graphs against eager, throughput against torch ops and HF generate with a roofline, steps without a
    host synchronisation, KV pool sizing with graphs captured, and real weights' greedy tokens against transformers
    (the built-in models found here and each --model; never downloaded); each part guarded and time-capped.
    `--device cpu` runs the same parts on tiny shapes in Triton's interpreter. Exit code 1 unless all passed."""
    import torch

    from batchjob.bench.device_check import run_check

    if device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda: torch sees no CUDA device here (use --device cpu for the CPU form)", EXIT_USAGE)
    with _failures():
        report = run_check(device, json_path, load_format, click.echo, models)
    sys.exit(EXIT_OK if report["passed"] else EXIT_CHECKS_FAILED)


if __name__ == "__main__":
    main()
