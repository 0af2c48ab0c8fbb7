"""The results cache across runs (cache: {path: DIR}): a rerun into another folder computes only the rows whose key
changed; unseeded sampling is never cached; a damaged entry is a miss and its row is computed right; eviction keeps
the size cap, least recently used first; two jobs share a cache at once; the cache on S3 (moto's server); OpenAI
Batch lines keyed as other rows; `plan` and `status` count the hits. The fake engine counts what it computes; the
real default model and the real embedder run the issue's test: one row edited in 200, one row computed."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import time
from pathlib import Path

import fsspec.implementations.local
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

import batchjob.job.cache.results_cache
from batchjob.job.cache.results_cache import MAX_FAILURES, ResultsCache
from batchjob.job.exit_codes import EXIT_OK
from batchjob.job.output.state import OutputDir
from batchjob.job.plan import plan_job
from batchjob.job.run.runner import run_job
from batchjob.job.spec import CacheSpec, JobFileError, load_job
from tests.fakes import FakeEngine
from tests.helpers import Messages, deny_by_mode, documents, make_job, write_jsonl, write_parquet
from tests.job.test_e2e import cli
from tests.job.test_s3 import BUCKET, moto_server, s3  # noqa: F401 (the moto server fixture)

# What a row's result is, less what differs between any two runs (times) or tells how it was got (cached_tokens).
RESULT = ("id", "output", "finish_reason", "outputs", "finish_reasons", "output_token_counts", "logprobs")
RESULT += ("prompt_tokens", "output_tokens", "truncated", "error", "row_index", "title")


def rows_of(out: Path) -> dict[str, dict]:
    table = pq.read_table(out / "data")
    return {r["id"]: {k: r[k] for k in RESULT if k in r} for r in table.to_pylist()}


class Counting:
    """An engine factory that keeps its engines, to count the prompts they computed."""

    def __init__(self):
        self.engines: list[FakeEngine] = []

    def __call__(self, job) -> FakeEngine:
        self.engines.append(FakeEngine(job.model))
        return self.engines[-1]

    @property
    def computed(self) -> int:
        return len(self.engines[-1].prompts_seen)


def run(job, factory=None) -> Counting:
    factory = factory or Counting()
    assert run_job(job, Messages(), engine_factory=factory) == EXIT_OK
    return factory


def summary_cache(out: Path) -> dict:
    return json.loads((out / "_summary.json").read_text())["cache"]


def cached_job(data: Path, out: Path, folder: Path | str, **sections):
    return make_job(data, out, cache={"path": str(folder), **sections.pop("cache", {})}, **sections)


def test_a_rerun_computes_only_the_edited_row_and_gives_the_from_scratch_output(tmp_path):
    docs = documents(40)
    data = write_parquet(tmp_path / "a.parquet", docs)
    first = run(cached_job(data, tmp_path / "out1", tmp_path / "cache", input={"passthrough": ["title"]}))
    assert first.computed == 40 and summary_cache(tmp_path / "out1") == {"hits": 0, "misses": 40}
    docs[7]["text"] = "an edited text"
    edited = write_parquet(tmp_path / "b.parquet", docs)
    again = run(cached_job(edited, tmp_path / "out2", tmp_path / "cache", input={"passthrough": ["title"]}))
    assert [bytes(p).decode().count("an edited text") for p in again.engines[0].prompts_seen] == [1]
    assert summary_cache(tmp_path / "out2") == {"hits": 39, "misses": 1}
    status = OutputDir(tmp_path / "out2").status()
    assert (status["cache_hits"], status["cache_misses"]) == (39, 1)
    run(make_job(edited, tmp_path / "scratch", input={"passthrough": ["title"]}))
    assert rows_of(tmp_path / "out2") == rows_of(tmp_path / "scratch")
    hit = pq.read_table(tmp_path / "out2" / "data").to_pylist()[0]
    assert hit["cached_tokens"] == hit["prompt_tokens"] and hit["total_time_s"] is None  # nothing computed, nor timed


def test_status_of_a_job_in_input_order_counts_its_hits(tmp_path):
    """The sorted files of `order: input` replace the parts and their counts: status takes the summary's."""
    docs = documents(20)
    data = write_parquet(tmp_path / "a.parquet", docs)
    output = {"order": "input", "checkpoint_rows": 3}
    run(cached_job(data, tmp_path / "out1", tmp_path / "cache", output=output))
    docs[2]["text"] = "changed"
    run(cached_job(write_parquet(tmp_path / "b.parquet", docs), tmp_path / "out2", tmp_path / "cache", output=output))
    status = OutputDir(tmp_path / "out2").status()
    assert status["state"] == "done" and (status["cache_hits"], status["cache_misses"]) == (19, 1)
    assert all(b"batchjob.cache" not in (pq.read_schema(p).metadata or {}) for p in (tmp_path / "out2/data").iterdir())


def test_unseeded_sampling_is_never_cached_and_seeded_sampling_is(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", documents(10))
    for name, sampling, computed_again in [("unseeded", {"temperature": 0.8}, 10), ("seeded", {"seed": 3}, 0)]:
        sampling = {"max_tokens": 64, "temperature": 0.8, **sampling}
        for k in (1, 2):
            counted = run(cached_job(data, tmp_path / f"{name}{k}", tmp_path / name, sampling=sampling))
        assert counted.computed == computed_again, name
    assert not list((tmp_path / "unseeded").rglob("*.json"))  # not even written


def test_a_row_seed_or_other_sampling_is_another_key(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": "x y", "temperature": 0.5, "seed": 1}])
    job = dict(input={"path": str(data)}, sampling={"max_tokens": 64})
    assert run(cached_job(data, tmp_path / "o1", tmp_path / "c", **job)).computed == 1
    assert run(cached_job(data, tmp_path / "o2", tmp_path / "c", **job)).computed == 0
    assert run(cached_job(data, tmp_path / "o3", tmp_path / "c", sampling={"max_tokens": 63})).computed == 1


def test_each_row_s_key_carries_its_own_sampling_in_one_run(tmp_path):
    """OpenAI Batch lines of one text with their own max_tokens or seed: one entry each, and a rerun gives each line
    its own result (a key of the job's sampling would give all four one entry, and three lines another's result)."""
    body = {"messages": [{"role": "user", "content": "one two three four five six"}]}
    own = [{"max_tokens": 5}, {"max_tokens": 9}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.8, "seed": 2}]
    lines = [
        {"custom_id": f"l{k}", "method": "POST", "url": "/v1/chat/completions", "body": {**body, **sampling}}
        for k, sampling in enumerate(own)
    ]
    batch = write_jsonl(tmp_path / "b.jsonl", lines)
    openai = {"input": {"format": "openai-batch"}}
    assert run(cached_job(batch, tmp_path / "o1", tmp_path / "c", **openai)).computed == 4
    assert len(list((tmp_path / "c").rglob("*.json"))) == 4
    assert run(cached_job(batch, tmp_path / "o2", tmp_path / "c", **openai)).computed == 0
    first = rows_of(tmp_path / "o1")
    assert rows_of(tmp_path / "o2") == first and first["l0"]["output"] != first["l1"]["output"]


def test_a_damaged_entry_is_a_miss_and_its_row_is_computed_right(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", documents(12))
    run(cached_job(data, tmp_path / "out1", tmp_path / "cache"))
    entries = sorted((tmp_path / "cache").rglob("*.json"))
    assert len(entries) == 12
    damage(entries)
    again = run(cached_job(data, tmp_path / "out2", tmp_path / "cache"))
    assert again.computed == 5 and summary_cache(tmp_path / "out2") == {"hits": 7, "misses": 5}
    assert rows_of(tmp_path / "out2") == rows_of(tmp_path / "out1")
    # the computed rows were stored again, whole
    assert run(cached_job(data, tmp_path / "out3", tmp_path / "cache")).computed == 0


def damage(entries: list[Path]) -> None:
    """Five entries made unusable, each in its own way: a run's lookup finds each a miss."""
    whole = [json.loads(p.read_text()) for p in entries[:5]]
    entries[0].write_bytes(entries[0].read_bytes()[:40])  # truncated
    entries[1].write_text("not json")
    entries[2].write_text(json.dumps({**whole[2], "key": whole[3]["key"]}))  # another key inside
    forged = {**whole[3]["result"], "text": "a wrong answer"}
    entries[3].write_text(json.dumps({**whole[3], "result": forged}))  # the checksum no longer fits
    # the right key and checksum of something that is not a result
    entries[4].write_text(json.dumps({**whole[4], "sha256": hashlib.sha256(b"[1,2]").hexdigest(), "result": [1, 2]}))


def test_entries_of_the_wrong_shape_are_misses_said_once_and_stored_over(tmp_path):
    """Seen: an entry rewritten whole (a valid checksum) with a finish_reason that is a list failed every run at exit
    70 with an Arrow traceback naming no entry, until someone deleted it. A shared cache is untrusted input: each
    such entry is a miss, the first said with its key, and its row's result stored over it (test_cache_entries.py
    tries each field of each kind of entry)."""
    data = write_parquet(tmp_path / "a.parquet", documents(8))
    run(cached_job(data, tmp_path / "out1", tmp_path / "cache"))
    store = ResultsCache(CacheSpec(path=str(tmp_path / "cache")))
    entries = [json.loads(p.read_text()) for p in sorted((tmp_path / "cache").rglob("*.json"))]
    forged = [
        lambda r: r["samples"][0].update(finish_reason=["stop"]),
        lambda r: r["samples"][0].update(text=12),
        lambda r: r["samples"][0].update(token_ids=["a"]),
        lambda r: r["samples"].append(r["samples"][0]),  # two samples for a row of n 1
        lambda r: r.update(samples=None),
    ]
    for entry, forge in zip(entries, forged):
        forge(entry["result"])
        store.put(entry["key"], entry["result"])
    messages, factory = Messages(), Counting()
    assert run_job(cached_job(data, tmp_path / "out2", tmp_path / "cache"), messages, engine_factory=factory) == 0
    assert factory.computed == 5 and summary_cache(tmp_path / "out2") == {"hits": 3, "misses": 5}
    assert rows_of(tmp_path / "out2") == rows_of(tmp_path / "out1")
    said = [m for m in messages.messages if m.startswith("results cache: ")]
    assert len(said) == 1 and any(
        f"the entry {e['key']} in {tmp_path / 'cache'} is no result" in said[0] for e in entries
    )
    assert run(cached_job(data, tmp_path / "out3", tmp_path / "cache")).computed == 0


def test_plan_counts_only_the_entries_a_run_would_take(tmp_path):
    """Seen: `plan` counted a damaged entry as a hit (it only checked that the file was there)."""
    data = write_parquet(tmp_path / "a.parquet", documents(12))
    run(cached_job(data, tmp_path / "out1", tmp_path / "cache"))
    entries = sorted((tmp_path / "cache").rglob("*.json"))
    damage(entries)
    for entry in entries:
        os.utime(entry, (0, 0))  # used long ago: a plan, which only looks, leaves that as it is
    job = cached_job(data, tmp_path / "out2", tmp_path / "cache")
    assert plan_job(job, calibrate=False, engine_factory=Counting())["rows_from_results_cache"] == 7
    assert all(entry.stat().st_mtime == 0 for entry in entries)
    assert run(job).computed == 5 and summary_cache(tmp_path / "out2") == {"hits": 7, "misses": 5}


def test_eviction_keeps_the_cap_and_drops_the_least_recently_used(tmp_path):
    cache = ResultsCache(CacheSpec(path=str(tmp_path / "c"), max_size=10_000))
    keys = [f"{i:064x}" for i in range(30)]  # 20 fit
    for k, key in enumerate(keys[:20]):
        cache.put(key, {"text": "x" * 300})
        old = time.time() - 10 * 86400 + k  # used long ago, in order
        os.utime(tmp_path / "c" / key[:2] / f"{key}.json", (old, old))
    assert cache.get(keys[0]) is not None  # a hit: now the most recently used
    for key in keys[20:]:
        cache.put(key, {"text": "x" * 300})
    assert cache.size() <= 10_000
    kept = {key for key in keys if cache.get(key) is not None}
    assert keys[0] in kept and keys[-1] in kept
    assert keys[1] not in kept and keys[2] not in kept  # the least recently used went first
    assert len(kept) == len(list((tmp_path / "c").rglob("*.json")))


def test_a_run_keeps_its_cache_within_max_size(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", documents(60))
    run(cached_job(data, tmp_path / "out", tmp_path / "c", cache={"max_size": "4kB"}))
    sizes = [p.stat().st_size for p in (tmp_path / "c").rglob("*.json")]
    assert 0 < len(sizes) < 60 and sum(sizes) <= 4000


def test_eviction_deletes_only_entries_never_other_files_in_the_folder(tmp_path):
    """A cache folder shared with a user's files, or that is also the output folder: eviction empties the cache of
    entries and leaves every other file, however old and whatever its name."""
    data = write_parquet(tmp_path / "a.parquet", documents(10))
    folder = tmp_path / "shared"
    theirs = [folder / "notes.json", folder / "ab" / "ab.json", folder / "sub" / "ab" / f"{'ab' * 32}.json"]
    theirs.append(folder / "sub" / f".batchjob-{'ab' * 32}.json.0123abcd.tmp")
    killed = folder / "ab" / f".batchjob-{'ab' * 32}.json.0123abcd.tmp"  # a killed writer's, a day old: batchjob's
    for path in [*theirs, killed]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x" * 5000)
        os.utime(path, (0, 0))  # used longest ago of all
    run(cached_job(data, folder, folder))  # the output folder is the cache folder too
    ResultsCache(CacheSpec(path=str(folder), max_size=1)).evict()
    assert [p for p in folder.glob("??/*.json") if len(p.stem) == 64] == []  # every entry went
    assert all(path.exists() for path in theirs) and not killed.exists()
    assert OutputDir(folder).status()["state"] == "done"  # _summary.json, _job.json and the parts stayed


def test_a_cache_that_cannot_be_written_costs_only_its_use(tmp_path, monkeypatch):
    """A cache path that is a file, or a folder in an entry's place: the run gives every row right and says once
    that it stores nothing more. A read-only cache (marking a hit used fails) still gives its hits."""
    data = write_parquet(tmp_path / "a.parquet", documents(6))
    run(make_job(data, tmp_path / "scratch"))
    (tmp_path / "file").write_text("not a folder")
    messages = Messages()
    assert run_job(cached_job(data, tmp_path / "o1", tmp_path / "file"), messages, engine_factory=Counting()) == 0
    assert rows_of(tmp_path / "o1") == rows_of(tmp_path / "scratch")
    assert len([m for m in messages.messages if m.startswith("results cache: cannot write in")]) == 1
    run(cached_job(data, tmp_path / "o2", tmp_path / "c"))
    entries = sorted((tmp_path / "c").rglob("*.json"))
    entries[0].unlink()
    entries[0].mkdir()
    assert run(cached_job(data, tmp_path / "o3", tmp_path / "c")).computed == 1
    assert rows_of(tmp_path / "o3") == rows_of(tmp_path / "scratch")
    for entry in entries[1:]:
        os.utime(entry, (0, 0))  # last used long ago: a hit marks it

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    assert run(cached_job(data, tmp_path / "o4", tmp_path / "c")).computed == 1
    assert rows_of(tmp_path / "o4") == rows_of(tmp_path / "scratch")


def test_a_write_that_fails_once_costs_only_its_entry(tmp_path, monkeypatch):
    """Seen: one failed write (a store's hiccup) made the run store nothing more. Now it is said once and the next
    entries are stored; only MAX_FAILURES failures in a row stop the writing, said once more."""
    data = write_parquet(tmp_path / "a.parquet", documents(6))
    write = batchjob.job.cache.results_cache.write_atomic
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        write(*args, **kwargs)

    monkeypatch.setattr(batchjob.job.cache.results_cache, "write_atomic", fails_once)
    messages = Messages()
    assert run_job(cached_job(data, tmp_path / "o1", tmp_path / "c"), messages, engine_factory=Counting()) == 0
    assert len(list((tmp_path / "c").rglob("*.json"))) == 5
    warned = [m.split(" (")[0] for m in messages.messages if m.startswith("results cache: ")]
    assert warned == [f"results cache: a write in {tmp_path / 'c'} failed"]
    failing = [True]

    def full(*args, **kwargs):  # a disk that fills up, is freed once, then fills up for good
        calls.append(args[0])
        if failing[0]:
            raise OSError(28, "No space left on device")
        write(*args, **kwargs)

    monkeypatch.setattr(batchjob.job.cache.results_cache, "write_atomic", full)
    calls.clear()
    cache, n = ResultsCache(CacheSpec(path=str(tmp_path / "full")), messages.message), MAX_FAILURES
    keys = iter(f"{i:064x}" for i in range(100))
    for _ in range(n - 1):
        cache.put(next(keys), {"text": "x"})
    failing[0] = False
    cache.put(next(keys), {"text": "x"})  # stored: the failures in a row start again from none
    failing[0] = True
    for _ in range(n - 1):
        cache.put(next(keys), {"text": "x"})
    assert not cache.unwritable and len(calls) == 2 * n - 1
    for _ in range(10):  # the n-th failure in a row, then no more tries
        cache.put(next(keys), {"text": "x"})
    assert cache.unwritable and len(calls) == 2 * n
    assert messages.messages[-1].startswith(f"results cache: cannot write in {tmp_path / 'full'}")


def test_a_cache_that_cannot_be_listed_is_written_and_the_run_ends_well(tmp_path, monkeypatch):
    """A drop folder (write, no read: `chmod 733`) or a bucket without list permission: eviction cannot see the
    entries; the run stores them, gives every row, and says once that it evicts nothing."""
    data = write_parquet(tmp_path / "a.parquet", documents(6))

    def no_list(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "find", no_list)
    messages = Messages()
    job = cached_job(data, tmp_path / "o1", tmp_path / "c", cache={"max_size": 1000})
    assert run_job(job, messages, engine_factory=Counting()) == EXIT_OK
    assert summary_cache(tmp_path / "o1") == {"hits": 0, "misses": 6}
    assert len([m for m in messages.messages if m.startswith("results cache: cannot list")]) == 1


def test_a_cache_on_a_store_that_cannot_be_reached_costs_only_its_use(tmp_path):
    """An endpoint that refuses connections (botocore's errors are no OSError): every row computed and right, the
    store given up after its first failure, not tried for each row nor listed at the end, and said once; `plan`
    counts no hit."""
    data = write_parquet(tmp_path / "a.parquet", documents(3))
    config = {"connect_timeout": 1, "retries": {"max_attempts": 1}}
    unreachable = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "config_kwargs": config}
    messages = Messages()
    job = cached_job(data, tmp_path / "o1", "s3://bucket/cache", cache={"storage_options": unreachable})
    assert run_job(job, messages, engine_factory=Counting()) == EXIT_OK
    run(make_job(data, tmp_path / "scratch"))
    assert rows_of(tmp_path / "o1") == rows_of(tmp_path / "scratch")
    warned = [m.split(" (")[0] for m in messages.messages if m.startswith("results cache: ")]
    assert warned == ["results cache: cannot reach s3://bucket/cache"]
    assert plan_job(job, calibrate=False, engine_factory=Counting())["rows_from_results_cache"] == 0


def run_unprivileged(data: str, out: str, cache: str) -> tuple[int, int, list[str], int]:
    """A cached run in a process that the cache folder's mode denies (root less its DAC capabilities): its exit code,
    the rows it computed, its messages and the entries it tried to read."""
    deny_by_mode()
    read_bytes, tried = Path.read_bytes, []

    def counted(path: Path) -> bytes:
        tried.extend([path] if str(path).startswith(cache) else [])
        return read_bytes(path)

    Path.read_bytes = counted  # this process is the test's own, and ends with the run
    messages, factory = Messages(), Counting()
    code = run_job(cached_job(Path(data), Path(out), cache), messages, engine_factory=factory)
    return code, factory.computed, messages.messages, len(tried)


def test_a_cache_folder_that_cannot_be_read_or_written_costs_only_its_use(tmp_path):
    """Seen: a cache folder the run may not enter (chmod 000) was read for every row, each failure unsaid. Reads now
    fail as writes do: each is a miss and its row is computed right, never an error; the first failure is said, and
    MAX_FAILURES in a row stop the reads (and the writes), each said once."""
    rows = 3 * MAX_FAILURES
    data = write_parquet(tmp_path / "a.parquet", documents(rows))
    run(make_job(data, tmp_path / "scratch"))
    cache = tmp_path / "c"
    assert run(cached_job(data, tmp_path / "o1", cache)).computed == rows
    cache.chmod(0o000)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            code, computed, messages, tried = pool.apply(
                run_unprivileged, (str(data), str(tmp_path / "o2"), str(cache))
            )
    finally:
        cache.chmod(0o755)
    assert code == EXIT_OK and computed == rows and tried == MAX_FAILURES
    assert rows_of(tmp_path / "o2") == rows_of(tmp_path / "scratch")
    warned = [m.split(" (")[0] for m in messages if m.startswith("results cache: ")]
    assert sorted(warned) == [  # reads and writes interleave
        f"results cache: a read in {cache} failed",
        f"results cache: a write in {cache} failed",
        f"results cache: cannot read in {cache}",
        f"results cache: cannot write in {cache}",
    ]
    assert run(cached_job(data, tmp_path / "o3", cache)).computed == 0  # readable again: every entry is a hit


def test_a_cache_on_s3_whose_server_is_gone(tmp_path):
    """A cache on moto's server, stopped after a first run filled it: the next run computes every row right and
    gives the store up at its first failure, said once (no listing at the end). A write that meets the gone store
    first gives it up at once too, for reads as well."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    url = "s3://batchjob-gone/cache"
    spec = CacheSpec(path=url, storage_options=options)
    try:
        ResultsCache(spec).fs.mkdir("batchjob-gone")
        data = write_parquet(tmp_path / "a.parquet", documents(4))
        assert run(cached_job(data, tmp_path / "o1", url, cache={"storage_options": options})).computed == 4
    finally:
        server.stop()
    messages = Messages()
    factory = Counting()
    job = cached_job(data, tmp_path / "o2", url, cache={"storage_options": options})
    assert run_job(job, messages, engine_factory=factory) == EXIT_OK
    assert factory.computed == 4 and rows_of(tmp_path / "o2") == rows_of(tmp_path / "o1")
    warned = [m.split(" (")[0] for m in messages.messages if m.startswith("results cache: ")]
    assert warned == [f"results cache: cannot reach {url}"]
    messages = Messages()
    cache = ResultsCache(spec, messages.message)
    cache.put("ab" * 32, {"text": "x"})
    assert cache.unwritable and cache.reads.stopped
    assert cache.get("ab" * 32) is None
    assert [m.split(" (")[0] for m in messages.messages] == [f"results cache: cannot reach {url}"]


def test_an_entry_evicted_by_another_job_while_read_is_still_a_hit(tmp_path, monkeypatch):
    """Read whole, then deleted by another job's eviction before it is marked used: the hit stands, and the run
    goes on storing."""
    cache = ResultsCache(CacheSpec(path=str(tmp_path / "c")))
    key, other = "ab" * 32, "cd" * 32
    cache.put(key, {"text": "stored"})
    entry = tmp_path / "c" / key[:2] / f"{key}.json"
    os.utime(entry, (0, 0))  # used long ago: a hit marks it
    real = os.utime

    def evicted_first(path, *args, **kwargs):
        Path(path).unlink()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", evicted_first)
    assert cache.get(key) == {"text": "stored"}
    cache.put(other, {"text": "more"})
    assert cache.get(other) == {"text": "more"}


def test_the_cache_s_entries_are_never_input_and_its_folder_may_hold_the_input(tmp_path):
    """A glob over a folder that holds the cache, or is it, reads the input files only, run after run; an input file
    named in the cache folder is read."""
    runs = [("in1", "*", "cache")] * 2 + [("in2", "*", ".")] * 2 + [("in2", "a.parquet", ".")]
    for k, (folder, pattern, cache) in enumerate(runs):
        data = tmp_path / folder
        data.mkdir(exist_ok=True)
        write_parquet(data / "a.parquet", documents(5))
        job = cached_job(data / pattern, tmp_path / f"o{k}", data / cache, input={"format": "parquet"})
        assert run(job).computed == 5 * (k in (0, 2))


def test_hosts_with_other_cpu_instruction_sets_do_not_share_entries(tmp_path, monkeypatch):
    """An AVX2 host's results differ from an AVX-512 host's in their last bits (its logprobs: see the commit), and
    "numerics" names both `cpu`: a cache they share keeps their results apart."""
    data = write_parquet(tmp_path / "a.parquet", documents(4))
    for k, flags in enumerate(["fpu avx2 fma avx512f avx512_bf16", "fpu avx2 fma", "fpu avx2 fma avx512f avx512_bf16"]):
        monkeypatch.setattr(batchjob.job.cache.results_cache, "cpu_flags", lambda flags=flags: flags, raising=False)
        assert run(cached_job(data, tmp_path / f"o{k}", tmp_path / "c")).computed == (4 if k < 2 else 0)


class Capping(Counting):
    """Engines that cut every output short as elastic compression does under memory pressure (length_capped)."""

    def __call__(self, job) -> FakeEngine:
        engine = super().__call__(job)
        answer = engine._answer

        def capped(request, metrics):
            output = answer(request, metrics)
            output.token_ids = output.token_ids[:2]
            output.text, output.finish_reason = engine.tokenizer.decode(output.token_ids), "length_capped"
            return output

        engine._answer = capped
        return engine


def test_an_output_cut_short_by_elastic_compression_is_not_stored(tmp_path):
    """Its length is the run's memory pressure, not its key's: a later run computes the row whole."""
    data = write_parquet(tmp_path / "a.parquet", documents(5))
    run(cached_job(data, tmp_path / "o1", tmp_path / "c"), Capping())
    assert {r["finish_reason"] for r in rows_of(tmp_path / "o1").values()} == {"length_capped"}
    assert run(cached_job(data, tmp_path / "o2", tmp_path / "c")).computed == 5
    run(make_job(data, tmp_path / "scratch"))
    assert rows_of(tmp_path / "o2") == rows_of(tmp_path / "scratch")


def run_in_process(data: str, out: str, cache: str, max_size: int) -> int:
    job = cached_job(Path(data), Path(out), cache, cache={"max_size": max_size})
    return run_job(job, Messages(), engine_factory=Counting())


@pytest.mark.parametrize("max_size", [10 << 20, 12_000])
def test_two_jobs_at_once_on_one_cache(tmp_path, max_size):
    """Two runs write (and with a small cap, evict) at the same time: both give every row right, and every entry
    left reads back whole."""
    data = write_parquet(tmp_path / "a.parquet", documents(150))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        codes = pool.starmap(
            run_in_process, [(str(data), str(tmp_path / f"out{k}"), str(tmp_path / "c"), max_size) for k in (1, 2)]
        )
    assert codes == [EXIT_OK, EXIT_OK]
    run(make_job(data, tmp_path / "scratch"))
    assert rows_of(tmp_path / "out1") == rows_of(tmp_path / "out2") == rows_of(tmp_path / "scratch")
    entries = list((tmp_path / "c").rglob("*.json"))
    assert max_size > 1 << 20 or sum(p.stat().st_size for p in entries) <= max_size
    third = run(cached_job(data, tmp_path / "out3", tmp_path / "c"))
    assert third.computed == 150 - len(entries)  # every entry left is a hit: none is damaged
    assert rows_of(tmp_path / "out3") == rows_of(tmp_path / "scratch")
    assert not [p for p in (tmp_path / "c").rglob("*") if p.name.endswith(".tmp")]


def test_a_cache_on_s3(s3, tmp_path, monkeypatch):  # noqa: F811 (the fixture)
    """A damaged entry is a miss there too; a hit marks its entry used by writing it again (S3 has no utime), and
    eviction keeps the entries so marked."""
    docs = documents(20)
    data = write_parquet(tmp_path / "a.parquet", docs)
    url, prefix = f"s3://{BUCKET}/results-cache", f"{BUCKET}/results-cache"
    assert run(cached_job(data, tmp_path / "out1", url)).computed == 20

    def entries() -> dict[str, dict]:
        s3.invalidate_cache()
        return s3.find(prefix, detail=True)

    s3.pipe(next(iter(entries())), b'{"key": "truncat')  # a damaged entry
    assert run(cached_job(data, tmp_path / "out2", url)).computed == 1
    assert rows_of(tmp_path / "out2") == rows_of(tmp_path / "out1")
    before = entries()
    time.sleep(1.1)  # S3's LastModified counts whole seconds
    monkeypatch.setattr(batchjob.job.cache.results_cache, "TOUCH_AFTER_S", 0.0)  # each hit marks its entry
    five = write_parquet(tmp_path / "b.parquet", docs[:5])
    assert run(cached_job(five, tmp_path / "out3", url)).computed == 0
    marked = {name for name, info in entries().items() if info["LastModified"] > before[name]["LastModified"]}
    assert len(marked) == 5
    cache = ResultsCache(
        CacheSpec(
            path=url,
            max_size=int(sum(before[n]["size"] for n in marked) / batchjob.job.cache.results_cache.EVICT_TO) + 1,
        )
    )
    cache.evict()
    assert set(entries()) == marked


def test_openai_batch_lines_are_keyed_as_other_rows(tmp_path):
    """A chat line and a row of a Parquet job with the same prompt and sampling are one key."""
    docs = documents(6)
    lines = [
        {
            "custom_id": d["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": d["text"]}], "max_tokens": 64, "temperature": 0},
        }
        for d in docs
    ]
    batch = write_jsonl(tmp_path / "b.jsonl", lines)
    openai = {"input": {"format": "openai-batch"}, "output": {"format": "openai-batch"}}
    assert run(cached_job(batch, tmp_path / "o1", tmp_path / "c", **openai)).computed == 6
    assert run(cached_job(batch, tmp_path / "o2", tmp_path / "c", **openai)).computed == 0
    first, again = ((tmp_path / o / "output.jsonl").read_text().splitlines() for o in ("o1", "o2"))
    drop = lambda line: {**json.loads(line), "response": {**json.loads(line)["response"], "body": None}}  # noqa: E731
    bodies = lambda lines: [json.loads(line)["response"]["body"]["choices"] for line in lines]  # noqa: E731
    assert bodies(first) == bodies(again) and list(map(drop, first)) == list(map(drop, again))
    parquet = write_parquet(tmp_path / "a.parquet", docs)
    assert run(cached_job(parquet, tmp_path / "o3", tmp_path / "c", sampling={"max_tokens": 64})).computed == 0


def test_plan_leaves_the_cached_rows_out(tmp_path):
    docs = documents(30)
    data = write_parquet(tmp_path / "a.parquet", docs)
    run(cached_job(data, tmp_path / "out1", tmp_path / "cache"))
    docs[3]["text"] = "changed"
    edited = cached_job(write_parquet(tmp_path / "b.parquet", docs), tmp_path / "out2", tmp_path / "cache")
    report = plan_job(edited, calibrate=False, engine_factory=Counting())
    assert report["rows_from_results_cache"] == 29 and report["requests"] == 1
    assert "rows_from_results_cache" not in plan_job(
        make_job(data, tmp_path / "o"), calibrate=False, engine_factory=Counting()
    )


def test_the_job_file_section(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", documents(2))
    path = tmp_path / "job.yaml"
    job = {
        "input": {"path": str(data)},
        "output": {"path": str(tmp_path / "o")},
        "cache": {"path": "c", "max_size": "2GiB"},
    }
    path.write_text(yaml.safe_dump(job))
    assert load_job(path).cache.max_size == 2 << 30
    with pytest.raises(JobFileError, match="cache: not yet used with executor 'ray'"):
        load_job(path, ["executor=ray"])
    with pytest.raises(JobFileError, match="cache.max_size"):
        load_job(path, ["cache.max_size=lots"])


def test_a_cache_in_what_batchjob_writes_in_the_output_folder_is_refused(tmp_path):
    """Seen: cache.path OUT/data was accepted, the run exited 0, then pq.read_table(OUT/data) failed on the cache's
    files and a rerun or --restart exited 2. Any name batchjob writes in the output folder is refused at validation,
    in one line (exit 2), however the path is written; the output folder itself or another folder in it is not."""
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (tmp_path / "link").symlink_to(out / "data")
    data = write_parquet(tmp_path / "a.parquet", documents(2))
    refused = [out / "data", out / "data" / "cache", f"{out}/x/../_sorted", out / "_quarantine" / "c"]
    refused += [out / "metrics.prom", out / "_job.json", tmp_path / "link" / "c", f"file://{out}/data"]
    for folder in refused:
        with pytest.raises(ValueError, match=r"cache.path: .* is in the output folder's (data|_\w+|metrics.prom)"):
            cached_job(data, out, folder)
    for folder in [out, out / "cache", out / "database", tmp_path / "cache"]:
        cached_job(data, out, folder)
    on_s3 = {"path": "s3://bucket/out", "storage_options": {"key": "k"}}
    with pytest.raises(ValueError, match="cache.path: s3://bucket/out//data/c is in the output folder's data"):
        cached_job(data, out, "s3://bucket/out//data/c", output=on_s3)
    for folder in ["s3://other/out/data", "s3://bucket/output/data", "gs://bucket/out/data", str(out / "data")]:
        cached_job(data, out, folder, output=on_s3)
    path = write_job(
        tmp_path / "job.yaml", input={"path": str(data)}, output={"path": str(out)}, cache={"path": f"{out}/data"}
    )
    result = cli("run", str(path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 2, result.stderr
    assert f"cache.path: {out}/data is in the output folder's data" in result.stderr
    assert not list((out / "data").iterdir())


def write_job(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path


@pytest.mark.slow
def test_the_issue_test_one_row_edited_in_200_on_the_real_model(tmp_path):
    """Edit one row's text in a 200-row job and rerun into a new folder: one row computed, 199 from the cache, the
    output the same as a from-scratch run's; through the CLI on the default model, with `plan` and `status`."""
    rows = [{"id": f"r{i:03d}", "text": f"Count from {i} to {i + 3}."} for i in range(200)]
    first, edited = write_parquet(tmp_path / "a.parquet", rows), tmp_path / "b.parquet"
    rows[123]["text"] = "Name a colour."
    write_parquet(edited, rows)
    common = {
        "sampling": {"temperature": 0.0, "max_tokens": 4},
        "engine": {"max_num_seqs": 32, "kv_cache_memory_gb": 0.2, "max_model_len": 256},
    }
    cache = {"path": str(tmp_path / "cache")}

    def job(name: str, data: Path, **more) -> str:
        out = {"path": str(tmp_path / name)}
        return str(write_job(tmp_path / f"{name}.yaml", input={"path": str(data)}, output=out, **common, **more))

    assert cli("run", job("out1", first, cache=cache)).returncode == 0
    planned = cli("plan", job("out2", edited, cache=cache), "--no-calibrate", "--json")
    assert planned.returncode == 0, planned.stderr
    assert (json.loads(planned.stdout)["rows_from_results_cache"], json.loads(planned.stdout)["requests"]) == (199, 1)
    again = cli("run", job("out2", edited, cache=cache))
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary_cache(tmp_path / "out2") == {"hits": 199, "misses": 1}
    status = cli("status", str(tmp_path / "out2"))
    assert "results cache: 199 rows taken from it, 1 computed" in status.stdout
    scratch = cli("run", job("scratch", edited))
    assert scratch.returncode == 0, scratch.stdout + scratch.stderr
    ours, reference = rows_of(tmp_path / "out2"), rows_of(tmp_path / "scratch")
    assert ours == reference and ours["r123"]["output"] != rows_of(tmp_path / "out1")["r123"]["output"]


@pytest.mark.slow
def test_an_embedding_job_takes_its_rows_from_the_cache(tmp_path, minilm):
    """The second run computes nothing and writes the same embeddings; an OpenAI Batch line of one of the texts,
    with its own `dimensions` (a Matryoshka model's), takes the same entry, cut and normalised to them."""
    model = shutil.copytree(minilm, tmp_path / "matryoshka")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [128, 384]}))
    rows = [{"id": f"t{i}", "text": f"A sentence about the number {i}."} for i in range(30)]
    data = write_parquet(tmp_path / "a.parquet", rows)
    cache = {"path": str(tmp_path / "cache")}

    def job(name: str, data: Path, **more) -> str:
        sections = {"model": str(model), "task": "embed", "input": {"path": str(data)}, "cache": cache, **more}
        return str(write_job(tmp_path / f"{name}.yaml", output={"path": str(tmp_path / name)}, **sections))

    for name in ("out1", "out2"):
        result = cli("run", job(name, data))
        assert result.returncode == 0, result.stdout + result.stderr
    assert summary_cache(tmp_path / "out1") == {"hits": 0, "misses": 30}
    assert summary_cache(tmp_path / "out2") == {"hits": 30, "misses": 0}
    first, again = (pq.read_table(tmp_path / o / "data").sort_by("id").to_pylist() for o in ("out1", "out2"))
    assert [(r["id"], r["embedding"], r["prompt_tokens"]) for r in first] == [
        (r["id"], r["embedding"], r["prompt_tokens"]) for r in again
    ]
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": rows[4]["text"], "dimensions": 128},
    }
    batch = write_jsonl(tmp_path / "b.jsonl", [line])
    openai = cli("run", job("out3", batch, input={"path": str(batch), "format": "openai-batch"}))
    assert openai.returncode == 0, openai.stdout + openai.stderr
    assert summary_cache(tmp_path / "out3") == {"hits": 1, "misses": 0}
    row = pq.read_table(tmp_path / "out3" / "data").to_pylist()[0]
    full = np.asarray(first[[r["id"] for r in first].index("t4")]["embedding"])
    assert np.allclose(row["embeddings"], [full[:128] / np.linalg.norm(full[:128])], atol=1e-6)
    # Seen: an entry of 3 floats for this 384-dimension model (a valid checksum) failed every run at exit 70
    entry = json.loads(next((tmp_path / "cache").rglob("*.json")).read_text())
    ResultsCache(CacheSpec(**cache)).put(entry["key"], [[0.1, 0.2, 0.3]])
    again = cli("run", job("out4", data))
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary_cache(tmp_path / "out4") == {"hits": 29, "misses": 1}
    assert f"results cache: the entry {entry['key']}" in again.stdout
    fourth = pq.read_table(tmp_path / "out4" / "data").sort_by("id").to_pylist()
    assert [(r["id"], r["prompt_tokens"], r["error"]) for r in fourth] == [
        (r["id"], r["prompt_tokens"], None) for r in first
    ]
    # the row computed again, in a batch of its own: equal to bf16's batch variance (issue 42's item 4)
    assert np.allclose([r["embedding"] for r in fourth], [r["embedding"] for r in first], atol=2e-3)


@pytest.mark.slow
def test_embedding_lines_of_token_ids_split_otherwise_are_two_entries(tmp_path, minilm):
    """Two /v1/embeddings lines of the same token ids, split into inputs otherwise ([[1, 2], [3]] and [[1], [2, 3]]):
    two entries, and a rerun gives each line its own vectors."""
    lines = [
        {"custom_id": name, "method": "POST", "url": "/v1/embeddings", "body": {"input": split}}
        for name, split in (("a", [[1012, 2048], [3000]]), ("b", [[1012], [2048, 3000]]))
    ]
    batch = write_jsonl(tmp_path / "b.jsonl", lines)
    sections = {"model": str(minilm), "task": "embed", "input": {"path": str(batch), "format": "openai-batch"}}
    for name in ("out1", "out2"):
        out, cache = {"path": str(tmp_path / name)}, {"path": str(tmp_path / "c")}
        result = cli("run", str(write_job(tmp_path / f"{name}.yaml", output=out, cache=cache, **sections)))
        assert result.returncode == 0, result.stdout + result.stderr
    assert len(list((tmp_path / "c").rglob("*.json"))) == 2
    assert summary_cache(tmp_path / "out2") == {"hits": 2, "misses": 0}
    first, again = (
        {r["id"]: r["embeddings"] for r in pq.read_table(tmp_path / o / "data").to_pylist()} for o in ("out1", "out2")
    )
    assert first == again and not np.allclose(first["a"][0], first["b"][0])
