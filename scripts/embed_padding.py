"""What one long row costs an embedding job: 1,500 one-word rows alone, and with one 400-word row among them.

    python scripts/embed_padding.py /tmp/embed-padding [--rounds 2]
    python scripts/embed_padding.py /tmp/embed-padding --uniform [--rounds 3]

Each job is one `batchjob run` of the built-in all-minilm-l6-v2, in interleaved rounds; its wall time, CPU time
(user + system) and peak RSS come from wait4. Prints each round and the medians, with the mixed job's ratios to the
short one's and the forward passes and tokens its _summary.json reports.

With --uniform, what the padding bound costs where there is little padding to save: `batchjob bench --task embed`'s
1,000 texts of 40 to 1,200 characters, embedded in one process in interleaved rounds with the passes cut at
MAX_PADDING and without the bound (the token budget alone)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
SHORT_ROWS, LONG_WORDS = 1500, 400


def generate(folder: Path) -> None:
    words = " ".join(pq.read_table(REPO / "sample_data" / "documents.parquet").column("text").to_pylist()).split()
    short = [{"id": f"w{i}", "text": words[i]} for i in range(SHORT_ROWS)]
    long = {"id": "long", "text": " ".join(words[:LONG_WORDS])}
    for name, rows in [("short", short), ("mixed", [*short[:750], long, *short[750:]])]:
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
        job = {"task": "embed", "model": "all-minilm-l6-v2", "input": {"path": f"{name}.parquet"}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({**job, "output": {"path": f"out-{name}"}}))


def measure(folder: Path, name: str) -> dict:
    shutil.rmtree(folder / f"out-{name}", ignore_errors=True)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "batchjob.cli", "run", f"{name}.yaml"], cwd=folder)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"batchjob run {name}.yaml failed: {status}")
    summary = json.loads((folder / f"out-{name}" / "_summary.json").read_text())["this_run"]
    return {
        "wall_s": time.monotonic() - started,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        **{k: summary.get(k) for k in ("forward_passes", "embedded_tokens", "padded_tokens")},
    }


def uniform(rounds: int) -> None:
    import batchjob.engine.embedder as embedder_module
    from batchjob.bench.workloads import embed_texts
    from batchjob.engine.embedder import Embedder

    bounded = embedder_module.embedding_batches
    cuts = {"bounded": bounded, "unbounded": lambda lengths, budget: bounded(lengths, budget, float("inf"))}
    embedder, texts = Embedder("all-minilm-l6-v2"), embed_texts(1000)
    embedder.embed(texts[:200], use_tqdm=False)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cuts}
    for r in range(rounds):
        for name in list(cuts) if r % 2 == 0 else list(cuts)[::-1]:
            embedder_module.embedding_batches = cuts[name]
            before, wall, cpu = embedder.stats, time.perf_counter(), time.process_time()
            embedder.embed(texts, use_tqdm=False)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            after = embedder.stats
            counts = {k: getattr(after, k) - getattr(before, k) for k in vars(after)}
            print(f"round {r + 1} {name}: wall {times[name][-1][0]:.2f} s, CPU {times[name][-1][1]:.2f} s, {counts}")
    medians = {name: [statistics.median(t[k] for t in ts) for k in (0, 1)] for name, ts in times.items()}
    ratio = [b / u for b, u in zip(medians["bounded"], medians["unbounded"])]
    print(f"bounded / unbounded: wall {ratio[0]:.3f}x, CPU {ratio[1]:.3f}x (medians of {rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--uniform", action="store_true", help="the bound's cost on the bench's embedding texts")
    args = parser.parse_args()
    if args.uniform:
        uniform(args.rounds)
        return
    args.folder.mkdir(parents=True, exist_ok=True)
    generate(args.folder)
    runs: dict[str, list[dict]] = {"short": [], "mixed": []}
    for r in range(args.rounds):
        for name in ("short", "mixed") if r % 2 == 0 else ("mixed", "short"):
            runs[name].append(measure(args.folder, name))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    medians = {
        name: {k: statistics.median(m[k] for m in ms) for k in ("wall_s", "cpu_s", "peak_rss_mib")}
        for name, ms in runs.items()
    }
    for name, m in medians.items():
        print(
            f"{name}: wall {m['wall_s']:.1f} s, CPU {m['cpu_s']:.1f} s, peak RSS {m['peak_rss_mib']:.0f} MiB, "
            f"{ {k: runs[name][-1][k] for k in ('forward_passes', 'embedded_tokens', 'padded_tokens')} }"
        )
    ratios = {k: medians["mixed"][k] / medians["short"][k] for k in medians["short"]}
    print("mixed / short: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
