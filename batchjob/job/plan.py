"""`batchjob plan`: what a job will cost, from its tokenized prompts and a short measured calibration."""

from __future__ import annotations

import dataclasses
import statistics
import time
from array import array
from collections.abc import Callable

from batchjob.engine.host_memory import peak_rss, resident_bytes
from batchjob.engine.outputs import Request, StepMetrics
from batchjob.job.cache.results_cache import open_cache
from batchjob.job.contracts import Embedder, JobEngine
from batchjob.job.input.planner import EmbeddingPlanner, Work, job_planner
from batchjob.job.input.prompt import RowError
from batchjob.job.input.reader import InputSource
from batchjob.job.input.scoring import score_planner
from batchjob.job.kv_pool import PrefixCacheModel, fit_job_pool, max_output_tokens, pool_report
from batchjob.job.output.lora_counts import LoraCounts
from batchjob.job.run.executor import load_engine
from batchjob.job.spec import JobSpec

CALIBRATION_REQUESTS = 8
CALIBRATION_MAX_TOKENS = 64
CALIBRATION_EMBED_BATCHES = 2  # forward passes' worth of the first inputs, embedded once to warm up, then timed


def plan_job(
    job: JobSpec, *, calibrate: bool = True, engine_factory: Callable[[JobSpec], JobEngine] = load_engine
) -> dict:
    source = InputSource(job)
    scan = source.scan()
    engine = engine_factory(job)
    if job.task == "embed":
        return _plan_embedding(job, source, scan.total, engine, calibrate)
    if job.task == "score":
        return _plan_scoring(job, source, scan.total, engine, calibrate)
    fit_job_pool(job, engine, source.rows())
    block_size = engine.config.block_size
    failed = 0

    def count_failure(row, error) -> None:
        nonlocal failed
        failed += 1

    planner = job_planner(job, engine, count_failure)
    cache = PrefixCacheModel(engine.num_kv_blocks, block_size)
    results = open_cache(job, engine)
    # Compact arrays: a plan of a million-row input keeps two numbers a request.
    lengths, max_tokens, sample, duplicates, shared = array("q"), array("q"), [], 0, 0
    constrained, grammars, hits, image_rows, image_count, image_tokens = 0, set(), 0, 0, 0, 0
    lora_rows = LoraCounts() if job.engine.lora else None
    for work in planner.works(source.rows()):
        if lora_rows is not None:
            lora_rows.add(work.lora, len(work.rows), failed=False)
        if results is not None and results.holds(work):  # taken from the results cache: no time to estimate
            hits += len(work.rows)
            continue
        key = work.params.grammar_key
        if key is not None:
            constrained += len(work.rows)
            grammars.add(key)
        lengths.append(len(work.token_ids))
        max_tokens.append(max_output_tokens(engine, work))
        duplicates += len(work.rows) - 1
        if work.images is not None:
            image_rows += len(work.rows)
            image_count += len(work.images.digests) * len(work.rows)
            image_tokens += work.images.tokens
        images = list(zip(work.images.firsts, work.images.digests)) if work.images is not None else []
        shared += cache.hit_tokens(work.token_ids, images)
        if len(sample) < CALIBRATION_REQUESTS:  # the first in planned order: what the run starts with
            sample.append(work)
    counts = {"rows_from_results_cache": hits} if results is not None else {}
    counts |= _lora_report(lora_rows)
    if not lengths:
        return {"rows": scan.total, "rows_failing_before_the_model": failed, **counts, "requests": 0}

    prompt_tokens = sum(lengths)
    report = {
        "rows": scan.total,
        "rows_failing_before_the_model": failed,
        **counts,
        "requests": len(lengths),
        "duplicate_rows_computed_once": duplicates,
        "constrained_rows": constrained,
        "distinct_grammars": len(grammars),
        # rows with images (the image column's, the messages' image parts), their images, and the image tokens of the
        # requests computed
        **(
            {"image_rows": image_rows, "images": image_count, "image_tokens_total": image_tokens}
            if planner.images is not None
            else {}
        ),
        **_prompt_token_stats(lengths),
        "output_tokens_max": sum(max_tokens),
        "prefix_sharing_ratio": round(shared / prompt_tokens, 3),
    }
    expected_output = statistics.fmean(max_tokens)
    if calibrate:
        calibration = measure(engine, sample)
        expected_output = calibration.pop("mean_output_tokens")
        report["calibration"] = calibration
    report["output_tokens_expected"] = round(expected_output * len(lengths))
    tokens_per_seq = statistics.fmean(lengths) + expected_output
    kv_tokens = engine.num_kv_blocks * block_size
    fit = int(kv_tokens // tokens_per_seq)
    concurrency = max(1, min(fit, engine.config.max_num_seqs, len(lengths)))
    report.update(
        {
            "kv_bytes_per_sequence_mean": round(engine.kv_bytes_per_token * tokens_per_seq),
            "kv_bytes_per_sequence_max": engine.kv_bytes_per_token * (report["prompt_tokens_p99"] + max(max_tokens)),
            **pool_report(engine),
            "kv_cache_tokens": kv_tokens,
            "sequences_that_fit": fit,
            "max_num_seqs": engine.config.max_num_seqs,
        }
    )
    if calibrate:
        c = report["calibration"]
        # Prefill is compute-bound: time is tokens over measured throughput. Decode is memory-bound, so a step
        # costs about the same at the calibration's batch size as at the run's; steps = outputs / concurrency.
        prefill_s = (prompt_tokens - shared) / c["prefill_tokens_per_s"] if c["prefill_tokens_per_s"] else 0.0
        decode_s = report["output_tokens_expected"] / concurrency * c["decode_step_s"]
        report["estimated_time_s"] = round(prefill_s + decode_s, 1)
        written = prompt_tokens - shared + report["output_tokens_expected"]
        report["peak_rss_bytes_predicted"] = predicted_peak_rss(
            engine, written, len(lengths), c.pop("kv_tokens_written")
        )
    return report


def _plan_embedding(job: JobSpec, source: InputSource, rows: int, embedder: Embedder, calibrate: bool) -> dict:
    failed, truncated, lengths, sample, hits = 0, 0, array("q"), [], 0
    budget = CALIBRATION_EMBED_BATCHES * embedder.config.max_num_batched_tokens
    results = open_cache(job, embedder)

    def count_failure(row, error) -> None:
        nonlocal failed
        failed += 1

    for work in EmbeddingPlanner(job, embedder, count_failure).works(source.rows()):
        if results is not None and results.holds(work):
            hits += 1
            continue
        truncated += work.truncated
        lengths.extend(map(len, work.inputs))
        if sum(map(len, sample)) < budget:  # the first inputs: what the run starts with
            sample += work.inputs
    report = {"task": "embed", "rows": rows, "rows_failing_before_the_model": failed}
    report |= {"rows_from_results_cache": hits} if results is not None else {}
    report["requests"] = len(lengths)
    if not lengths:
        return report
    report |= {
        "rows_truncated": truncated,
        **_prompt_token_stats(lengths),
        "max_seq_length": embedder.max_seq_length,
        "dimension": embedder.dimension,
    }
    if calibrate:
        embedder.embed(sample, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        embedder.embed(sample, use_tqdm=False)
        tokens_per_s = sum(map(len, sample)) / (time.perf_counter() - start)
        report["calibration"] = {"inputs": len(sample), "tokens_per_s": round(tokens_per_s, 1)}
        report["estimated_time_s"] = round(report["prompt_tokens_total"] / tokens_per_s, 1)
    return report


def _plan_scoring(job: JobSpec, source: InputSource, rows: int, engine: JobEngine, calibrate: bool) -> dict:
    """A scoring job's cost: prompt-only requests, so prefill alone; a row's labels are scored from one prefill of
    its prompt, a label of several tokens reading the prompt's full blocks from the prefix cache for the rest."""
    failed, hits, duplicates, lengths, scored, computed, sample = 0, 0, 0, array("q"), 0, 0, []
    block = engine.config.block_size
    results = open_cache(job, engine)

    def count_failure(row, error) -> None:
        nonlocal failed
        failed += 1

    lora_rows = LoraCounts() if job.engine.lora else None
    for work in score_planner(job, engine, count_failure).works(source.rows()):
        if lora_rows is not None:
            lora_rows.add(work.lora, len(work.rows), failed=False)
        if results is not None and results.holds(work):
            hits += len(work.rows)
            continue
        duplicates += len(work.rows) - 1
        for request in work.requests():
            lengths.append(len(request.prompt_token_ids))
            # a label's request after the first reads the prompt's full blocks before the row it scores from
            shared = (request.prompt_logprobs_start - 1) // block * block if request.after else 0
            computed += len(request.prompt_token_ids) - shared
            if len(sample) < CALIBRATION_REQUESTS:
                sample.append(request)
        scored += work.scored_tokens
    report = {"task": "score", "rows": rows, "rows_failing_before_the_model": failed}
    report |= {"rows_from_results_cache": hits} if results is not None else {}
    report |= _lora_report(lora_rows)
    report["requests"] = len(lengths)
    if job.score.labels:
        report["labels"] = len(job.score.labels)
    if not lengths:
        return report
    report |= {
        "duplicate_rows_computed_once": duplicates,
        **_prompt_token_stats(lengths),
        "scored_tokens_total": scored,
        "prefill_tokens_expected": computed,
    }
    if calibrate:
        steps: list[StepMetrics] = []
        list(engine.stream(sample[:1]))  # warm-up
        engine.add_step_callback(steps.append)
        list(engine.stream(sample))
        tokens, seconds = sum(s.num_prefill_tokens for s in steps), sum(s.step_time for s in steps)
        rate = tokens / seconds if tokens and seconds else 0.0  # 0: the sample's rows all failed in the engine
        report["calibration"] = {"requests": len(sample), "prefill_tokens_per_s": round(rate, 1)}
        report["estimated_time_s"] = round(computed / rate, 1) if rate else None
        calibrated = tokens + len(sample[0].prompt_token_ids)  # the warm-up's prompt, then the sample's steps
        report["peak_rss_bytes_predicted"] = predicted_peak_rss(engine, computed, len(lengths), calibrated)
    return report


def _lora_report(rows: LoraCounts | None) -> dict:
    """With engine.lora: the rows each adapter and the base model will run (as _summary.json's lora counts them)."""
    return {} if rows is None else {"lora_rows": rows.rows_by_adapter()}


def measure(engine: JobEngine, sample: list[Work]) -> dict:
    steps: list[StepMetrics] = []
    warm_params = sample[0].params.model_copy(update={"max_tokens": 2})
    warm_up = engine.generate([sample[0].token_ids[:8]], warm_params, use_tqdm=False)[0]
    engine.add_step_callback(steps.append)
    requests = [
        dataclasses.replace(
            request,
            params=w.params.model_copy(update={"max_tokens": min(w.params.max_tokens, CALIBRATION_MAX_TOKENS)}),
        )
        for w in sample
        if (request := _request(w)) is not None
    ]
    by_id = {w.request_id: w for w in sample}
    outputs = list(engine.stream(requests))
    prefill = [s for s in steps if s.num_prefill_tokens]
    decode = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    # A request cut by the calibration's cap is assumed to run to its own max_tokens.
    lengths = [
        len(o.token_ids) if o.finish_reason == "stop" else max_output_tokens(engine, by_id[o.request_id])
        for o in outputs
    ]
    prefill_time = sum(s.step_time for s in prefill)
    return {
        "kv_tokens_written": sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
        + len(warm_up.prompt_token_ids)
        + len(warm_up.token_ids),
        "requests": len(sample),
        "prefill_tokens_per_s": round(sum(s.num_prefill_tokens for s in prefill) / prefill_time, 1)
        if prefill_time
        else 0.0,
        "decode_step_s": round(statistics.fmean(s.step_time for s in decode), 5) if decode else 0.0,
        "decode_batch_size": round(statistics.fmean(s.num_seqs for s in decode), 1) if decode else 0,
        "mean_output_tokens": statistics.fmean(lengths),
    }


def predicted_peak_rss(engine: JobEngine, kv_tokens: int, requests: int, calibration_kv_tokens: int) -> int | None:
    """The run's peak resident memory, from this process's, whose engine has loaded and calibrated: the larger of
    its peak so far (the model's load) and its memory now, less the K/V pages the calibration wrote, plus what the
    largest step adds at its peak, plus the K/V pages the run writes: its `kv_tokens`, each of its `requests`' last
    block whole, at most the pool (mapped lazily, a page resident once written). None where it cannot be measured
    (not a CPU, no /proc)."""
    loaded_peak, now = peak_rss(), resident_bytes()
    step = engine.largest_step_host_bytes()
    if loaded_peak is None or now is None or step is None:
        return None
    block = engine.config.block_size
    written = min(kv_tokens + requests * block, engine.num_kv_blocks * block)
    return max(loaded_peak, now + step + (written - calibration_kv_tokens) * engine.kv_bytes_per_token)


def _request(work: Work) -> Request | None:
    """A work's request with its image read; None where the image no longer reads (the run fails that row)."""
    try:
        return work.request
    except RowError:
        return None


def _prompt_token_stats(lengths) -> dict:
    """The requests' prompt tokens: their total, median and 99th percentile."""
    ordered = sorted(lengths)
    return {
        "prompt_tokens_total": sum(ordered),
        "prompt_tokens_p50": ordered[len(ordered) // 2],
        "prompt_tokens_p99": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)],
    }
