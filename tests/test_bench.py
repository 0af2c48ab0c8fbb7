"""bench: a job file's rows as the workload, the token-budget sweep and the bf16 quality report (tiny, on the real
model); `--task embed` on all-MiniLM-L6-v2 against sentence-transformers, and its texts; `--task score` against
transformers (its counts and logprob alignment) and vLLM's prompt_logprobs as read; llama.cpp's llama-server as a
peer (its command, requests and counts; a real run where its build is cached) and the host CPU the report names."""

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from batchjob import cli
from batchjob.bench import llama_server, quality, scoring
from batchjob.bench.compare import LlamaServerOptions, run_bench, run_sweep
from batchjob.bench.measure import agreement
from batchjob.bench.quality import continuation_nll, divergence, run_quality
from batchjob.bench.scoring import run_score_bench, vllm_logprobs
from batchjob.bench.systems import load_hf_model
from batchjob.bench.tables import format_quality, format_report, format_score
from batchjob.bench.workloads import DOCUMENTS, EMBED_CHARS, document_workload, embed_texts, job_workload, synthetic
from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.exit_codes import EXIT_OK, EXIT_USAGE
from batchjob.job.input.prompt import PromptBuilder
from batchjob.job.input.reader import InputSource
from batchjob.job.spec import load_job
from batchjob.model.cpu_features import cpu_kind, describe_cpu
from tests.fakes import FakeEngine
from tests.helpers import REPO, documents, make_job, write_jsonl


def test_a_job_workload_is_its_rows_as_the_runner_sends_them(tmp_path):
    rows = documents(10) + [{"id": "bad", "title": "t", "source": "s", "text": None}]
    job = make_job(
        write_jsonl(tmp_path / "docs.jsonl", rows),
        tmp_path / "out",
        sampling={"max_tokens": 7},
        prompt={"system": "Be brief.", "template": "Reverse: {text}"},
    )
    engine = FakeEngine()
    workload = job_workload(job, engine)
    builder = PromptBuilder(job, engine.tokenizer, engine.max_model_len)
    expected = sorted(builder.build(row, 7)[0] for row in InputSource(job).rows() if row.values.get("text"))
    assert sorted(r.prompt_token_ids for r in workload.requests) == expected and len(expected) == 10
    assert {r.params.max_tokens for r in workload.requests} == {7}
    assert "11 rows, 10 requests (1 rows fail before the model)" in workload.name
    assert len(job_workload(job, engine, num_rows=4).requests) == 4


def test_the_sweep_runs_each_fixed_budget_and_auto_from_a_cold_cache():
    engine = Engine("smollm2-135m-instruct", max_num_batched_tokens="auto", num_kv_blocks=64)
    workload = synthetic(engine.model_config.vocab_size, 4, 48, 3)
    report = run_sweep(engine, workload, [64, 128], repeats=1)
    rows = {r["system"]: r for r in report["systems"]}
    assert list(rows) == ["budget 64", "budget 128", "budget auto"]
    assert rows["budget 64"]["token_budget"] == 64 and rows["budget auto"]["token_budget"] in (128, 256)
    assert max(r["ratio_to_best_fixed"] for r in report["systems"][:2]) == 1.0
    assert report["auto_ratio"] == rows["budget auto"]["ratio_to_best_fixed"] and len(report["auto_tuner"]) == 1
    # Every run computes its prompts: none is served from the previous run's prefix cache.
    assert all(r["prefix_hit_rate"] == 0 and r["prefill_tokens"] >= workload.prompt_tokens for r in rows.values())


def test_the_fixed_batch_is_split_to_what_the_kv_pool_holds():
    # 6 blocks of 16: a padded row of 40 + 3 tokens takes 3 blocks, so a batch of 4 runs as two batches of 2.
    engine = Engine("smollm2-135m-instruct", num_kv_blocks=6)
    workload = synthetic(engine.model_config.vocab_size, 4, 40, 3)
    report = run_bench(engine, None, workload, ["engine", "static"], batch_size=4, repeats=1, threads=1)
    rows = {r["system"]: r for r in report["systems"]}
    assert rows["static"]["max_batch"] == 2 and rows["static"]["output_tokens"] == 12
    assert "batch 4 split to <= 2 rows" in rows["static"]["note"]
    # The table says each system's dtype and the format its weights were read from.
    dtype = str(engine.dtype).removeprefix("torch.")
    assert rows["engine"]["note"] == f"{dtype}, weights Q4_1, Q8_0 dequantized to {dtype}"
    assert "split to <= 2 rows" in format_report(report)
    assert engine.block_manager.num_free_blocks == 6


def test_agreement_counts_equal_outputs_and_where_the_others_part():
    ours = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}
    theirs = {"a": [1, 2, 3], "b": [4, 9, 6], "c": [7, 8, 2]}
    assert agreement(ours, theirs) == {"equal": 1, "total": 3, "first_difference_at": [1, 2]}


def test_unconstrained_peer_runs_the_same_requests_at_the_same_lengths():
    engine = Engine("smollm2-135m-instruct", num_kv_blocks=64, max_num_batched_tokens=64)
    workload = synthetic(engine.model_config.vocab_size, 2, 16, 6)
    workload.requests[0].params = SamplingParams(max_tokens=6, regex=r"[a-z]{1,4}( [a-z]{1,4}){0,3}")
    # One constrained request, one free: the peer runs both at the engine's lengths.
    report = run_bench(engine, None, workload, ["unconstrained", "engine"], batch_size=4, repeats=1, threads=1)
    rows = {r["system"]: r for r in report["systems"]}
    assert list(rows) == ["unconstrained", "engine"]
    assert rows["engine"]["output_tokens"] == rows["unconstrained"]["output_tokens"] > 0
    c = report["constrained"]
    assert c["requests"] == 1 and c["total"] == 2 and c["ratio"] > 0 and c["cpu_ratio"] > 0
    assert len(c["round_ratios"]) == 1 and 0 < c["constraint_share"] < 1
    assert "agreement" not in report or "unconstrained" not in report["agreement"]
    assert f"engine runs at {c['ratio']:.2f}x" in format_report(report)
    assert "engine at" in rows["unconstrained"]["note"]
    free = synthetic(engine.model_config.vocab_size, 1, 8, 1)
    report = run_bench(engine, None, free, ["engine", "unconstrained"], batch_size=4, repeats=1, threads=1)
    assert "no request of the workload has an output constraint" in report["skipped"]["unconstrained"]


def test_each_round_is_reported_and_the_median_round_is_the_figure():
    engine = Engine("smollm2-135m-instruct", num_kv_blocks=32, max_num_batched_tokens=64)
    workload = synthetic(engine.model_config.vocab_size, 2, 16, 2)
    report = run_bench(engine, None, workload, ["engine", "static"], batch_size=2, repeats=3, threads=1)
    for row in report["systems"]:
        assert len(row["round_walls"]) == 3 and sorted(row["round_walls"])[1] == row["wall"]
    walls = ", ".join(f"{w:.1f}" for w in report["systems"][0]["round_walls"])
    assert f"wall time of each round (s): engine {walls}; static" in format_report(report)


def test_the_decode_roofline_counts_the_kv_that_decode_steps_read():
    engine = Engine("smollm2-135m-instruct", num_kv_blocks=32, max_num_batched_tokens=64)
    report = run_bench(engine, None, synthetic(engine.model_config.vocab_size, 2, 40, 6), ["engine"], 2, 1, 1)
    decode, [row] = report["roofline"]["decode"], report["systems"]
    pool_bytes = 32 * engine.config.block_size * engine.kv_bytes_per_token
    assert row["decode_steps"] >= 4 and 0 < row["decode_kv_usage"] <= row["decode_steps"]
    assert decode["kv_gb_per_step"] * 1e9 == pytest.approx(row["decode_kv_usage"] * pool_bytes / row["decode_steps"])
    assert decode["read_gb_per_s"] > 0.1 and 0 < decode["bound_fraction"] < 5
    assert "roofline decode: " in format_report(report) and "with its KV reads (" in format_report(report)


def test_divergence_gives_the_first_differences_quartiles_and_histogram():
    ours = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7] * 20, "d": [8] * 20}
    theirs = {"a": [1, 2, 3], "b": [4, 9, 6], "c": [7] * 9 + [0], "d": [8] * 17 + [0]}
    d = divergence(ours, theirs)
    assert (d["equal"], d["total"], d["first_difference_at"]) == (1, 4, [1, 9, 17])
    assert d["quartiles"] == [5, 9, 13] and d["histogram"] == {"0-7": 1, "8-15": 1, "16-23": 1}


def test_quality_scores_the_fp32_continuations_with_each_engines_own_forward(monkeypatch):
    """The real quality path on 2 summarize rows, 8 tokens each: the engine's teacher-forced NLL equals transformers'
    in fp32, the fp32 engine's greedy tokens equal transformers' (the exact mode), and the report holds each pair."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)  # the job file's input path is relative to the repository root
    job = load_job("jobs/summarize.yaml", ["sampling.max_tokens=8"])
    fp32, bf16 = (Engine(job.model, dtype=d, num_kv_blocks=256) for d in ("float32", "bfloat16"))
    wl = job_workload(job, fp32, 2)
    report = run_quality(fp32, bf16, wl, batch_size=2)
    nll = report["nll"]
    assert [nll["fp32"]["dtype"], nll["bf16"]["dtype"]] == ["float32", "bfloat16"]
    assert all(0 < v["mean_nll"] < 10 and 2 <= v["tokens"] <= 16 for v in nll.values())
    assert report["nll_relative_difference"] == pytest.approx(nll["bf16"]["mean_nll"] / nll["fp32"]["mean_nll"] - 1)
    assert report["nll_passed"] == (abs(report["nll_relative_difference"]) <= 0.01)
    pairs = report["divergence"]
    assert list(pairs) == [
        "engine bf16 vs engine fp32",
        "engine bf16 vs hf bf16",
        "hf bf16 vs hf fp32",
        "engine fp32 vs hf fp32",
    ]
    assert pairs["engine fp32 vs hf fp32"]["equal"] == 2  # the exact mode, token for token
    assert all(p["total"] == 2 and p["equal"] + len(p["first_difference_at"]) == 2 for p in pairs.values())
    # The scorer against transformers' own teacher-forced log-probabilities of the same continuations, in fp32.
    continuations = {o.request_id: o.token_ids for o in fp32.stream(wl.requests)}
    hf = load_hf_model(fp32, fp32.model_path)
    hf_total = 0.0
    for r in wl.requests:
        ids = r.prompt_token_ids + continuations[r.request_id]
        with torch.inference_mode():
            logp = hf(torch.tensor([ids])).logits[0, len(r.prompt_token_ids) - 1 : -1].float().log_softmax(-1)
        hf_total -= logp.gather(1, torch.tensor(continuations[r.request_id])[:, None]).sum().item()
    assert continuation_nll(fp32, wl, continuations)["nll"] == pytest.approx(hf_total, rel=1e-4)
    text = format_quality(report)
    assert "mean NLL per token, bf16 engine" in text and ("PASS" in text or "FAIL" in text)
    assert "greedy engine fp32 vs hf fp32" in text and "2/2 equal throughout" in text


@pytest.mark.parametrize("weights", ["w8a8", "int8", "int4"])
def test_quality_with_weights_sets_that_engine_against_fp32(monkeypatch, weights):
    """`--weights w8a8` (or weight-only int8, int4): that engine (float32 otherwise: its matmuls the one change)
    scores the fp32 continuations, named by its weights in the report; transformers left out here (the test above
    runs it)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(quality, "peer_status", lambda: {"hf": "left out in this test"})
    job = load_job("jobs/summarize.yaml", ["sampling.max_tokens=8"])
    fp32, other = (Engine(job.model, dtype="float32", weights=w, num_kv_blocks=256) for w in ("dequantize", weights))
    report = run_quality(fp32, other, job_workload(job, fp32, 2), batch_size=2)
    assert report["label"] == weights and list(report["nll"]) == ["fp32", weights]
    assert report["dtypes"][weights]["weights"] == weights and "weights" not in report["dtypes"]["fp32"]
    assert all(0 < v["mean_nll"] < 10 for v in report["nll"].values())
    assert list(report["divergence"]) == [f"engine {weights} vs engine fp32"]
    assert f"{weights} vs fp32 NLL" in format_quality(report)


def test_bench_quality_takes_weights_int8_int4_or_w8a8_only():
    result = CliRunner().invoke(cli.main, ["bench", "--quality", "--weights", "dequantize"])
    assert result.exit_code == EXIT_USAGE
    assert "--weights int8, int4 or w8a8 sets that engine against fp32" in result.output
    assert "Traceback" not in result.output


def test_embed_texts_are_cut_on_word_boundaries_to_40_to_1200_characters_the_same_each_time():
    texts = embed_texts(300, path=REPO / "sample_data" / "documents.parquet")
    lengths = [len(t) for t in texts]
    assert len(texts) == 300 and EMBED_CHARS == (40, 1200)
    assert min(lengths) >= 40 and max(lengths) <= 1200
    assert max(lengths) - min(lengths) > 800  # mixed lengths, not one size
    assert len(set(texts)) > 250  # rows reused (244 documents) at other lengths
    assert all(t == t.strip() and not t[-1].isspace() for t in texts)
    assert texts == embed_texts(300, path=REPO / "sample_data" / "documents.parquet")
    assert texts != embed_texts(300, seed=1, path=REPO / "sample_data" / "documents.parquet")


def test_bench_task_embed_compares_the_embedder_with_sentence_transformers(minilm, tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers", reason="the test extra's sentence-transformers")
    monkeypatch.chdir(REPO)  # the texts' documents, as from a checkout
    args = ["bench", "--task", "embed", "--model", str(minilm), "--num-prompts", "24", "--repeats", "1"]
    result = CliRunner().invoke(cli.main, [*args, "--json", str(tmp_path / "embed.json")])
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads((tmp_path / "embed.json").read_text())
    rows = {r["system"]: r for r in report["systems"]}
    assert list(rows) == ["embedder", "st batch 32", "st batch 64"]
    assert all(r["total_tokens_per_s"] > 0 and r["num_requests"] == 24 for r in rows.values())
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1  # every system credited with the same tokens
    assert rows["embedder"]["ratio_to_embedder"] == 1.0
    for name in ("st batch 32", "st batch 64"):
        ratio = rows[name]["total_tokens_per_s"] / rows["embedder"]["total_tokens_per_s"]
        assert rows[name]["ratio_to_embedder"] == pytest.approx(ratio)
        assert report["cosine"][name]["min"] >= 0.999
    table = result.stdout
    assert all(name in table for name in rows) and "1.00x" in table and "input tok/s" in table
    # min 0.99... in bf16 (a host with native bf16), 1.00000 in float32 (the default elsewhere)
    assert re.search(r"cosine of the embedder's embeddings to st batch 64's: min (0\.99|1\.00)", table)


def test_bench_task_embed_wants_a_sentence_transformers_folder(tmp_path):
    result = CliRunner().invoke(cli.main, ["bench", "--task", "embed", "--model", str(tmp_path)])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.strip() == f"error: {tmp_path} is not a sentence-transformers folder: it has no modules.json"


# -- --task score -----------------------------------------------------------------------------------------------
TINY = {"load_format": "dummy", "dtype": "float32"}  # tiny-llama's seeded weights: transformers draws the same


def test_score_bench_credits_each_rows_tokens_after_its_first_and_matches_transformers_per_token():
    """Rows of 2 to 61 random tokens, the engine at a 32-token budget (rows chunked and packed) against transformers
    at each batch size (rows of other lengths padded together): every system scores each row's tokens after its
    first, and the logprobs agree token for token to fp32's rounding (read one position off, they differ by ~2)."""
    pytest.importorskip("transformers")
    engine = Engine("tiny-llama", **TINY, num_kv_blocks=64, max_num_batched_tokens=32)
    vocab = engine.model_config.vocab_size
    rows = [[(7 * n + 13 * k) % vocab for k in range(n)] for n in (2, 9, 40, 23, 61)]
    report = run_score_bench(engine, engine.model_path, rows, "five rows", ["engine", "hf"], None, 1)
    scored = 1 + 8 + 39 + 22 + 60
    assert report["scored_tokens"] == scored and report["prompt_tokens"] == scored + 5 and report["rows"] == 5
    systems = {r["system"]: r for r in report["systems"]}
    assert list(systems) == ["engine", "hf batch 1", "hf batch 4", "hf batch 5"]  # 16 and 64: all five rows at once
    assert report["hf_batches"]["tried"] == [1, 4, 5] and report["hf_batches"]["best"] in systems
    for row in systems.values():
        assert row["scored_tokens"] == scored and row["scored_tokens_per_s"] == pytest.approx(scored / row["wall"])
        assert row["engine_ratio"] == pytest.approx(row["wall"] / systems["engine"]["wall"])
    assert report["engine_ratio"]["hf"] == pytest.approx(systems[report["hf_batches"]["best"]]["engine_ratio"])
    assert systems["engine"]["note"].startswith("float32, Engine.score, packed into its token budget (32)")
    assert "float32, sorted by length, right-padded per batch" in systems["hf batch 4"]["note"]
    for name in ("hf batch 1", "hf batch 4", "hf batch 5"):
        d = report["exactness"][name]
        assert d["rows"] == 5 and d["max_abs"] <= 1e-5 and 0 <= d["mean_abs"] <= d["max_abs"]
    text = format_score(report)
    assert f"{scored} scored tokens (each row's tokens after its first) in 5 rows" in text
    assert "transformers' batch sizes tried: 1, 4, 5" in text and "engine's scored tokens/s: " in text
    assert "logprobs of hf batch 4 against the engine's over 5 rows: max |difference| " in text
    assert f"host CPU: {describe_cpu(cpu_kind())}" in text
    # the floor: the decoder's matmuls for every prompt token and the head's for every scored one, at this run's rate
    c, floor = engine.model_config, report["floor"]
    per_token = 2 * sum(lin.shape.numel() for i in range(c.num_hidden_layers) for lin in engine.model.linears(i))
    assert floor["flops"] == per_token * (scored + 5) + 2 * c.vocab_size * c.hidden_size * scored
    assert floor["seconds"] == pytest.approx(floor["flops"] / (floor["matmul_gflops"] * 1e9)) and floor["rows"] == 32
    assert floor["engine_over_floor"] == pytest.approx(systems["engine"]["wall"] / floor["seconds"])
    assert f"the engine took {floor['engine_over_floor']:.2f}x it" in text


def test_score_bench_with_labels_scores_each_label_after_each_row_and_matches_transformers():
    """--labels: the engine scores each row's labels on its cached prompt (Engine.score's labels), transformers each
    row and label as one sequence, its head on the label's positions only; every system is credited with the labels'
    tokens, and each label's summed logprob agrees to fp32's rounding."""
    pytest.importorskip("transformers")
    engine = Engine("tiny-llama", **TINY, num_kv_blocks=64, max_num_batched_tokens=32)
    vocab = engine.model_config.vocab_size
    rows = [[(7 * n + 13 * k) % vocab for k in range(n)] for n in (3, 20, 41)]
    labels = [[5], [6, 7], [8, 9, 10], [11]]
    report = run_score_bench(engine, engine.model_path, rows, "labels", ["engine", "hf"], None, 1, labels)
    assert report["scored_tokens"] == 3 * 7 and report["labels"] == 4 and report["rows"] == 3
    assert report["hf_batches"]["tried"] == [1, 4, 12]  # 12 sequences: each row with each label
    for name in ("hf batch 1", "hf batch 4", "hf batch 12"):
        d = report["exactness"][name]
        assert d["rows"] == 12 and d["max_abs"] <= 1e-4, (name, d)
    ours = engine.score(rows, labels=labels, use_tqdm=False)
    alone = engine.score([r + label for r in rows for label in labels], use_tqdm=False)  # each sequence scored whole
    for i, out in enumerate(ours):
        for j, label in enumerate(labels):
            whole = alone[i * len(labels) + j].token_logprobs[-len(label) :]
            assert out.label_logprobs[j] == pytest.approx(sum(t.logprob for t in whole), abs=1e-4)
    c = engine.model_config
    per_token = 2 * sum(lin.shape.numel() for i in range(c.num_hidden_layers) for lin in engine.model.linears(i))
    assert report["floor"]["flops"] == per_token * (64 + 3 * 7) + 2 * c.vocab_size * c.hidden_size * 21
    assert "each row's labels on its cached prompt" in report["systems"][0]["note"]
    assert "21 scored tokens (4 labels a row) in 3 rows of 64 tokens" in format_score(report)


def test_score_bench_gives_vllm_room_for_the_longest_sequence_and_the_one_token_it_draws(monkeypatch):
    """vLLM scores with max_tokens=1 (its least): a max_model_len of the longest row alone refused every row of that
    length (64 x 256 random tokens: 'the decoder prompt (length 256) plus ... is longer than ... 256')."""
    engine = Engine("smollm2-135m-instruct", dtype="float32", num_kv_blocks=64)  # real weights: dummy ones skip vLLM
    asked = []

    def load_vllm(engine, model_path, longest, dtype=None):
        asked.append(longest)
        raise RuntimeError("loaded")

    monkeypatch.setattr(scoring, "peer_status", lambda: {})  # as where vLLM is installed
    monkeypatch.setattr(scoring, "load_vllm", load_vllm)
    rows = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    for labels, longest in ((None, 6), ([[11, 12], [13]], 8)):
        with pytest.raises(RuntimeError, match="^loaded$"):
            run_score_bench(engine, engine.model_path, rows, "two", ["vllm"], None, 1, labels)
        assert asked.pop() == longest + 1


def test_transformers_batch_sizes_whose_padded_batches_outgrow_the_bound_are_not_tried(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(scoring, "HF_MAX_PADDED", 100)
    engine = Engine("tiny-llama", **TINY, num_kv_blocks=64)
    rows = [[5] * 30, [6] * 20, [7] * 40, [8] * 10]  # sorted: 10, 20, 30, 40; at 4 a batch pads to 4 x 40
    report = run_score_bench(engine, engine.model_path, rows, "four rows", ["hf"], None, 1)
    assert report["hf_batches"]["tried"] == [1] and report["hf_batches"]["left_out"] == {4: 160}
    assert "batch 4 not tried: its largest padded batch holds 160 tokens (over 100)" in format_score(report)
    assert report["exactness"] == {} and "hf" not in report["engine_ratio"]  # no engine in the run: no ratio


def test_a_system_that_scores_other_tokens_than_each_rows_after_its_first_stops_the_bench(monkeypatch):
    pytest.importorskip("transformers")
    engine = Engine("tiny-llama", **TINY, num_kv_blocks=64)
    real = scoring.hf_logprobs
    monkeypatch.setattr(scoring, "hf_logprobs", lambda *args: [lp[:-1] for lp in real(*args)])
    with pytest.raises(RuntimeError, match=r"^hf batch 2 handed back 6 logprobs in 2 rows; the workload scores 8 "):
        run_score_bench(engine, engine.model_path, [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]], "two", ["engine", "hf"], 2, 1)


def test_the_documents_are_read_whole_and_cut_at_the_context():
    engine = Engine("tiny-llama", **TINY, num_kv_blocks=8)
    path = REPO / DOCUMENTS
    wl = document_workload(engine, 1000, path)
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    assert len(wl.requests) == len(texts) == 244 and wl.name == f"244 documents of {path}"
    lengths = [len(r.prompt_token_ids) for r in wl.requests]
    assert max(lengths) == engine.max_model_len == 1024 and min(lengths) > 10
    assert wl.requests[5].prompt_token_ids == engine.tokenizer.encode(texts[5])[:1024]
    assert len(document_workload(engine, 3, path).requests) == 3


def test_vllm_prompt_logprobs_are_read_at_each_prompt_tokens_own_id():
    """vLLM's layout: None at the first prompt token, then {token id: Logprob} a position holding the prompt's own
    token (and, at prompt_logprobs=0, maybe the likeliest one beside it)."""
    ids = [5, 9, 9, 2]
    lp = lambda v: SimpleNamespace(logprob=v, rank=1)  # noqa: E731 - vllm.logprobs.Logprob's fields
    prompt_logprobs = [None, {9: lp(-0.5), 5: lp(-0.1)}, {9: lp(-1.5)}, {2: lp(-2.5), 9: lp(-0.2)}]
    assert vllm_logprobs(prompt_logprobs, ids).tolist() == [-0.5, -1.5, -2.5]
    for wrong in (prompt_logprobs[1:], [{5: lp(0.0)}, *prompt_logprobs[1:]], None):
        with pytest.raises(RuntimeError, match="vllm: prompt_logprobs of"):
            vllm_logprobs(wrong, ids)


def test_bench_task_score_on_random_tokens_through_the_cli(tmp_path):
    """--input-len scores random tokens; --batch-size is transformers' one batch; the JSON holds what the table
    says."""
    pytest.importorskip("transformers")
    args = ["bench", "--task", "score", "--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32"]
    args += ["--input-len", "24", "--num-prompts", "3", "--batch-size", "2", "--repeats", "2"]
    args += ["--json", str(tmp_path / "score.json")]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads((tmp_path / "score.json").read_text())
    assert report["workload"].startswith("score: random in=24") and report["scored_tokens"] == 3 * 23
    assert [r["system"] for r in report["systems"]] == ["engine", "hf batch 2"]
    assert all(len(r["round_walls"]) == 2 for r in report["systems"])
    assert report["exactness"]["hf batch 2"]["max_abs"] <= 1e-5
    ratio = report["engine_ratio"]["hf"]
    assert f"engine's scored tokens/s: {ratio:.2f}x transformers' at its best batch (hf batch 2)" in result.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quality"], "error: bench --task score: --quality: for --task generate only"),
        (["--systems", "engine,static"], "error: bench --task score: unknown systems ['static'] (expected engine, "),
        (["--range-ratio", "0.5"], "error: bench --task score: --range-ratio and --prefix-len shape random prompts"),
        (["--input-len", "1"], "error: bench --task score: no row of the workload has the 2 tokens or more"),
        (["--labels", "yes,,no"], "error: bench --labels 'yes,,no': a comma list of non-empty labels expected"),
        (["--task", "generate", "--labels", "yes,no"], "error: bench --labels: for --task score only"),
    ],
)
def test_bench_task_score_refuses_what_does_not_apply(extra, message):
    args = ["bench", "--task", "score", "--model", "tiny-llama", "--load-format", "dummy", "--systems", "engine"]
    result = CliRunner().invoke(cli.main, [*args, *extra])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.strip().startswith(message)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (docs/benchmarks.md)")
def test_vllm_scores_the_same_rows_as_the_engine():
    """A real vLLM in fp32 on two random rows: its prompt logprobs, read at each row's tokens after its first, equal
    the engine's to fp32's rounding."""
    engine = Engine("smollm2-135m-instruct", dtype="float32", num_kv_blocks=64)
    rows = [r.prompt_token_ids for r in synthetic(engine.model_config.vocab_size, 2, 40, 1).requests]
    report = run_score_bench(engine, engine.model_path, rows, "two rows", ["engine", "vllm"], None, 1)
    assert [r["system"] for r in report["systems"]] == ["engine", "vllm"] and not report["skipped"]
    assert report["exactness"]["vllm"]["rows"] == 2 and report["exactness"]["vllm"]["max_abs"] <= 1e-3


# -- llama.cpp's llama-server --------------------------------------------------------------------------------------
ZEN3_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
"""


def test_the_host_cpu_is_named_with_the_isa_flags_that_decide_kernels():
    kind = cpu_kind(ZEN3_CPUINFO)
    assert (kind["vendor"], kind["model_name"], kind["family"], kind["model"]) == (
        "AuthenticAMD",
        "AMD EPYC 7B13",
        "25",
        "1",
    )
    assert kind["flags"]["avx2"] and kind["flags"]["fma"]
    assert not any(kind["flags"][f] for f in ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"))
    assert describe_cpu(kind) == (
        "AMD EPYC 7B13 (AuthenticAMD family 25 model 1): avx2 fma; no avx512f avx512_bf16 avx512_vnni avx_vnni "
        "amx_bf16 amx_int8"
    )
    here = cpu_kind()
    assert set(here["flags"]) == set(kind["flags"]) and here["model_name"]


def test_an_emulated_avx2_host_builds_llama_cpp_for_avx2_in_a_folder_of_its_own(monkeypatch):
    monkeypatch.delenv("BATCHJOB_CPU_ISA", raising=False)
    native, native_folder = llama_server.cmake_flags(), llama_server.build_folder()
    assert "-DGGML_NATIVE=ON" in native and llama_server.build_label() == "GGML_NATIVE"
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "avx2")
    flags = llama_server.cmake_flags()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags and "-DGGML_NATIVE=ON" not in flags
    assert not any("AVX512" in f for f in flags) and llama_server.build_label() == "built for AVX2"
    assert llama_server.build_folder() != native_folder


def test_llama_server_runs_n_slots_each_with_room_for_the_longest_request_and_is_sent_each_request_as_token_ids():
    cmd = llama_server.server_command(Path("/b/llama-server"), Path("/m/x.gguf"), 8123, slots=64, threads=2, ctx=4096)
    args = " ".join(cmd[1:])
    assert cmd[0] == "/b/llama-server" and "-m /m/x.gguf" in args and "--port 8123" in args
    assert "-np 64 -cb -c 4096 -t 2 -tb 2" in args
    wl = synthetic(1000, 3, 20, 5, range_ratio=0.5)
    longest = max(len(r.prompt_token_ids) + r.params.max_tokens for r in wl.requests)
    assert llama_server.context_size(wl, 4) == 4 * longest
    body = llama_server.completion_body(Request("a", [5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True)))
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 9,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "return_tokens": True,
        "stream": False,
    }
    assert llama_server.completion_body(Request("b", [1], SamplingParams(max_tokens=2)))["ignore_eos"] is False
    # The counts are the server's own: the prompt as it took it, the tokens it generated.
    answer = {"content": "hi", "tokens": [11, 12], "tokens_evaluated": 3, "tokens_predicted": 2, "stop": True}
    assert llama_server.parse_completion(answer) == llama_server.Completion(3, 2, [11, 12])


def test_the_llama_cpp_build_is_cached_per_cpu_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    folder = llama_server.build_folder()
    assert folder.parent == tmp_path / "llama-cpp" and folder.name.startswith(f"{llama_server.VERSION}-")
    assert llama_server.cached_binary() is None  # nothing built in an empty cache
    folder.mkdir(parents=True)
    (folder / "llama-server").write_text("#!/bin/sh\n")
    assert llama_server.cached_binary() is None  # not executable: not a whole build
    (folder / "llama-server").chmod(0o755)
    assert llama_server.cached_binary() == folder / "llama-server"
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: "flags : avx2 fma")  # -march=native code is per CPU
    assert llama_server.build_folder() != folder and llama_server.cached_binary() is None
    # and per CPU model: -march=native reads more of the CPU than its flags line
    flagged = llama_server.build_folder()
    other = {**llama_server.cpu_kind(), "model": "-1"}
    monkeypatch.setattr(llama_server, "cpu_kind", lambda: other)
    assert llama_server.build_folder() != flagged


def test_llama_cpp_is_built_without_its_amx_matmul_which_faults_on_a_xeon_with_amx():
    for flags in (llama_server.CMAKE_FLAGS, llama_server.cmake_flags()):
        for lang in ("C", "CXX"):
            assert f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags


def test_bench_refuses_a_quant_type_llama_quantize_is_not_asked_for(tmp_path):
    result = CliRunner().invoke(cli.main, ["bench", "--systems", "engine,llama-server", "--requantize", "Q9_9"])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.strip().startswith("error: bench --requantize Q9_9: not one of Q8_0, ")


@pytest.mark.slow
@pytest.mark.skipif(
    llama_server.cached_binary() is None or llama_server.cached_binary("llama-quantize") is None,
    reason="llama.cpp's llama-server is not built in the cache (the first `batchjob bench --systems llama-server` "
    "builds it, minutes)",
)
def test_llama_server_counts_the_workloads_tokens_beside_the_engine():
    """A real llama-server on the engine's GGUF, 4 slots for 6 requests, then on it requantized to Q8_0: the server
    counts exactly the workload's prompt tokens and max_tokens each (ignore_eos), as the engine's row does, and the
    report says what each side ran on which CPU."""
    engine = Engine("smollm2-135m-instruct", num_kv_blocks=64)
    wl = synthetic(engine.model_config.vocab_size, 6, 40, 7, range_ratio=0.5)
    outputs = sum(r.params.max_tokens for r in wl.requests)
    for quant, weights in ((None, "weights Q4_1, Q8_0"), ("Q8_0", "weights Q8_0 (requantized from Q4_1, Q8_0)")):
        llama = LlamaServerOptions(slots=4, requantize=quant)
        report = run_bench(engine, engine.model_path, wl, ["engine", "llama-server"], 4, 1, 2, llama)
        rows = {r["system"]: r for r in report["systems"]}
        assert not report["skipped"]
        for row in rows.values():
            assert (row["prompt_tokens"], row["output_tokens"], row["num_requests"]) == (wl.prompt_tokens, outputs, 6)
        assert "4 slots" in rows["llama-server"]["note"] and rows["llama-server"]["note"].endswith(weights)
        assert report["agreement"]["llama-server"]["total"] == 6
        assert report["cpu"] == cpu_kind()
        text = format_report(report)
        assert f"host CPU: {describe_cpu(cpu_kind())}" in text and "llama-server" in text


def test_dummy_weights_written_by_llama_cpps_converter_load_back_as_the_very_same_weights():
    """bench --gguf: the dummy draw exported, written as a BF16 GGUF by llama.cpp's own convert_hf_to_gguf.py (from
    the pinned sdist) in a child process, and read back by the loader: every matrix equals the draw rounded to bf16
    (q and k un-permuted), every 1-D weight the draw itself (the converter keeps them float32), so the engine and
    llama-server run the weights vLLM reads from the HF export."""
    pytest.importorskip("sentencepiece")
    from batchjob.bench.gguf_export import dummy_gguf_apart
    from batchjob.model.dummy import load_dummy
    from batchjob.model.loader import load_model

    # SmolLM2's shape: the converter knows its tokenizer (tiny-llama's bytes it refuses)
    path = dummy_gguf_apart("smollm2-135m-instruct", 0, "BF16")
    assert path.suffix == ".gguf" and path == dummy_gguf_apart("smollm2-135m-instruct", 0, "BF16")  # cached
    drawn = load_dummy("smollm2-135m-instruct", 0).weights
    read = load_model(str(path), torch.float32).weights
    assert set(read) == set(drawn)
    for name, w in drawn.items():
        expected = w if w.dim() == 1 else w.to(torch.bfloat16).float()
        assert torch.equal(read[name], expected), name


def test_interleaved_rounds_stop_the_peers_processes_while_another_system_runs():
    """vLLM's engine core and workers poll while idle: the engine's rounds run with them stopped, vLLM's with them
    running, and they are continued whatever a round raises."""
    import subprocess
    import time

    from batchjob.bench.measure import interleaved_rounds

    def state(pid: int) -> str:
        time.sleep(0.1)  # a signal's delivery is not instant
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    peer = subprocess.Popen(["sleep", "60"])
    try:
        seen = {}

        def run(name):
            seen[name] = state(peer.pid)
            if name == "fails":
                raise RuntimeError("round failed")
            return type("R", (), {"wall": 1.0})()

        interleaved_rounds(["engine", "vllm"], 1, run)
        assert seen == {"engine": "T", "vllm": "S"}
        with pytest.raises(RuntimeError):
            interleaved_rounds(["fails", "vllm"], 1, run)
        assert seen["fails"] == "T" and state(peer.pid) == "S"
    finally:
        peer.kill()
