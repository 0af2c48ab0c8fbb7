"""Progress of a run: a rich display on a terminal, periodic plain or JSON log lines elsewhere (cron, Airflow)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar
from rich.text import Text

from batchjob.engine.outputs import StepMetrics

# What writing progress raises once its reader went away (`batchjob run ... | head -1`: BrokenPipeError, as Python
# ignores SIGPIPE), its terminal hung up (EIO) or its stream was closed (ValueError).
LOST_OUTPUT = (OSError, ValueError)


@dataclass
class Stats:
    total: int = 0
    done_before: int = 0  # rows committed by earlier runs
    rows: int = 0  # rows finished in this run
    output_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    # From the engine's steps: live rates while long rows are still running (rows report their tokens at the end).
    step_tokens: int = 0
    step_decode_tokens: int = 0
    step: StepMetrics | None = None
    started: float = field(default_factory=time.monotonic)
    task: str = "generate"  # an embedding job (embed) has input tokens only, and no engine steps; scoring no output
    lora: dict | None = None  # with engine.lora: this run's rows by adapter, as _summary.json's this_run.lora

    @property
    def done(self) -> int:
        return self.done_before + self.rows

    def snapshot(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.rows / elapsed
        remaining = self.total - self.done
        step = self.step
        live = step is not None  # a Ray driver sees no steps: rates from finished rows then
        output = self.step_decode_tokens if live else self.output_tokens
        total = self.step_tokens if live else self.output_tokens + self.prompt_tokens
        return {
            "task": self.task,
            "rows_done": self.done,
            "rows_total": self.total,
            "output_tokens_per_s": round(output / elapsed, 1),
            "total_tokens_per_s": round(total / elapsed, 1),
            "batch_size": step.num_seqs if step else 0,
            "kv_usage_pct": round(100 * step.kv_cache_usage, 1) if step else 0.0,
            "preemptions": self.preemptions,
            "prefix_hit_pct": round(100 * step.prefix_cache_hit_rate, 1) if step else 0.0,
            "eta_s": round(remaining / rate) if rate > 0 else None,
        } | ({"lora": self.lora} if self.lora else {})


def _line(s: dict) -> str:
    eta = "?" if s["eta_s"] is None else _duration(s["eta_s"])
    pct = 100 * s["rows_done"] / s["rows_total"] if s["rows_total"] else 100.0
    return f"rows {s['rows_done']}/{s['rows_total']} ({pct:.1f}%) | {_rates(s)}{_adapters(s)} | eta {eta}"


def _adapters(s: dict, shown: int = 4) -> str:
    """The rows of the base model and of the adapters with most rows: " | lora base 8, alpha 4 (+3 more)"."""
    if "lora" not in s:
        return ""
    counts = [("base", s["lora"]["base_model"]["rows"])] + [(n, c["rows"]) for n, c in s["lora"]["adapters"].items()]
    counts.sort(key=lambda item: -item[1])
    more = f" (+{len(counts) - shown} more)" if len(counts) > shown else ""
    return " | lora " + ", ".join(f"{name} {rows}" for name, rows in counts[:shown]) + more


def _rates(s: dict) -> str:
    if s["task"] == "embed":
        return f"input {s['total_tokens_per_s']:.0f} tok/s"
    if s["task"] == "score":  # prefill only: no output tokens
        return (
            f"prefill {s['total_tokens_per_s']:.0f} tok/s | batch {s['batch_size']} | kv {s['kv_usage_pct']:.0f}% | "
            f"preemptions {s['preemptions']} | prefix hits {s['prefix_hit_pct']:.0f}%"
        )
    return (
        f"out {s['output_tokens_per_s']:.1f} tok/s | total {s['total_tokens_per_s']:.1f} tok/s | "
        f"batch {s['batch_size']} | kv {s['kv_usage_pct']:.0f}% | preemptions {s['preemptions']} | "
        f"prefix hits {s['prefix_hit_pct']:.0f}%"
    )


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress(ABC):
    """What a run reports; subclasses show it. Showing it never stops the job: once the output fails, the rest is
    dropped and the run goes on (its exit code is the job's)."""

    def __init__(self):
        self.stats = Stats()
        self.lost = False  # the output failed once: nothing more is shown

    @contextlib.contextmanager
    def showing(self, stream: TextIO):
        """Around each write to `stream`: a failure silences this progress and points the stream's descriptor at
        the null device, so that no later write to it (click's, the interpreter's flush at exit) fails either."""
        try:
            yield
        except LOST_OUTPUT:
            self.lost = True
            with contextlib.suppress(*LOST_OUTPUT, AttributeError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, stream.fileno())
                os.close(null)

    def start(self, total: int, done_before: int, task: str = "generate") -> None:
        self.stats = Stats(total=total, done_before=done_before, task=task)

    def rows(self, n: int, *, output_tokens: int = 0, prompt_tokens: int = 0) -> None:
        self.stats.rows += n
        self.stats.output_tokens += output_tokens
        self.stats.prompt_tokens += prompt_tokens
        self.refresh()

    def lora(self, counts: dict | None) -> None:
        """This run's rows by LoRA adapter so far (LoraCounts.summary()): shown from the next refresh."""
        self.stats.lora = counts

    def step(self, metrics: StepMetrics) -> None:
        self.stats.step = metrics
        self.stats.preemptions += metrics.num_preemptions
        self.stats.step_tokens += metrics.num_prefill_tokens + metrics.num_decode_tokens
        self.stats.step_decode_tokens += metrics.num_decode_tokens
        self.refresh()

    @abstractmethod
    def refresh(self) -> None:
        """Show the stats, if it is time to."""

    @abstractmethod
    def message(self, text: str) -> None:
        """Say something now (resuming, stopping, done)."""

    @abstractmethod
    def close(self) -> None:
        """Show the final stats and let go of the terminal."""


class LogProgress(Progress):
    """A line every `interval` seconds: plain text, or one JSON object a line for log collectors."""

    def __init__(self, stream: TextIO = sys.stdout, *, interval: float = 10.0, json_lines: bool = False):
        super().__init__()
        self.stream, self.interval, self.json_lines = stream, interval, json_lines
        self.last = 0.0

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            snapshot = self.stats.snapshot()
            self._emit({"event": "progress", **snapshot} if self.json_lines else _line(snapshot))

    def message(self, text: str) -> None:
        self._emit({"event": "message", "message": text} if self.json_lines else text)

    def close(self) -> None:
        if self.stats.total:
            self.refresh(force=True)

    def _emit(self, item: str | dict) -> None:
        if self.lost:
            return
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        line = json.dumps({"time": stamp, **item}) if isinstance(item, dict) else f"{stamp} {item}"
        with self.showing(self.stream):
            print(line, file=self.stream, flush=True)


class RichProgress(Progress):
    """A bar with rows done and the ETA, and a line of engine statistics under it."""

    def __init__(self, console: Console | None = None):
        super().__init__()
        self.console = console or Console()
        self.bar = RichBar(
            TextColumn("[bold]rows"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            console=self.console,
        )
        self.stats_line = Text()
        self.live = Live(Group(self.bar, self.stats_line), console=self.console, refresh_per_second=4)
        self.task = None

    def start(self, total: int, done_before: int, task: str = "generate") -> None:
        super().start(total, done_before, task)
        self.task = self.bar.add_task("rows", total=total, completed=done_before, eta="?")
        with self.showing(self.console.file):
            self.live.start()

    def refresh(self) -> None:
        if self.task is not None and not self.lost:
            s = self.stats.snapshot()
            self.bar.update(
                self.task, completed=s["rows_done"], eta="?" if s["eta_s"] is None else _duration(s["eta_s"])
            )
            self.stats_line.plain = _rates(s) + _adapters(s)

    def message(self, text: str) -> None:
        if not self.lost:
            with self.showing(self.console.file):
                self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        if self.task is not None:
            self.refresh()
            with self.showing(self.console.file):
                self.live.stop()
