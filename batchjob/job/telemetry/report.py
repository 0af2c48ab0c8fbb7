"""`batchjob report OUT`: a job's output folder drawn as PNG charts and one self-contained HTML page.

Over time, from `_timeline.parquet`: sequences per step, KV-cache usage and tokens/s. From the result rows: TTFT and
TPOT distributions and the prompt and output lengths. A healthy run holds KV usage steady and mid-to-high while
requests wait (freed blocks are refilled at once); an unhealthy one spikes to full, preempts, and drains to empty,
as a fixed batch does. The KV chart therefore marks the watermark and states, over the steps where requests were
waiting, the mean, the 10-90th percentile band and how often usage was near full or near empty."""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from matplotlib.figure import Figure  # no pyplot: no global state, no display; savefig renders with Agg
from matplotlib.ticker import MaxNLocator

from batchjob.engine.config import EngineConfig
from batchjob.job.output.state import DATA, JOB_FILE, SUMMARY, TIMELINE, StateError
from batchjob.job.telemetry.timeline import read_timeline

CHART_COLUMNS = ["prompt_tokens", "output_tokens", "ttft_s", "total_time_s", "error"]
MAX_POINTS = 300  # a rate over fewer timeline rows than this would be too spiky to read
FULL, EMPTY = 0.98, 0.05


@dataclass
class Chart:
    name: str
    title: str
    figure: Figure
    caption: str = ""


def render(folder: Path, out_dir: Path | None = None) -> list[Path]:
    """Writes OUT/report/*.png and report.html (or into `out_dir`); returns the paths written."""
    folder = Path(folder)
    out_dir = Path(out_dir) if out_dir else folder / "report"
    meta = _read_json(folder / JOB_FILE) or {}
    if (meta.get("fingerprint") or {}).get("task") == "embed":
        raise StateError(
            f"{folder} holds an embedding job (task: embed): `batchjob report` draws a generation job's steps, "
            "latencies and lengths; `batchjob status` shows an embedding job's progress"
        )
    timeline = read_timeline(folder / TIMELINE)
    results = _read_results(folder / DATA)
    if not timeline.num_rows and results is None:
        raise FileNotFoundError(
            f"{folder}: neither {TIMELINE} nor result parts in {DATA}/: not a job's output "
            "folder, or no run has got to generate yet"
        )
    engine = EngineConfig.model_validate(meta.get("job", {}).get("engine", {}))
    charts = []
    if timeline.num_rows:
        charts += [batch_chart(timeline, engine), kv_chart(timeline, engine), throughput_chart(timeline)]
    if results is not None:
        charts += [latency_chart(results), length_chart(results)]
    out_dir.mkdir(parents=True, exist_ok=True)
    written, images = [], []
    for chart in charts:
        path = out_dir / f"{chart.name}.png"
        chart.figure.savefig(path, dpi=100)
        written.append(path)
        images.append((chart, base64.b64encode(path.read_bytes()).decode()))
    page = out_dir / "report.html"
    page.write_text(_html(folder, meta, _read_json(folder / SUMMARY), timeline, results, images), encoding="utf-8")
    return [*written, page]


def _read_results(data: Path) -> pa.Table | None:
    parts = sorted(data.glob("*.parquet"))
    if not parts:
        return None
    return pa.concat_tables(pq.read_table(p, columns=CHART_COLUMNS) for p in parts)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# -- over time ---------------------------------------------------------------------------------------------------
def _clock(t: pa.Table) -> tuple[np.ndarray, str]:
    """Each row's end since the first row began, in a unit that suits the run's length."""
    end = t.column("time").to_numpy()
    seconds = end - (end[0] - t.column("busy_s")[0].as_py())
    for unit, size in (("seconds", 1), ("minutes", 60), ("hours", 3600)):
        if seconds[-1] < 120 * size or unit == "hours":
            return seconds / size, unit


def _rates(t: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefill and decode tokens/s of the wall time, over windows of rows (few enough points to read), and the
    windows' end times. A window does not straddle two runs: the gap between them is no work."""
    x, end = _clock(t)[0], t.column("time").to_numpy()
    prefill, decode = t.column("prefill_tokens").to_numpy(), t.column("decode_tokens").to_numpy()
    run, busy = t.column("run").to_numpy(), t.column("busy_s").to_numpy()
    width = max(1, len(end) // MAX_POINTS)
    xs, pre, dec = [], [], []
    start = 0
    while start < len(end):
        stop = min(start + width, len(end))
        next_run = np.flatnonzero(run[start:stop] != run[start])
        if len(next_run):
            stop = start + next_run[0]
        began = end[start - 1] if start and run[start - 1] == run[start] else end[start] - busy[start]
        seconds = max(end[stop - 1] - began, 1e-9)
        xs.append(x[stop - 1])
        pre.append(prefill[start:stop].sum() / seconds)
        dec.append(decode[start:stop].sum() / seconds)
        start = stop
    return np.array(xs), np.array(pre), np.array(dec)


def batch_chart(t: pa.Table, engine: EngineConfig) -> Chart:
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    x, unit = _clock(t)
    mean, peak = t.column("num_seqs").to_numpy(), t.column("num_seqs_max").to_numpy()
    ax.fill_between(x, mean, peak, step="pre", color="tab:blue", alpha=0.2, lw=0, label="max in the row's steps")
    ax.step(x, mean, where="pre", color="tab:blue", lw=1.2, label="sequences per step")
    if peak.max() * 2 >= engine.max_num_seqs:  # a limit far above the batch would only flatten the curve
        ax.axhline(engine.max_num_seqs, color="grey", ls="--", lw=1, label="max_num_seqs")
    ax.set(xlabel=unit, ylabel="sequences", ylim=(0, None), title=f"Batch size (max_num_seqs {engine.max_num_seqs})")
    ax.legend(loc="lower right", fontsize="small")
    return Chart("batch_size", "Batch size", fig)


def kv_chart(t: pa.Table, engine: EngineConfig) -> Chart:
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    x, unit = _clock(t)
    mean, peak = t.column("kv_cache_usage").to_numpy() * 100, t.column("kv_cache_usage_max").to_numpy() * 100
    stats = kv_steadiness(t)
    if stats:
        ax.axhspan(
            stats["p10"] * 100,
            stats["p90"] * 100,
            color="tab:green",
            alpha=0.12,
            lw=0,
            label="10-90th percentile while requests waited",
        )
    ax.fill_between(x, mean, peak, step="pre", color="tab:purple", alpha=0.2, lw=0, label="max in the row's steps")
    ax.step(x, mean, where="pre", color="tab:purple", lw=1.2, label="KV blocks in use")
    ax.axhline(
        engine.kv_watermark * 100,
        color="grey",
        ls="--",
        lw=1,
        label=f"watermark {engine.kv_watermark:.0%} (no new prefills above)",
    )
    ax.set(xlabel=unit, ylabel="% of the KV pool", ylim=(0, 102), title="KV-cache usage")
    ax.legend(loc="lower right", fontsize="small")
    caption = "No step had requests waiting: the job never filled the engine."
    if stats:
        ax.set_title(
            f"KV-cache usage while requests waited: mean {stats['mean']:.0%}, p10-p90 {stats['p10']:.0%}-"
            f"{stats['p90']:.0%}, steps at >={FULL:.0%}: {stats['full']:.1%}, at <={EMPTY:.0%}: "
            f"{stats['empty']:.1%}",
            fontsize="medium",
        )
        caption = (
            f"Requests waited in {stats['share']:.0%} of the steps; the figures in the title are over those "
            "steps, where a healthy run keeps the pool steadily busy, below the watermark."
        )
    return Chart("kv_cache_usage", "KV-cache usage", fig, caption)


def kv_steadiness(t: pa.Table) -> dict | None:
    """KV usage over the steps that had requests waiting, when the engine should keep the pool busy; a run's ramp
    up and final drain are left out. Step-weighted (a timeline row sums `steps` steps)."""
    mask = pc.greater(t.column("num_waiting"), 0)
    steady = t.filter(mask) if pc.any(mask).as_py() else None
    if steady is None:
        return None
    usage, weight = steady.column("kv_cache_usage").to_numpy(), steady.column("steps").to_numpy()
    order = np.argsort(usage)
    cumulative = np.cumsum(weight[order]) / weight.sum()

    def percentile(q: float) -> float:
        return float(usage[order][np.searchsorted(cumulative, q)])

    return {
        "share": weight.sum() / pc.sum(t.column("steps")).as_py(),
        "mean": float(np.average(usage, weights=weight)),
        "p10": percentile(0.1),
        "p90": percentile(0.9),
        "full": weight[usage >= FULL].sum() / weight.sum(),
        "empty": weight[usage <= EMPTY].sum() / weight.sum(),
    }


def throughput_chart(t: pa.Table) -> Chart:
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    x, prefill, decode = _rates(t)
    ax.stackplot(
        x,
        prefill,
        decode,
        step="pre",
        labels=["prompt tokens/s", "generated tokens/s"],
        colors=["tab:orange", "tab:cyan"],
        alpha=0.8,
    )
    ax.set(xlabel=_clock(t)[1], ylabel="tokens/s (wall)", ylim=(0, None), title="Throughput")
    budget = t.column("token_budget").to_numpy()
    if budget.min() != budget.max():  # `auto` moved it: show where to
        twin = ax.twinx()
        twin.step(_clock(t)[0], budget, where="pre", color="black", lw=0.6, alpha=0.6, label="token budget (auto)")
        twin.set(ylabel="tokens per step", ylim=(0, None))
        twin.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    return Chart("throughput", "Throughput", fig)


# -- per row -------------------------------------------------------------------------------------------------------
def latency_chart(results: pa.Table) -> Chart:
    ok = results.filter(pc.is_null(results.column("error")))
    timed = ok.filter(pc.and_(pc.greater_equal(ok.column("output_tokens"), 2), pc.is_valid(ok.column("ttft_s"))))
    decode_s = pc.subtract(timed.column("total_time_s"), timed.column("ttft_s"))
    tpot = pc.multiply(pc.divide(decode_s, pc.subtract(pc.cast(timed.column("output_tokens"), pa.float64()), 1)), 1000)
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    for k, (values, label, unit) in enumerate(
        (
            (_values(ok.column("ttft_s")), "TTFT (queue + prefill)", "s"),
            (_values(tpot), "TPOT (per output token)", "ms"),
        )
    ):
        _histogram(fig.add_subplot(1, 2, k + 1), values, label, unit, percentiles=True)
    return Chart(
        "latency",
        "TTFT and TPOT",
        fig,
        "Offline rows wait in the engine's queue: TTFT counts from the moment a row's request entered the engine.",
    )


def length_chart(results: pa.Table) -> Chart:
    ok = results.filter(pc.is_null(results.column("error")))
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    for k, (column, label) in enumerate((("prompt_tokens", "prompt length"), ("output_tokens", "output length"))):
        _histogram(fig.add_subplot(1, 2, k + 1), _values(ok.column(column)), label, "tokens", whole=True)
    failed = results.num_rows - ok.num_rows
    return Chart("lengths", "Row lengths", fig, f"{ok.num_rows:,} rows; {failed:,} failed rows left out.")


def _values(column: pa.ChunkedArray) -> np.ndarray:
    return pc.drop_null(column).to_numpy().astype(float)


def _histogram(ax, values: np.ndarray, label: str, unit: str, percentiles: bool = False, whole: bool = False) -> None:
    """`whole`: counts, binned on whole numbers so that no bin holds more distinct values than its neighbours."""
    ax.set(title=label, xlabel=unit, ylabel="rows")
    if not len(values):
        ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
        return
    bins = 50
    if whole:
        width = max(1, int(np.ceil((values.max() - values.min() + 1) / 50)))
        bins = np.arange(values.min(), values.max() + width + 1, width) - 0.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.hist(values, bins=bins, color="tab:blue", alpha=0.75)
    if percentiles:
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            v = np.percentile(values, q)
            ax.axvline(v, color="black", ls=style, lw=1, label=f"p{q} {v:.3g} {unit}")
        ax.legend(fontsize="small")


# -- the page ------------------------------------------------------------------------------------------------------
def _facts(folder: Path, meta: dict, summary: dict | None, t: pa.Table, results: pa.Table | None) -> list:
    facts = [("folder", str(folder)), ("model", meta.get("job", {}).get("model", "?"))]
    if results is not None:
        failed = results.num_rows - pc.sum(pc.is_null(results.column("error"))).as_py()
        total = meta.get("rows_total")
        facts.append(
            (
                "rows",
                f"{results.num_rows:,} of {'?' if total is None else f'{total:,}'} done, "
                f"{failed:,} failed" + ("" if summary else " (not finished)"),
            )
        )
        facts.append(
            (
                "tokens",
                f"prompt {pc.sum(results.column('prompt_tokens')).as_py() or 0:,}, generated "
                f"{pc.sum(results.column('output_tokens')).as_py() or 0:,}",
            )
        )
    if t.num_rows:
        steps = pc.sum(t.column("steps")).as_py()
        tokens = pc.sum(t.column("prefill_tokens")).as_py() + pc.sum(t.column("decode_tokens")).as_py()
        busy = pc.sum(t.column("busy_s")).as_py()
        mean_batch = np.average(t.column("num_seqs").to_numpy(), weights=t.column("steps").to_numpy())
        facts += [
            (
                "engine",
                f"{steps:,} steps in {busy:,.0f} s over {t.column('run')[-1].as_py() + 1} run(s): "
                f"{tokens / busy:,.0f} tokens/s while stepping, mean batch {mean_batch:.1f}",
            ),
            ("preemptions", f"{pc.sum(t.column('preemptions')).as_py():,}"),
        ]
    if summary:
        run = summary.get("this_run", {})
        facts.append(
            (
                "last run",
                f"{run.get('wall_time_s', 0):,.0f} s, {run.get('total_tokens_per_s', 0):,.0f} "
                f"tokens/s, {run.get('output_tokens_per_s', 0):,.0f} generated tokens/s",
            )
        )
        if "token_budget" in run:
            auto = run.get("token_budget_auto")
            facts.append(
                (
                    "token budget",
                    f"{run['token_budget']}"
                    + (f" (auto; tokens/s by budget: {auto['tokens_per_s_by_budget']})" if auto else ""),
                )
            )
    return facts


def _html(
    folder: Path,
    meta: dict,
    summary: dict | None,
    t: pa.Table,
    results: pa.Table | None,
    images: list[tuple[Chart, str]],
) -> str:
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _facts(folder, meta, summary, t, results))
    figures = "".join(
        f'<figure><img alt="{esc(c.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{esc(c.caption)}</figcaption></figure>"
        for c, data in images
    )
    missing = "" if t.num_rows else f"<p>No {TIMELINE}: no run on this machine's engine has stepped yet.</p>"
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>batchjob report: {esc(str(folder))}'
        "</title><style>body{font-family:sans-serif;max-width:1040px;margin:1em auto;color:#222}"
        "th{text-align:left;padding-right:1em;vertical-align:top}img{max-width:100%}"
        "figure{margin:1.5em 0}figcaption{color:#555;font-size:small}</style></head><body>"
        f"<h1>batchjob report</h1><table>{rows}</table>{missing}{figures}</body></html>\n"
    )
