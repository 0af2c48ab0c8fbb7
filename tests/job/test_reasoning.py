"""Reasoning models' output: `output.split_reasoning` puts a `<think>...</think>` block into `reasoning` and the
answer into `output` (and OpenAI Batch's `reasoning_content`); `prompt.chat_template_kwargs` reach the chat
template. The end-to-end case makes the real default model write a reasoning block with a regex constraint."""

import json

import pyarrow.parquet as pq
import pytest

from batchjob.job.output.schema import split_reasoning
from batchjob.job.run.runner import EXIT_OK, run_job
from tests.fakes import FakeEngine
from tests.helpers import make_job, write_jsonl
from tests.job.test_structured_jobs import ENGINE, documents_job, shared


@pytest.mark.parametrize(
    "text, reasoning, answer",
    [
        ("<think>\nThe sky scatters blue light.\n</think>\n\nBlue.", "The sky scatters blue light.", "Blue."),
        ("Plan first.</think>Answer.", "Plan first.", "Answer."),  # the template opened the block (DeepSeek-R1)
        ("<think>\n\n</think>\n\nNo thinking.", "", "No thinking."),  # enable_thinking: false
        ("<think>cut off while still thi", "cut off while still thi", ""),  # max_tokens reached inside
        ("Just an answer.", None, "Just an answer."),
        ("An answer naming <think> later.", None, "An answer naming <think> later."),
        ("", None, ""),
    ],
)
def test_split_reasoning(text, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)


def test_a_reasoning_block_goes_to_its_own_column_and_to_reasoning_content(tmp_path, engine, progress):
    sampling = {"max_tokens": 48, "regex": "<think>[a-z ]{4,40}</think> (yes|no)", "n": 2, "temperature": 0.8}
    job = documents_job(tmp_path, 3, "Is this text about the sea? {text}", sampling)
    job = job.model_copy(update={"output": job.output.model_copy(update={"split_reasoning": True})})
    assert run_job(job, progress, engine_factory=shared(engine)) == EXIT_OK
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert len(rows) == 3
    for row in rows:
        assert row["error"] is None and row["finish_reason"] == "stop", row
        assert row["output"] in ("yes", "no") and row["outputs"][0] == row["output"]
        assert row["reasoning"] and "<think>" not in row["reasoning"] and row["reasoning"] == row["reasonings"][0]
        assert len(row["reasonings"]) == 2 and all(o in ("yes", "no") for o in row["outputs"])


def test_openai_batch_output_carries_reasoning_content(tmp_path, engine, progress):
    lines = [
        {
            "custom_id": f"q{n}",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Is {n} even?"}]},
        }
        for n in (3, 8)
    ]
    lines.append({"custom_id": "plain", "url": "/v1/completions", "body": {"prompt": "Is 5 odd?"}})
    data = write_jsonl(tmp_path / "b.jsonl", lines)
    job = make_job(
        data,
        tmp_path / "out",
        model="smollm2-135m-instruct",
        input={"format": "openai-batch"},
        output={"format": "openai-batch", "split_reasoning": True},
        sampling={"max_tokens": 40, "regex": "<think>[a-z ]{4,30}</think>(yes|no)"},
        engine=ENGINE,
    )
    assert run_job(job, progress, engine_factory=shared(engine)) == EXIT_OK
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}
    for key in ("q3", "q8"):
        message = out[key]["response"]["body"]["choices"][0]["message"]
        assert message["content"] in ("yes", "no") and message["reasoning_content"], message
        assert "think>" not in message["reasoning_content"]
    choice = out["plain"]["response"]["body"]["choices"][0]  # /v1/completions has no reasoning_content
    assert "reasoning_content" not in choice and "think>" not in choice["text"]


def test_chat_template_kwargs_reach_the_template_of_every_row(tmp_path, progress):
    engine = FakeEngine()
    job = make_job(
        write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "hello"}, {"id": "b", "text": "world"}]),
        tmp_path / "out",
        prompt={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert run_job(job, progress, engine_factory=lambda job: engine) == EXIT_OK
    prompts = [bytes(ids).decode() for ids in engine.prompts_seen]
    assert len(prompts) == 2 and all(p.startswith("<|enable_thinking=False|><|user|>") for p in prompts)
