"""Scoring jobs (task: score) on the real SmolLM2 model in float32: a job's NLL, perplexity, per-token logprob and label
columns equal Engine.score's on the same prompts (and transformers' log_softmax on a row), through the CLI's run,
plan and status; continuation and label rows, bad and too-long rows, a stop and resume, the results cache, dedupe and
the job file's checks. Few short rows and a small context: each test takes seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from batchjob.cli import main as cli_main
from batchjob.engine.engine import Engine
from batchjob.engine.scheduler import PREFILL_CHUNK_ALIGN
from batchjob.job.cache.results_cache import ResultsCache
from batchjob.job.output.state import OutputDir
from batchjob.job.spec import CacheSpec, JobFileError, load_job
from tests.helpers import SAMPLE_DATA, write_parquet
from tests.job.test_e2e import cli, dataset, run_killed

pytestmark = pytest.mark.slow

TOL = 2e-5  # float32 sums in another order: the job packs and chunks the rows otherwise than Engine.score
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 64, "max_model_len": 256, "kv_cache_memory_gb": 0.05}
LABELS = [" positive", " negative", " neutral"]
REVIEWS = [
    "The food was wonderful and the staff were kind to us all evening.",
    "Cold soup, a rude waiter and a bill twice what we expected.",
    "It was a restaurant. We ate there on a Tuesday.",
    "Best concert of my life: the band played every song I hoped for.",
]
TEMPLATE = "Review: {text}\nThe sentiment of this review is"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("smollm2-135m-instruct", **ENGINE)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Sample documents cut to 20 to 120 words: one chunk of the budget or several."""
    docs = pq.read_table(SAMPLE_DATA / "documents.parquet", columns=["text"]).column("text").to_pylist()
    return [" ".join(doc.split()[: 20 + 25 * (i % 5)]) for i, doc in enumerate(docs[:10])]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory, texts) -> Path:
    rows = [{"id": f"t{i}", "text": t, "n": i} for i, t in enumerate(texts)]
    rows += [
        {"id": "empty", "text": "", "n": -1},
        {"id": "null", "text": None, "n": -2},
        {"id": "one-token", "text": "Hello", "n": -3},  # nothing after its first token to score
        {"id": "too-long", "text": " ".join(texts) * 3, "n": -4},
        {"id": "dup", "text": texts[0], "n": -5},  # the same prompt as t0: computed once
    ]
    return write_parquet(tmp_path_factory.mktemp("score") / "texts.parquet", rows)


def write_job(path: Path, data: Path, out: Path, **sections) -> Path:
    job = {
        "task": "score",
        "input": {"path": str(data), "passthrough": ["n"]},
        "engine": ENGINE,
        "output": {"path": str(out), "checkpoint_rows": 3},
    }
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(job.get(key), dict) else value
    path.write_text(yaml.safe_dump(job))
    return path


def batchjob(*args: str) -> Result:
    """The `batchjob` command in this process: the CLI's code without a new interpreter's imports (seconds a run)."""
    return CliRunner().invoke(cli_main, list(args))


def run(job: Path) -> dict:
    result = batchjob("run", str(job))
    assert result.exit_code == 0, result.output
    return dataset(Path(yaml.safe_load(job.read_text())["output"]["path"]))


@pytest.fixture(scope="module")
def perplexity_run(tmp_path_factory, texts_file) -> Path:
    """The job run by `batchjob run` in a process of its own, end to end."""
    tmp = tmp_path_factory.mktemp("perplexity")
    job = write_job(tmp / "job.yaml", texts_file, tmp / "out", score={"prompt_logprobs": 2})
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done: 11 rows ok, 4 failed" in result.stdout
    return tmp / "out"


def test_a_perplexity_job_writes_engine_score_columns(perplexity_run, engine, texts):
    rows = dataset(perplexity_run)
    want = engine.score(texts, prompt_logprobs=2, use_tqdm=False)
    for i, w in enumerate(want):
        row = rows[f"t{i}"]
        assert row["error"] is None and row["n"] == i and row["row_index"] == i and not row["truncated"]
        assert row["prompt_tokens"] == len(w.prompt_token_ids) and row["scored_tokens"] == w.num_scored_tokens
        got = row["token_logprobs"]
        assert len(got) == w.num_scored_tokens == len(w.prompt_token_ids) - 1
        tokens = [engine.tokenizer.decode([t.token_id], skip_special_tokens=False) for t in w.token_logprobs]
        assert [t["token"] for t in got] == tokens
        assert max(abs(g["logprob"] - t.logprob) for g, t in zip(got, w.token_logprobs)) <= TOL
        tops = [[engine.tokenizer.decode([t], skip_special_tokens=False) for t, _ in lp.top] for lp in w.token_logprobs]
        assert [[x["token"] for x in g["top_logprobs"]] for g in got] == tops
        assert row["sum_nll"] == pytest.approx(w.sum_nll, abs=TOL * len(got))
        assert row["sum_nll"] == pytest.approx(-math.fsum(g["logprob"] for g in got), abs=1e-9)
        assert row["mean_nll"] == pytest.approx(row["sum_nll"] / row["scored_tokens"])
        assert row["perplexity"] == pytest.approx(math.exp(row["mean_nll"]))
    # prefill only, and streamed: every step but the last full to within the chunk grid, whatever row ends in it
    steps = pq.read_table(perplexity_run / "_timeline.parquet").to_pylist()
    budget = ENGINE["max_num_batched_tokens"]
    assert sum(s["decode_tokens"] for s in steps) == 0 and all(s["steps"] == 1 for s in steps)
    assert sum(s["prefill_tokens"] for s in steps) == sum(len(w.prompt_token_ids) for w in want)
    assert all(budget - PREFILL_CHUNK_ALIGN < s["prefill_tokens"] <= budget for s in steps[:-1])
    # the duplicate row: the result of t0, its tokens all counted as cached (computed once)
    dup, first = rows["dup"], rows["t0"]
    assert (dup["sum_nll"], dup["token_logprobs"], dup["error"]) == (first["sum_nll"], first["token_logprobs"], None)
    assert dup["cached_tokens"] == dup["prompt_tokens"] and first["cached_tokens"] == 0


def test_a_perplexity_jobs_logprobs_equal_transformers_log_softmax(perplexity_run, engine, texts, hf_oracle):
    model, _ = hf_oracle
    rows = dataset(perplexity_run)
    for i in (0, 4):  # 20 and 120 words: one chunk of the budget, several
        ids = engine.tokenizer.encode(texts[i])
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = [ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
        got = [t["logprob"] for t in rows[f"t{i}"]["token_logprobs"]]
        assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) <= 1e-4
        assert rows[f"t{i}"]["sum_nll"] == pytest.approx(-math.fsum(want), abs=1e-4 * len(want))


def test_rows_that_cannot_be_scored_are_error_rows(perplexity_run):
    rows = dataset(perplexity_run)
    assert "missing prompt: text is empty" in rows["empty"]["error"]
    assert "missing prompt: text is missing or null" in rows["null"]["error"]
    assert "nothing to score" in rows["one-token"]["error"]
    assert "too long for the model's context of 256" in rows["too-long"]["error"]
    for key in ("empty", "null", "one-token", "too-long"):
        assert rows[key]["sum_nll"] is None and rows[key]["token_logprobs"] is None and rows[key]["n"] < 0
    summary = json.loads((perplexity_run / "_summary.json").read_text())
    assert (summary["rows_ok"], summary["rows_failed"]) == (11, 4)
    status = batchjob("status", str(perplexity_run))
    assert status.exit_code == 0 and ": done" in status.output and "15 of 15 done" in status.output


def test_truncate_right_scores_a_long_texts_start(tmp_path, engine, texts):
    data = write_parquet(tmp_path / "long.parquet", [{"id": "too-long", "text": " ".join(texts) * 3, "n": 0}])
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        prompt={"on_too_long": "truncate_right"},
        score={"prompt_logprobs": 0},
    )
    long = run(job)["too-long"]
    n = long["prompt_tokens"]
    assert long["error"] is None and long["truncated"] and 200 < n <= 256 and long["scored_tokens"] == n - 1
    # the text's start: as its first n tokens score (but the last: the cut text, encoded again, may end otherwise)
    (w,) = engine.score([engine.tokenizer.encode(" ".join(texts) * 3)[:n]], use_tqdm=False)
    got = [t["logprob"] for t in long["token_logprobs"]]
    assert got[:-1] == pytest.approx([t.logprob for t in w.token_logprobs[:-1]], abs=TOL)


def test_a_continuation_is_scored_given_the_prompt(tmp_path, engine):
    rows = [
        {"id": "paris", "text": "The capital of France is", "answer": " Paris."},
        {"id": "rome", "text": "The capital of France is", "answer": " Rome."},
        {"id": "space", "text": "A line ends here", "answer": " "},  # blank text is text to score
        {"id": "none", "text": "A question", "answer": None},
        {"id": "empty", "text": "A question", "answer": ""},
    ]
    data = write_parquet(tmp_path / "qa.parquet", rows)
    template = "Question: {text}\nAnswer:"
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        input={"passthrough": []},
        prompt={"template": template},
        score={"continuation_column": "answer", "prompt_logprobs": 0},
    )
    got = run(job)
    prompts = [template.format(text=r["text"]) for r in rows[:3]]
    want = engine.score(prompts, [r["answer"] for r in rows[:3]], use_tqdm=False)
    for r, w in zip(rows, want):
        row = got[r["id"]]
        n = len(engine.tokenizer.encode(r["answer"], add_special_tokens=False))
        assert row["error"] is None and row["scored_tokens"] == n == w.num_scored_tokens
        assert row["prompt_tokens"] == len(engine.tokenizer.encode(template.format(text=r["text"])))
        assert [t["logprob"] for t in row["token_logprobs"]] == pytest.approx(
            [t.logprob for t in w.token_logprobs], abs=TOL
        )
        assert all(t["top_logprobs"] == [] for t in row["token_logprobs"])
        assert row["sum_nll"] == pytest.approx(w.sum_nll, abs=TOL * n)
    assert got["paris"]["sum_nll"] < got["rome"]["sum_nll"]
    assert "missing continuation: answer is missing or null" in got["none"]["error"]
    assert "missing continuation: answer is empty" in got["empty"]["error"]


def test_labels_classify_each_row_with_one_shared_prefill(tmp_path, engine):
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(REVIEWS)]
    data = write_parquet(tmp_path / "reviews.parquet", rows)
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        input={"passthrough": []},
        prompt={"template": TEMPLATE},
        score={"labels": LABELS},
    )
    got = run(job)
    prompts = [TEMPLATE.format(text=t) for t in REVIEWS]
    want = engine.score(prompts, labels=LABELS, use_tqdm=False)
    for i, w in enumerate(want):
        row = got[f"r{i}"]
        assert row["error"] is None and row["label"] == w.label
        assert row["label_logprobs"] == pytest.approx(w.label_logprobs, abs=1e-4)
        assert row["label_probs"] == pytest.approx(w.label_probs, abs=1e-4)
        assert sum(row["label_probs"]) == pytest.approx(1)
        # each label's logprob is its own continuation's sum: the labels are not paired with another's request
        alone = engine.score([prompts[i]] * len(LABELS), LABELS, use_tqdm=False)
        assert row["label_logprobs"] == pytest.approx([-s.sum_nll for s in alone], abs=1e-4)
        label_tokens = sum(len(engine.tokenizer.encode(x, add_special_tokens=False)) for x in LABELS)
        assert row["scored_tokens"] == label_tokens
        # one prefill of the prompt: every label's first token from its last row; a label of more tokens reads the
        # prompt's full blocks from the prefix cache
        n, lengths = row["prompt_tokens"], [len(engine.tokenizer.encode(x, add_special_tokens=False)) for x in LABELS]
        assert row["cached_tokens"] == sum(n // 16 * 16 for k in lengths[1:] if k > 1)
        assert "sum_nll" not in row and "token_logprobs" not in row
    assert got["r0"]["label"] == " positive" and got["r1"]["label"] == " negative"


def test_a_row_the_kv_pool_cannot_hold_is_an_error_row_that_says_so(tmp_path):
    """A scoring row longer than the KV pool (engine.num_kv_blocks) fails alone, its error saying that the KV cache
    blocks are too few and how many it needs and the pool has (it read "plus max_tokens 0", a setting no scoring job
    has); the row beside it is scored."""
    rows = [{"id": "long", "text": " ".join(["word"] * 100), "n": 0}, {"id": "short", "text": "A short text.", "n": 1}]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    got = run(write_job(tmp_path / "job.yaml", data, tmp_path / "out", engine={"num_kv_blocks": 4}))
    assert got["long"]["error"] == (
        "100 tokens to score need more KV cache blocks (7 of 16 tokens) than the pool has (4; raise "
        "engine.num_kv_blocks or the KV cache's memory)"
    )
    assert got["short"]["error"] is None and got["short"]["scored_tokens"] > 0


def test_a_stopped_job_resumes_and_a_cache_answers_a_rerun(tmp_path, texts_file, perplexity_run):
    cache = {"path": str(tmp_path / "cache")}
    job = write_job(
        tmp_path / "job.yaml",
        texts_file,
        tmp_path / "out",
        score={"prompt_logprobs": 2},
        output={"checkpoint_rows": 2},
        cache=cache,
    )
    out = OutputDir(tmp_path / "out")
    done = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill.log", out, "score kill")
    assert 0 < done < 15 and out.status()["state"] == "stopped (killed; resumable)"
    resumed = batchjob("run", str(job))
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((tmp_path / "out" / "_summary.json").read_text())["this_run"]["rows"] == 15 - done
    reference = dataset(perplexity_run)

    def values(rows):
        return {k: (r["sum_nll"], r["scored_tokens"], r["error"], r["n"]) for k, r in rows.items()}

    got = dataset(out.path)
    assert got.keys() == reference.keys()
    for k, r in got.items():
        ref = reference[k]
        assert (r["scored_tokens"], r["error"], r["n"]) == (ref["scored_tokens"], ref["error"], ref["n"])
        assert (r["sum_nll"] is None) == (ref["sum_nll"] is None)
        assert r["sum_nll"] is None or r["sum_nll"] == pytest.approx(ref["sum_nll"], abs=1e-3)
    # another job's folder, the same cache: every scored row comes from it, the same values
    again = write_job(
        tmp_path / "again.yaml", texts_file, tmp_path / "again", score={"prompt_logprobs": 2}, cache=cache
    )
    rerun = batchjob("run", str(again))
    assert rerun.exit_code == 0, rerun.output
    summary = json.loads((tmp_path / "again" / "_summary.json").read_text())
    assert summary["cache"] == {"hits": 11, "misses": 1}  # the one-token row's error is not kept
    assert values(dataset(tmp_path / "again")) == values(got)
    assert [len(t["top_logprobs"]) for t in dataset(tmp_path / "again")["t3"]["token_logprobs"]] == [2] * len(
        got["t3"]["token_logprobs"]
    )


@pytest.mark.parametrize(
    "score, column, value",
    [
        ({"prompt_logprobs": 1}, "token_logprobs", None),
        ({"labels": LABELS}, "label_logprobs", None),
        ({"prompt_logprobs": 1}, "sum_nll", "1.5"),  # failed every run at exit 70: Arrow cannot write it
        ({"labels": LABELS}, "label_probs", [0.5]),
    ],
)
def test_a_cache_entry_without_the_logprobs_of_its_columns_is_never_served(tmp_path, score, column, value):
    """As for a generation's prompt logprobs: an entry rewritten whole (a valid checksum) without its token or label
    logprobs was a hit, and its row had a null token_logprobs or label_logprobs column and no error; one with a
    column of another type failed the run."""
    data = write_parquet(tmp_path / "t.parquet", [{"id": "a", "text": REVIEWS[0], "n": 0}])
    cache = {"path": str(tmp_path / "cache")}
    runs = {}
    for name in ("computed", "stripped"):
        if name == "stripped":
            store = ResultsCache(CacheSpec(**cache))
            for path in (tmp_path / "cache").rglob("*.json"):
                entry = json.loads(path.read_bytes())
                assert entry["result"][column] is not None
                store.put(entry["key"], {**entry["result"], column: value})
        job = write_job(tmp_path / f"{name}.yaml", data, tmp_path / name, score=score, cache=cache)
        runs[name] = run(job)["a"]
        assert json.loads((tmp_path / name / "_summary.json").read_text())["cache"] == {"hits": 0, "misses": 1}
    assert runs["stripped"][column] == runs["computed"][column] is not None


def test_a_scoring_folder_is_another_jobs_after_its_score_section_or_task_changes(tmp_path):
    """A folder of results holds one job's: a changed score section, a generate job in a scoring job's folder or a
    scoring job in a generate job's is refused in one line (exit 2), as a changed sampling section is."""
    data = write_parquet(tmp_path / "r.parquet", [{"id": "a", "text": REVIEWS[0], "n": 0}])
    run(write_job(tmp_path / "job.yaml", data, tmp_path / "out", score={"labels": LABELS}))
    changed = [
        (write_job(tmp_path / "labels.yaml", data, tmp_path / "out", score={"labels": LABELS[:2]}), "score.labels"),
        (write_job(tmp_path / "plp.yaml", data, tmp_path / "out", score={"prompt_logprobs": 0}), "score.labels"),
        (write_job(tmp_path / "gen.yaml", data, tmp_path / "out", task="generate", sampling={"max_tokens": 1}), "task"),
    ]
    for job, says in changed:
        result = batchjob("run", str(job))
        assert result.exit_code == 2 and "holds results of a different job" in result.stderr, result.output
        assert says in result.stderr and "Traceback" not in result.output
    generated = write_job(tmp_path / "g.yaml", data, tmp_path / "gen", task="generate", sampling={"max_tokens": 1})
    run(generated)
    result = batchjob("run", str(write_job(tmp_path / "s.yaml", data, tmp_path / "gen")))
    assert result.exit_code == 2 and "different job" in result.stderr and "task" in result.stderr, result.output
    assert dataset(tmp_path / "out")["a"]["label"] in LABELS and dataset(tmp_path / "gen")["a"]["output"] is not None


def test_plan_counts_a_scoring_jobs_requests_and_prefill(tmp_path, engine):
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(REVIEWS)]
    data = write_parquet(tmp_path / "reviews.parquet", rows + [{"id": "bad", "text": ""}])
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        input={"passthrough": []},
        prompt={"template": TEMPLATE},
        score={"labels": LABELS},
    )
    result = batchjob("plan", str(job), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    prompts = [engine.tokenizer.encode(TEMPLATE.format(text=t)) for t in REVIEWS]
    labels = [engine.tokenizer.encode(x, add_special_tokens=False) for x in LABELS]
    assert report["task"] == "score" and report["rows"] == 5 and report["rows_failing_before_the_model"] == 1
    # a request for the first label (scoring every label's first token) and one for each label of more tokens
    longer = [x for x in labels[1:] if len(x) > 1]
    assert report["requests"] == len(REVIEWS) * (1 + len(longer)) and report["labels"] == len(LABELS)
    assert report["prompt_tokens_total"] == sum(len(p) + len(x) for p in prompts for x in [labels[0], *longer])
    assert report["scored_tokens_total"] == len(REVIEWS) * sum(map(len, labels))
    shared = sum(len(longer) * (len(p) // 16 * 16) for p in prompts)
    assert report["prefill_tokens_expected"] == report["prompt_tokens_total"] - shared
    assert report["calibration"]["prefill_tokens_per_s"] > 0 and report["estimated_time_s"] > 0
    text = batchjob("plan", str(job), "--no-calibrate")
    assert text.exit_code == 0 and "tokens scored" in text.output and "one prefill of each prompt" in text.output


def test_a_chat_template_prompt_scores_the_assistants_answer(tmp_path, engine):
    rows = [{"id": "q", "text": "What is the capital of France?", "answer": "The capital of France is Paris."}]
    data = write_parquet(tmp_path / "chat.parquet", rows)
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        input={"passthrough": []},
        prompt={"chat_template": True, "system": "Answer briefly."},
        score={"continuation_column": "answer"},
    )
    (row,) = run(job).values()
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": rows[0]["text"]}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat), add_special_tokens=False)
    (w,) = engine.score([prompt], [rows[0]["answer"]], use_tqdm=False)
    assert row["prompt_tokens"] == len(prompt) and row["sum_nll"] == pytest.approx(w.sum_nll, abs=1e-4)


def test_a_scoring_job_reads_the_templates_special_tokens_but_not_the_rows(tmp_path, engine):
    """Row data is text: an <|im_end|> in a continuation is scored as the characters, as in a prompt."""
    rows = [{"id": "x", "text": "Say goodbye.", "answer": " Bye<|im_end|>"}]
    data = write_parquet(tmp_path / "x.parquet", rows)
    job = write_job(
        tmp_path / "job.yaml", data, tmp_path / "out", input={"passthrough": []},
        score={"continuation_column": "answer"},
    )  # fmt: skip
    (row,) = run(job).values()
    special = engine.tokenizer.encode(" Bye<|im_end|>", add_special_tokens=False)
    assert row["error"] is None and row["scored_tokens"] > len(special)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"sampling": {"max_tokens": 5}}, "sampling: not used with task 'score'"),
        ({"score": {"labels": [" a", " b"], "continuation_column": "x"}}, "not with continuation_column"),
        ({"score": {"labels": [" a"]}}, "score.labels: List should have at least 2 items"),
        ({"score": {"labels": [" a", " a"]}}, "each label once"),
        ({"score": {"labels": [" a", ""]}}, "an empty label has nothing to score"),
        ({"score": {"labels": [" a", " b"], "prompt_logprobs": 2}}, "not used with labels"),
        ({"score": {"prompt_logprobs": 21}}, "score.prompt_logprobs: Input should be less than or equal to 20"),
        ({"score": {"continuation_column": "text"}}, "is the prompt's own column"),
        ({"score": {"bogus": 1}}, "score.bogus: unknown key; allowed: continuation_column, labels, prompt_logprobs"),
        ({"prompt": {"chat_template": True}}, "needs score.continuation_column or score.labels"),
        ({"output": {"split_reasoning": True}}, "output.split_reasoning: not used with task 'score'"),
        ({"input": {"format": "openai-batch"}}, "'openai-batch' is not read by task 'score'"),
        ({"input": {"passthrough": ["perplexity"]}}, "would clash with result columns"),
        ({"task": "generate", "score": {"labels": [" a", " b"]}}, "score: used with task 'score' only"),
    ],
)
def test_a_job_file_that_a_scoring_job_cannot_use_fails_in_one_line(tmp_path, sections, message):
    job = write_job(tmp_path / "job.yaml", tmp_path / "x.parquet", tmp_path / "out", **sections)
    with pytest.raises(JobFileError) as e:
        load_job(job)
    assert message in str(e.value)
    result = batchjob("run", str(job))
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


def test_a_label_that_fills_the_context_refuses_the_job_in_one_line(tmp_path, engine):
    """Seen: a label of the job file as long as the context failed every row (exit 0). A label is a setting, not row
    data: one of max_model_len tokens or more is refused before any row (exit 2, one line, no output folder). One a
    token shorter runs: a row whose prompt and label fit is scored, a longer one fails alone."""
    context = 32
    word = engine.tokenizer.encode(" word", add_special_tokens=False)
    assert len(engine.tokenizer.encode(" word" * context, add_special_tokens=False)) == context * len(word) == context
    assert len(engine.tokenizer.encode("Good")) == 1
    rows = [{"id": "one", "text": "Good"}, {"id": "longer", "text": "Good food, kind staff."}]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    engine_section = {**ENGINE, "max_model_len": context}
    sections = {"input": {"passthrough": []}, "engine": engine_section}
    job = write_job(
        tmp_path / "job.yaml", data, tmp_path / "out", score={"labels": [" yes", " word" * context]}, **sections
    )
    result = cli("run", str(job))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"error: score.labels: the label ' word word word word word word word w...' is {context} tokens, not under "
        f"the model's context of {context} (engine.max_model_len): no prompt fits before it"
    )
    assert not (tmp_path / "out").exists()
    job = write_job(
        tmp_path / "job2.yaml", data, tmp_path / "out2", score={"labels": [" yes", " word" * (context - 1)]}, **sections
    )
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    got = dataset(tmp_path / "out2")
    assert got["one"]["error"] is None and got["one"]["scored_tokens"] == 1 + (context - 1)  # both labels
    assert "too long for the model's context of 32" in got["longer"]["error"]


def test_the_example_job_file_is_a_scoring_job():
    job = load_job(Path(__file__).resolve().parents[2] / "jobs" / "score.yaml")
    assert job.task == "score" and job.score.prompt_logprobs == 2 and not job.prompt.chat_template
