"""Rows to engine work, ordered for throughput over a bounded window of rows.

Within a window, prompts are sorted by their token ids, which puts prompts sharing a prefix (same system text and
template head) next to each other, so their KV blocks are reused while still cached; each such group, and the pool
of prompts that share nothing, is then binned by length so that similar lengths run in the same batches. Identical
requests under deterministic sampling become one piece of work whose result is written for every row."""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import pydantic

from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.prompt import PromptBuilder, RowError
from batchjob.job.reader import Row

# Quarter-octave length bins: lengths within ~19% of each other count as similar.
BINS_PER_OCTAVE = 4


@dataclass
class Work:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    truncated: bool
    rows: list[Row] = field(default_factory=list)  # the first is computed, the rest are its duplicates


class Planner:
    def __init__(
        self,
        builder: PromptBuilder,
        params: SamplingParams,
        *,
        sort_window: int,
        dedupe: bool,
        block_size: int,
        on_error: Callable[[Row, str], None],
    ):
        self.builder, self.params = builder, params
        self.sort_window, self.dedupe, self.block_size = sort_window, dedupe, block_size
        self.on_error = on_error
        self._ids = itertools.count()

    def works(self, rows: Iterable[Row]) -> Iterator[Work]:
        window: list[Work] = []
        by_key: dict[bytes, Work] = {}
        size = 0
        for row in rows:
            work = self._work(row)
            if work is None:
                continue
            key = _request_key(work) if self.dedupe and work.params.deterministic else None
            if key is not None and key in by_key:
                by_key[key].rows.append(row)
            else:
                window.append(work)
                if key is not None:
                    by_key[key] = work
            size += 1
            if size >= self.sort_window:
                yield from order(window, self.block_size)
                window, by_key, size = [], {}, 0
        yield from order(window, self.block_size)

    def _work(self, row: Row) -> Work | None:
        if row.error is not None:
            self.on_error(row, row.error)
            return None
        try:
            params = self._row_params(row)
            token_ids, truncated = self.builder.build(row, params.max_tokens)
        except RowError as e:
            self.on_error(row, str(e))
            return None
        return Work(str(next(self._ids)), token_ids, params, truncated, [row])

    def _row_params(self, row: Row) -> SamplingParams:
        if not row.overrides:
            return self.params
        try:
            return SamplingParams.model_validate({**self.params.model_dump(), **row.overrides})
        except pydantic.ValidationError as e:
            raise RowError("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None


def order(works: list[Work], block_size: int) -> list[Work]:
    works.sort(key=lambda w: w.token_ids)
    runs: list[list[Work]] = []
    for work in works:
        if runs and _share_a_block(runs[-1][-1].token_ids, work.token_ids, block_size):
            runs[-1].append(work)
        else:
            runs.append([work])
    ordered = [w for run in runs if len(run) > 1 for w in sorted(run, key=_length_bin)]
    return ordered + sorted((run[0] for run in runs if len(run) == 1), key=_length_bin)


def _share_a_block(a: list[int], b: list[int], block_size: int) -> bool:
    return len(a) >= block_size and len(b) >= block_size and a[:block_size] == b[:block_size]


def _length_bin(work: Work) -> int:
    return int(BINS_PER_OCTAVE * math.log2(max(1, len(work.token_ids))))


def _request_key(work: Work) -> bytes:
    digest = hashlib.blake2b(array("q", work.token_ids).tobytes(), digest_size=16)
    digest.update(work.params.model_dump_json().encode())
    return digest.digest()
