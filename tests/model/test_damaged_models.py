"""A model that is found but cannot be used (a damaged or incomplete file, a config or chat template that does not
parse, weights that do not fit the config) is one ModelLoadError that names it: exit 2 at the CLI, never an internal
error; a chat template that refuses some prompts fails those rows, and a model without one still runs the prompts that
need none. On damaged copies of the real built-in GGUF, and of a tiny HF folder exported from a tiny GGUF."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from batchjob.bench.hf_export import export_hf
from batchjob.job.exit_codes import EXIT_OK, EXIT_USAGE
from batchjob.model.builtin import DEFAULT_MODEL
from batchjob.model.errors import ModelLoadError
from batchjob.model.loader import CONVERTED_GGUF, load_model, locate_model
from tests.helpers import REPO, write_jsonl
from tests.model.test_loader import write_tiny_gguf


@pytest.fixture(scope="module")
def real_gguf():
    return locate_model(DEFAULT_MODEL).path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Conversions and digests of the damaged copies in tmp_path, not in the user's cache."""
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny HF folder (a llama of two layers, random weights, a 300-token vocabulary with a chat template)."""
    root = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHJOB_CACHE", str(root / "cache"))
        write_tiny_gguf(root / "tiny.gguf", np.random.default_rng(0))
        return export_hf(load_model(str(root / "tiny.gguf")), root / "hf")


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model")


def damaged_gguf(real, tmp_path, how: str):
    path = tmp_path / "damaged.gguf"
    data = bytearray(real.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "bad magic":
        data[:4] = b"GGFU"
    elif how == "corrupt header":
        data[8:16] = struct.pack("<q", 2**62)  # the tensor count
    elif how == "header only":
        data = data[:1000]
    elif how == "empty":
        data = b""
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "how,says",
    [
        ("truncated", "cannot reshape array"),
        ("bad magic", "GGUF magic invalid"),
        ("corrupt header", ""),
        ("header only", ""),
        ("empty", "cannot mmap an empty file"),
    ],
)
def test_a_damaged_gguf_is_a_model_load_error_naming_it(real_gguf, tmp_path, cache, how, says):
    path = damaged_gguf(real_gguf, tmp_path, how)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    message = str(e.value)
    assert message.startswith(f"model {path} cannot be loaded: not a readable GGUF file (damaged or cut short?): ")
    assert says in message and "\n" not in message
    assert not (cache / CONVERTED_GGUF).exists() or not any(
        (cache / CONVERTED_GGUF).iterdir()
    )  # nothing half-converted


def tokenizer_config(folder) -> dict:
    return json.loads((folder / "tokenizer_config.json").read_text())


def with_template(folder, template: str | None):
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config(folder), "chat_template": template}))


@pytest.mark.parametrize(
    "damage,says",
    [
        (lambda f: (f / "tokenizer.json").unlink(), "the folder has no tokenizer.json"),
        (lambda f: (f / "tokenizer.json").write_text("{"), "Exception: "),
        (lambda f: (f / "config.json").write_text("{"), "JSONDecodeError: "),
        (lambda f: (f / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})), "KeyError: "),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "architectures": ["GPT2LMHeadModel"]})
            ),
            "architecture 'GPT2LMHeadModel' is not supported",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "rope_scaling": {"rope_type": "yarn"}})
            ),
            "rope_scaling type 'yarn' is not supported",
        ),
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]), "Safetensor"),
        (lambda f: (f / "model.safetensors").unlink(), "the folder has no *.safetensors weights"),
        (
            lambda f: save_file(
                {k: v for k, v in load_file(f / "model.safetensors").items() if "layers.1.mlp" not in k},
                f / "model.safetensors",
            ),
            "it has no tensor model.layers.1.mlp.gate_proj.weight",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "intermediate_size": 512})
            ),
            "its tensor model.layers.0.mlp.gate_proj.weight has shape (256, 256), its config needs (512, 256)",
        ),
        (lambda f: with_template(f, "{% for m in messages %}{{ m.content }}"), "its chat template does not parse: "),
    ],
)
def test_a_damaged_or_incomplete_hf_folder_is_a_model_load_error_naming_it(tiny_hf, tmp_path, damage, says):
    folder = copy_of(tiny_hf, tmp_path)
    load_model(str(folder))  # the copy loads before the damage
    damage(folder)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder))
    message = str(e.value)
    assert message.startswith(f"model {folder} cannot be loaded: ") and says in message and "\n" not in message


def cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchjob.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_the_cli_names_a_damaged_model_and_exits_2(real_gguf, tiny_hf, tmp_path):
    """Each was exit 70 'internal error' naming no file: 'cannot reshape array of size ...', 'No such file or
    directory (os error 2)', a jinja2 syntax error."""
    truncated = damaged_gguf(real_gguf, tmp_path, "truncated")
    no_tokenizer = copy_of(tiny_hf, tmp_path)
    (no_tokenizer / "tokenizer.json").unlink()
    bad_template = shutil.copytree(tiny_hf, tmp_path / "bad-template")
    with_template(bad_template, "{% if %}")
    for model, says in [
        (truncated, "not a readable GGUF file"),
        (no_tokenizer, "the folder has no tokenizer.json"),
        (bad_template, "its chat template does not parse"),
    ]:
        result = cli("generate", "hi", "--max-tokens", "2", "--model", str(model))
        assert result.returncode == EXIT_USAGE, result.stderr
        assert one_error_line(result).startswith(f"error: model {model} cannot be loaded: {says}")


def run_tiny_job(folder, tmp_path, input_spec: dict, output_spec: dict) -> subprocess.CompletedProcess:
    """`batchjob run` of a two-token job on the model in `folder`, writing to tmp_path/out."""
    job = tmp_path / "job.yaml"
    spec = {
        "model": str(folder),
        "input": input_spec,
        "sampling": {"max_tokens": 2},
        "engine": {"max_num_seqs": 2, "kv_cache_memory_gb": 0.01},
        "output": {"path": str(tmp_path / "out"), **output_spec},
    }
    job.write_text(json.dumps(spec))
    return cli("run", str(job), "--log-interval", "60")


def test_a_chat_template_that_raises_fails_its_rows_not_the_job(tiny_hf, tmp_path):
    """The job's check rendered one user message, which this template refuses: exit 70 before any row."""
    folder = copy_of(tiny_hf, tmp_path)
    with_template(
        folder,
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    user = {"role": "user", "content": "the quick fox"}
    system = {"role": "system", "content": "Be brief."}
    rows = [{"id": "user", "messages": [user]}, {"id": "system", "messages": [system, user]}]
    input_spec = {"path": str(write_jsonl(tmp_path / "in.jsonl", rows)), "messages_column": "messages"}
    result = run_tiny_job(folder, tmp_path, input_spec, {})
    assert result.returncode == EXIT_OK, result.stderr
    errors = {r["id"]: r["error"] for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    assert errors == {
        "system": None,
        "user": "the model's chat template refused this prompt: a system message must come first",
    }


def test_completions_lines_run_on_a_model_without_a_chat_template(tiny_hf, tmp_path):
    """A base model (no chat template) refused a file of /v1/completions lines, and its advice, prompt.chat_template:
    false, was refused too. Only a chat line needs the template, and it fails alone."""
    folder = copy_of(tiny_hf, tmp_path)
    with_template(folder, None)
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "the quick fox"}},
        {"custom_id": "m", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
    ]
    input_spec = {"path": str(write_jsonl(tmp_path / "batch.jsonl", lines)), "format": "openai-batch"}
    result = run_tiny_job(folder, tmp_path, input_spec, {"format": "openai-batch"})
    assert result.returncode == EXIT_OK, result.stderr
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}
    assert out["c"]["error"] is None and out["c"]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert out["m"]["error"]["message"].startswith("a /v1/chat/completions line needs a chat template")


def test_generate_says_what_to_do_about_a_missing_or_refusing_chat_template(tiny_hf, tmp_path):
    """Both were exit 70 'internal error' (a ValueError, a jinja2 TemplateError)."""
    plain = copy_of(tiny_hf, tmp_path)
    with_template(plain, None)
    refusing = shutil.copytree(tiny_hf, tmp_path / "refusing")
    with_template(refusing, "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}")
    for model, args, says in [
        (plain, [], f"error: {plain} has no chat template: add --no-chat to send the prompt as it is"),
        (refusing, ["--system", "Be brief."], "error: the model's chat template refused this prompt: no system role"),
    ]:
        result = cli("generate", "the quick fox", "--max-tokens", "2", "--model", str(model), *args)
        assert result.returncode == EXIT_USAGE and one_error_line(result) == says, result.stderr
    assert cli("generate", "the quick fox", "--max-tokens", "2", "--model", str(plain), "--no-chat").returncode == 0
