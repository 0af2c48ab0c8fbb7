"""The results cache (`cache: {path: DIR}`): a row's result stored under a key of everything that decides it, so a
later job (any job file, any output folder) with the same key takes it instead of computing it.

DIR/<key[:2]>/<key>.json   one entry: {"key": its key, "sha256": of its result's canonical JSON, "result": ...}

An entry is written whole (storage.write_atomic: a temporary file renamed locally, one PUT on an object store), so
jobs can share a cache while they run: two writers of one key write the same result. An entry that does not read back
whole and consistent (truncated, bad JSON, another key inside, a wrong checksum), or that is not exactly the shape of
its row's result (entries.py: what others wrote is untrusted input), is a miss, never a result; the first in a run is
said, with its key, and the row's computed result is stored over it. An entry's
modification time is its last use: a hit refreshes it when it is older than TOUCH_AFTER_S (on an object store by
writing the entry again, hence not at every hit), and when the cache is over `max_size` the entries used longest ago
are deleted."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from batchjob.engine.outputs import RequestOutput, ScoreOutput
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.cache.entries import (
    Unfit,
    embedding_result,
    generation_entry,
    generation_result,
    score_entry,
    score_result,
)
from batchjob.job.contracts import Embedder, JobEngine, model_identity
from batchjob.job.input.planner import EmbeddingWork, Work
from batchjob.job.input.scoring import ScoreWork
from batchjob.job.output.storage import TMP_PREFIX, is_remote, location, url_to_fs, write_atomic
from batchjob.job.spec import CacheSpec, JobSpec
from batchjob.model.cpu_features import ISA_FLAGS, cpu_flags

FORMAT = 1  # of the key and the entries: a change makes every earlier entry a miss
# Truncation (max_model_len), output lengths (elastic_*) and sampling draws (seed). The dtypes count as resolved, in
# "numerics": `dtype: auto` is bfloat16 on a GPU and on a CPU with native bf16, float32 on other CPUs.
RESULT_ENGINE_SETTINGS = {"max_model_len", "elastic_compression", "elastic_max_tokens_floor", "seed"}
TOUCH_AFTER_S = 3600.0  # a hit marks its entry used if its last mark is older: LRU to the hour, at one write an hour
EVICT_TO = 0.9  # of max_size, so that the next writes do not each evict again
MAX_FAILURES = 5  # reads, or writes, failing in a row that make a run stop them (a transient failure does not)
STALE_TMP_S = 86400.0  # a temporary file this old is a killed writer's; eviction removes it
# Eviction takes only these (an entry, or a killed writer's temporary file of one, in its shard folder): anything else
# in the cache folder (a user's files, an output folder's) is not batchjob's to delete.
ENTRY_NAME = re.compile(
    rf"(?P<shard>[0-9a-f]{{2}})/(?:(?P=shard)[0-9a-f]{{62}}\.json"
    rf"|(?P<tmp>{re.escape(TMP_PREFIX)})(?P=shard)[0-9a-f]{{62}}\.json\.[0-9a-f]+\.tmp)"
)


class _Failures:
    """The one failure policy of a cache's reads, and of its writes: a failure costs its entry (a read is a miss, a
    write not stored), said once; a transient one (a full disk freed, a store's hiccup) leaves the cache in use. Only
    MAX_FAILURES in a row (a folder the run may not read or write, a cache path that is a file) stop them for the
    run, said once more."""

    def __init__(self, root: Any, warn: Callable[[str], None], what: str, costs: str, stops: str):
        self.root, self.warn, self.what, self.costs, self.stops = root, warn, what, costs, stops
        self.in_a_row, self.warned, self.stopped = 0, False, False

    def succeeded(self) -> None:
        self.in_a_row = 0

    def failed(self, error: Exception) -> None:
        self.in_a_row += 1
        if self.in_a_row >= MAX_FAILURES:
            self.stopped = True
            self.warn(
                f"results cache: cannot {self.what} in {self.root} ({error}; {self.in_a_row} {self.what}s in a row "
                f"failed); this run {self.stops} there"
            )
        elif not self.warned:
            self.warned = True
            self.warn(f"results cache: a {self.what} in {self.root} failed ({error}); {self.costs}")


class ResultsCache:
    """The entries under one folder: get, put, and eviction down to max_size."""

    def __init__(self, spec: CacheSpec, warn: Callable[[str], None] = lambda message: None):
        self.root = location(spec.path, spec.storage_options)
        self.fs, self.fs_root = url_to_fs(spec.path, spec.storage_options)
        self.max_size = int(spec.max_size)
        self.written_since_evict = 0
        self.warn, self.unlistable, self.unreachable, self.said_unusable = warn, False, False, False
        self.reads = _Failures(
            self.root, warn, "read", "that entry is a miss, the next are looked up", "looks nothing more up"
        )
        self.writes = _Failures(
            self.root, warn, "write", "that entry is not stored, the next are", "stores and marks nothing more"
        )

    @property
    def unwritable(self) -> bool:
        return self.writes.stopped

    def _path(self, key: str):
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str, touch: bool = True) -> Any:
        """The result stored under `key` (a JSON value); None for a miss, which a damaged or foreign entry is too,
        and so is an entry that cannot be read (`reads` counts that)."""
        if self.reads.stopped:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # no entry, or a folder in its place: the store answered
            self.reads.succeeded()
            return None
        except Exception as e:  # whatever the store calls it (botocore's errors are no OSError)
            self._failed(self.reads, e)
            return None
        self.reads.succeeded()
        try:
            entry = json.loads(data)
            result = entry["result"]
            if entry["key"] != key:
                return self.unusable(key, "it holds another key")
            if entry["sha256"] != _sha256(_canonical(result)):
                return self.unusable(key, "its result does not match its checksum")
        except (ValueError, LookupError, TypeError, RecursionError):  # cut short, not JSON, too deep, not text
            return self.unusable(key, "not a whole entry")
        if touch:
            self._touch(path, data)
        return result

    def unusable(self, key: str, why: str) -> None:
        """An entry that is a miss for what it holds, said the first time in a run, with its key: another job or a
        person wrote it, and it stays until a run stores its row's result over it (or eviction takes it)."""
        if not self.said_unusable:
            self.said_unusable = True
            self.warn(
                f"results cache: the entry {key} in {self.root} is {why}; it is a miss: its row is computed and "
                "stored over it (further such entries in this run are not said)"
            )

    def _failed(self, failures: _Failures, error: Exception) -> None:
        """A store that cannot be reached fails each request, each after its retries: given up at its first failure,
        for reads and writes both, said once. Other failures count in `failures`."""
        if not _unreachable(error):
            failures.failed(error)
            return
        self.unreachable = self.reads.stopped = self.writes.stopped = True
        self.warn(f"results cache: cannot reach {self.root} ({error}); this run looks nothing more up there")

    def put(self, key: str, result: Any) -> None:
        """Store `result`. A write that fails costs only its entry: the run goes on (`writes` counts it)."""
        if self.writes.stopped:
            return
        body = _canonical(result)
        data = _canonical({"key": key, "sha256": _sha256(body), "result": result})
        path = self._path(key)
        try:
            if not is_remote(path):
                path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: f.write(data), durable=False)  # a cut-short entry is a miss, not a wrong row
        except Exception as e:  # whatever the store calls it (an unreachable endpoint is no OSError)
            self._failed(self.writes, e)
            return
        self.writes.succeeded()
        self.written_since_evict += len(data)
        if self.written_since_evict > self.max_size * (1 - EVICT_TO):
            self.evict()

    def _touch(self, path, data: bytes) -> None:
        """Mark an entry used; on a cache this run cannot write, a hit stays a hit, unmarked."""
        if self.writes.stopped:
            return
        try:
            if time.time() - path.stat().st_mtime < TOUCH_AFTER_S:
                return
            if is_remote(path):
                write_atomic(path, lambda f: f.write(data), durable=False)
            else:
                os.utime(path)
            self.writes.succeeded()
        except FileNotFoundError:  # another job evicted it since it was read: the hit stands
            pass
        except Exception as e:
            self._failed(self.writes, e)

    def size(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def evict(self) -> None:
        """Delete the entries used longest ago until the cache is within max_size (to EVICT_TO of it, once over)."""
        self.written_since_evict = 0
        if self.unreachable:
            return
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        if total <= self.max_size:
            return
        for name, size, _ in sorted(entries, key=lambda e: e[2]):
            if total <= self.max_size * EVICT_TO:
                break
            with contextlib.suppress(Exception):  # another job evicted it first, or the cache is read-only
                self.fs.rm_file(name)
            total -= size

    def _entries(self) -> list[tuple[str, int, float]]:
        """(name, size, last use) of each entry; a killed writer's old temporary files are removed on the way."""
        try:
            found = self.fs.find(self.fs_root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:  # a folder or bucket this run may write but not list, or cannot reach
            if not self.unlistable:
                self.warn(f"results cache: cannot list {self.root} ({e}); this run evicts nothing there")
            self.unlistable = True
            return []
        entries, root = [], self.fs_root.rstrip("/") + "/"
        for name, info in found.items():
            match, used = ENTRY_NAME.fullmatch(name.removeprefix(root)), _mtime(info)
            if match is None:
                continue
            if match["tmp"] and time.time() - used > STALE_TMP_S:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(name)
            elif not match["tmp"]:
                entries.append((name, int(info.get("size") or 0), used))
        return entries


class RunCache:
    """A run's use of the cache: the keys of its rows, in a scope of the model and the settings its rows share, and the
    conversion of results to entries and back. A task whose results depend on more than a row's token ids and
    sampling parameters (scoring's continuation or labels) passes that as a row's `settings`."""

    def __init__(self, cache: ResultsCache, job: JobSpec, engine: JobEngine | Embedder):
        self.cache = cache
        identity = model_identity(engine)
        self._scope = _canonical(
            {
                "format": FORMAT,
                "task": job.task,
                "model_digest": identity["model_digest"],
                "numerics": identity["numerics"],
                "cpu_isa": _cpu_isa(identity["numerics"]),
                "engine": job.engine.model_dump(mode="json", include=RESULT_ENGINE_SETTINGS),
            }
        )
        self._dimension = engine.dimension if job.task == "embed" else 0  # of an embedding entry's vectors
        self._lora_digests = getattr(engine, "lora_digests", {})
        self._params: tuple[SamplingParams | None, bytes] = (None, _canonical(None))
        self.keys: dict[str, str] = {}  # request id -> key, for the generation works sent to the engine

    def key(self, token_ids: list[int] | list[list[int]], params: SamplingParams | None, settings: dict | None) -> str:
        """sha256 over the scope, the parameters, the settings and the token ids (of each input), each piece with its
        length before it, so that no two different sets of pieces hash the same bytes."""
        h = hashlib.sha256()
        for piece in (self._scope, self._params_json(params), _canonical(settings or {})):
            _update(h, piece)
        for ids in token_ids if token_ids and isinstance(token_ids[0], list) else [token_ids]:
            _update(h, array("q", ids).tobytes())
        return h.hexdigest()

    def _params_json(self, params: SamplingParams | None) -> bytes:
        # Most rows share the job's SamplingParams object, whose JSON is made once.
        if params is not self._params[0]:
            self._params = (params, _canonical(params and params.model_dump(mode="json")))
        return self._params[1]

    def work_key(self, work: Work | EmbeddingWork | ScoreWork) -> str | None:
        """A work's key; None for unseeded sampling, which is never cached: its result is one draw among many. A
        scoring work's covers the prompt and each tail apart, where the scored tokens start, and the labels' names
        and order (its parameters hold prompt_logprobs)."""
        if isinstance(work, EmbeddingWork):
            return self.key(work.inputs, None, None)
        # a row through a LoRA adapter is keyed by the adapter's content; a base row as in a job without adapters
        lora = {"lora": self._lora_digests[work.lora]} if work.lora else {}
        if isinstance(work, ScoreWork):
            settings = {"start": work.start, "labels": work.labels} | lora
            return self.key([work.token_ids, *work.tails], work.params, settings)
        if not work.params.deterministic:
            return None
        # an image row by its pixels' digests in order: its tokens are placeholders, the same for any image of its
        # size (one image keys as it always has)
        digests = [d.hex() for d in work.images.digests] if work.images is not None else []
        image = {"image": digests[0]} if len(digests) == 1 else {"images": digests} if digests else {}
        return self.key(work.token_ids, work.params, (lora | image) or None)

    def holds(self, work: Work | EmbeddingWork | ScoreWork) -> bool:
        """Whether a run would take a work's result from the cache (`plan`'s count): the run's own check, without
        marking the entry used."""
        key = self.work_key(work)
        return key is not None and self._result(work, key, touch=False) is not None

    def _result(self, work: Work | EmbeddingWork | ScoreWork, key: str, touch: bool = True) -> Any:
        """The result that the entry under `key` gives `work` (its RequestOutput, ScoreOutput or vectors); None for a
        miss: no entry, a damaged one, or one that is no result for this work (entries.py: said once, with its
        key; the row's computed result is stored over it)."""
        entry = self.cache.get(key, touch)
        if entry is None:
            return None
        try:
            if isinstance(work, EmbeddingWork):
                return embedding_result(entry, work, self._dimension)
            return score_result(entry, work) if isinstance(work, ScoreWork) else generation_result(entry, work)
        except Unfit as e:
            self.cache.unusable(key, f"no result for its row: {e}")
            return None

    def generation_misses(self, works: Iterable[Work], on_hit: Callable[[Work, RequestOutput], None]) -> Iterator[Work]:
        """The works that the cache does not answer, with their keys kept for `store`; `on_hit` takes the others."""
        return self._misses(works, on_hit)

    def _misses(self, works: Iterable, on_hit: Callable) -> Iterator:
        """The works that the cache gives no result, with their keys kept for storing theirs."""
        for work in works:
            key = self.work_key(work)
            if key is None:
                yield work
                continue
            result = self._result(work, key)
            if result is not None:
                on_hit(work, result)
                continue
            self.keys[work.request_id] = key
            yield work

    def looked_up(self, work: Work | ScoreWork) -> bool:
        return work.request_id in self.keys

    def store(self, work: Work, output: RequestOutput) -> None:
        """Store a finished request's result; an error, an aborted request or one that elastic compression cut short
        (its length is the run's memory pressure, not its key's) is not a result to keep."""
        key = self.keys.pop(work.request_id, None)
        reasons = {output.finish_reason, *(s.finish_reason for s in output.samples)}
        if key is None or output.error is not None or reasons & {"abort", "error", "length_capped"}:
            return
        self.cache.put(key, generation_entry(output))

    def score_misses(
        self, works: Iterable[ScoreWork], on_hit: Callable[[ScoreWork, ScoreOutput], None]
    ) -> Iterator[ScoreWork]:
        """The scoring works that the cache does not answer, with their keys kept for `store_score`."""
        return self._misses(works, on_hit)

    def store_score(self, work: ScoreWork, score: ScoreOutput) -> None:
        """Store a row's score; an error is not a result to keep."""
        key = self.keys.pop(work.request_id, None)
        if key is not None and score.error is None:
            self.cache.put(key, score_entry(score))

    def embedding_misses(
        self, works: Iterable[EmbeddingWork], on_hit: Callable[[EmbeddingWork, list[list[float]]], None]
    ) -> Iterator[EmbeddingWork]:
        for work in works:
            vectors = self._result(work, self.work_key(work))
            if vectors is not None:
                on_hit(work, vectors)
            else:
                yield work

    def store_embeddings(self, work: EmbeddingWork, vectors: list[list[float]]) -> None:
        """An embedding row's vectors, at the model's full dimension (a row's `dimensions` cuts them after)."""
        self.cache.put(self.work_key(work), vectors)


def open_cache(
    job: JobSpec, engine: JobEngine | Embedder, warn: Callable[[str], None] = lambda message: None
) -> RunCache | None:
    return RunCache(ResultsCache(job.cache, warn), job, engine) if job.cache is not None else None


def _unreachable(error: Exception) -> bool:
    """A failure that says the store is not there (a refused connection, an endpoint gone: botocore's errors, which
    are no OSError, once s3fs has retried them), not that one entry could not be read or written."""
    return isinstance(error, ConnectionError) or not isinstance(error, OSError)


def _cpu_isa(numerics: dict) -> list[str] | None:
    """On a CPU, the instruction sets its kernels (oneDNN's, the C++ ones) dispatch on: an AVX2 host and an AVX-512
    one (or BATCHJOB_CPU_ISA=avx2) sum in other orders and differ in the last bits, where "numerics" says only `cpu`.
    A cache shared by such hosts gives each the results it computes itself."""
    return sorted(set(ISA_FLAGS) & set(cpu_flags().split())) if numerics.get("device") == "cpu" else None


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _update(h: Any, piece: bytes) -> None:
    h.update(len(piece).to_bytes(8, "little"))
    h.update(piece)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mtime(info: dict) -> float:
    """An fsspec listing's modification time: a number locally, a datetime on S3."""
    when = info.get("mtime", info.get("LastModified", 0.0))
    return when.timestamp() if isinstance(when, datetime) else float(when or 0.0)
