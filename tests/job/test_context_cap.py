"""A job on the real model whose lines ask for absurd output lengths: each row runs to the model's context, the
normal row beside them completes, the job ends with exit 0, and `plan` counts outputs within the context. Other
absurd numbers fail their own row."""

import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO, write_jsonl

pytestmark = pytest.mark.slow

CONTEXT = 64


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchjob.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], **body},
    }


def test_absurd_max_tokens_run_to_the_context_and_the_job_ends(tmp_path):
    lines = [
        line("huge", "Say hi.", max_completion_tokens=10**13),
        line("beyond-int64", "Say hi.", max_tokens=2**70),
        line("job-default", "Say hi."),  # the job's sampling.max_tokens: 2**63 - 1
        line("normal", "What is 2+2?", max_completion_tokens=4),
        # Absurd numbers elsewhere fail their own row only.
        line("bias", "Say hi.", logit_bias={str(10**22): 1}),
        line("samples", "Say hi.", n=10**30),
    ]
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "input": {"path": str(write_jsonl(tmp_path / "batch.jsonl", lines)), "format": "openai-batch"},
                "output": {"path": str(tmp_path / "out"), "format": "openai-batch"},
                "sampling": {"max_tokens": 2**63 - 1, "ignore_eos": True},
                "engine": {"max_model_len": CONTEXT, "max_num_seqs": 4, "kv_cache_memory_gb": 0.1},
            }
        )
    )
    planned = cli("plan", str(job), "--no-calibrate", "--json")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert json.loads(planned.stdout)["output_tokens_max"] < 5 * CONTEXT  # 5 requests, none past the context
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done: 4 rows ok, 2 failed" in result.stderr + result.stdout
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}
    for custom_id in ("huge", "beyond-int64", "job-default"):
        body = out[custom_id]["response"]["body"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == CONTEXT
    normal = out["normal"]["response"]["body"]
    assert normal["choices"][0]["finish_reason"] == "length" and normal["usage"]["completion_tokens"] == 4
    assert out["bias"]["error"]["message"] == "logit_bias holds token ids outside the vocabulary"
    assert out["samples"]["error"]["message"] == "n: Input should be less than or equal to 128"
