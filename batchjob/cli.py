"""The `batchjob` command."""
from __future__ import annotations

import click

from batchjob.job.cli import plan, run, status
from batchjob.models import DEFAULT_MODEL


@click.group()
@click.version_option(package_name="batchjob")
def main() -> None:
    """Offline LLM batch inference: continuous batching, paged KV cache, resumable Parquet output."""


main.add_command(run)
main.add_command(plan)
main.add_command(status)


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
    from batchjob.engine import Engine, SamplingParams

    engine = Engine(model)
    tok = engine.tokenizer
    if no_chat:
        ids = tok.encode(prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tok.encode_chat(messages)
    [out] = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
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
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--job", "job_file", default=None, type=click.Path(dir_okay=False),
              help="the workload is this job file's rows, prompts, sampling, model and engine settings")
@click.option("--num-prompts", default=None, type=click.IntRange(min=1),
              help="synthetic prompts (default 64), or the job's first rows (default all)")
@click.option("--input-len", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--range-ratio", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="lengths uniform in len*(1-r)..len*(1+r)")
@click.option("--prefix-len", default=0, show_default=True, type=click.IntRange(min=0), help="shared prefix tokens")
@click.option("--systems", default="engine,static,hf", show_default=True,
              help="comma list of engine, static, hf, vllm, llama-cpp")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1),
              help="fixed batch size of the static and hf baselines")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--max-num-seqs", default=None, type=int)
@click.option("--max-num-batched-tokens", default=None, help="a number, or 'auto'")
@click.option("--sweep-budgets", "budgets", default=None, metavar="N,N,...", callback=_budgets,
              help="instead of --systems: this engine at each fixed token budget and at 'auto', on the workload")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="write the report as JSON")
def bench(model, job_file, num_prompts, input_len, output_len, range_ratio, prefix_len, systems, batch_size, repeats,
          max_num_seqs, max_num_batched_tokens, budgets, json_path) -> None:
    """Throughput of this engine against baselines on one workload, in one process."""
    import json

    import pydantic

    from batchjob.bench import format_report, format_sweep, job_workload, run_bench, run_sweep, synthetic
    from batchjob.engine import Engine
    from batchjob.job.spec import JobFileError, load_job
    from batchjob.model_loader import resolve_model

    overrides = {k: v for k, v in (("max_num_seqs", max_num_seqs),
                                   ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
    if budgets:
        overrides["max_num_batched_tokens"] = "auto"  # sizes the engine's memory for every budget it may run at
    job = None
    if job_file:
        try:
            job = load_job(job_file)
        except JobFileError as e:
            raise click.ClickException(str(e)) from None
        model = job.model
        overrides = {**job.engine.model_dump(exclude_unset=True), **overrides}
    try:
        engine = Engine(model, **overrides)
    except pydantic.ValidationError as e:
        raise click.ClickException(str(e)) from None
    if job:
        wl = job_workload(job, engine, num_prompts)
    else:
        wl = synthetic(engine.model_config.vocab_size, num_prompts or 64, input_len, output_len, range_ratio,
                       prefix_len)
    if budgets:
        report = run_sweep(engine, wl, budgets, repeats)
        click.echo(format_sweep(report))
    else:
        import torch

        report = run_bench(engine, resolve_model(model), wl, [s.strip() for s in systems.split(",") if s.strip()],
                           batch_size, repeats, torch.get_num_threads())
        click.echo(format_report(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--output-dir", default=None, type=click.Path(file_okay=False), help="default: FOLDER/report")
def report(folder, output_dir) -> None:
    """Draw the job output FOLDER: batch size, KV usage and tokens/s over time, TTFT/TPOT, row lengths; PNGs and one
    self-contained HTML page."""
    from batchjob.report import render

    try:
        paths = render(folder, output_dir)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    for path in paths:
        click.echo(str(path))


@main.command()
@click.option("--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]))
@click.option("--small", is_flag=True, help="tiny shapes (implied on a CPU, where the Triton interpreter runs)")
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--num-prompts", default=512, show_default=True, type=click.IntRange(min=1))
def selftest(device, small, model, num_prompts) -> None:
    """Every Triton kernel against its torch reference, then an engine throughput run with the kernels."""
    import os
    import sys

    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports kernels.*
    from batchjob.bench import format_report, run_bench, synthetic
    from batchjob.engine import Engine
    from batchjob.model_loader import resolve_model
    from kernels.selftest import format_table, run_selftest

    rows = run_selftest(device, small=small or device == "cpu")
    click.echo(format_table(rows))
    engine = Engine(model, device=device, ops_backend="triton")
    n = num_prompts if device == "cuda" else 4
    wl = synthetic(engine.model_config.vocab_size, n, 256 if device == "cuda" else 16, 64 if device == "cuda" else 4)
    click.echo(format_report(run_bench(engine, resolve_model(model), wl, ["engine"], 1, 1, 1)))
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
