"""`metrics.prom`: a run's figures in the Prometheus text format, written at the end of every run, for node_exporter's
textfile collector on a cron host (copy or link it into the collector's directory; it is replaced atomically).

Names follow vLLM's (`vllm:kv_cache_usage_perc` and so on) under a `batchjob_` prefix. Row and token counters are
the job's totals over all its runs, read from the committed parts as `_summary.json` is; preemptions and KV usage are
this run's, from its engine steps. Every sample carries the model and the output folder as labels, so that several
jobs' files can sit side by side in one collector directory."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from batchjob.job.output.state import Committed
from batchjob.job.output.storage import write_atomic


def write_metrics(path: Path, families: list) -> None:
    """`families` (metric_families') as one Prometheus text file, replaced atomically."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    text = generate_latest(registry)
    write_atomic(path, lambda f: f.write(text))


def metric_families(
    labels: dict[str, str],
    committed: Committed,
    rows_total: int,
    *,
    exit_code: int,
    last_success: float | None,
    preemptions: int | None,
    kv_cache_usage: float | None,
) -> list:
    """The job's figures, each sample labelled with `labels`."""
    names, values = list(labels), list(labels.values())

    def family(kind, name: str, help_text: str, value: float) -> object:
        metric = kind(name, help_text, labels=names)
        metric.add_metric(values, value)
        return metric

    families = [
        family(
            CounterMetricFamily,
            "batchjob_prompt_tokens",
            "Prompt tokens of the job's committed rows.",
            committed.prompt_tokens,
        ),
        family(
            CounterMetricFamily,
            "batchjob_generation_tokens",
            "Generated tokens of the job's committed rows.",
            committed.output_tokens,
        ),
        family(
            CounterMetricFamily,
            "batchjob_rows_done",
            "Rows of the job with a committed result, failed ones included.",
            committed.rows,
        ),
        family(
            CounterMetricFamily, "batchjob_rows_failed", "Rows of the job committed with an error.", committed.failed
        ),
        family(GaugeMetricFamily, "batchjob_rows", "Rows in the job's input.", rows_total),
        family(
            GaugeMetricFamily,
            "batchjob_last_run_exit_code",
            "Exit code of the last run (README: 0 done, 3 row errors, 130/143 interrupted).",
            exit_code,
        ),
        # 0 until the job's first success, so that an alert on time() minus this fires for a job that never finished.
        family(
            GaugeMetricFamily,
            "batchjob_last_success_timestamp_seconds",
            "Unix time the job last finished every row (its _SUCCESS file), 0 if it has not.",
            last_success or 0,
        ),
    ]
    if preemptions is not None:  # None when the engines ran elsewhere (executor: ray)
        families.append(
            family(
                CounterMetricFamily,
                "batchjob_num_preemptions",
                "Sequences preempted (KV cache full, recomputed later) in the last run.",
                preemptions,
            )
        )
    if kv_cache_usage is not None:
        families.append(
            family(
                GaugeMetricFamily,
                "batchjob_kv_cache_usage_perc",
                "KV-cache usage, 1 = full, averaged over the last run's engine time (at its end it is 0, all freed).",
                kv_cache_usage,
            )
        )
    return families


class _Fixed:
    """A collector of values known already: the run is over, nothing is scraped live."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)
