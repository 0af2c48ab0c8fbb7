"""Models named by Hugging Face Hub id, resolved by huggingface_hub offline from a local Hub cache that holds the
default model's weights (no machine here reaches the Hub): the real resolution path, HF_HOME and HF_HUB_OFFLINE."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.torch import save_file

from batchjob.engine.sampling_params import SamplingParams
from tests.helpers import REPO, hub_cache, write_parquet

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, loaded):
    """HF_HOME with two repos: the model as safetensors (HF config, tokenizer files) and as its GGUF file."""
    folder = tmp_path_factory.mktemp("hf-model")
    c = loaded.config
    config = {
        "architectures": [c.architecture],
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        **{k: getattr(c, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")},
        **{k: getattr(c, k) for k in ("rope_theta", "max_position_embeddings", "tie_word_embeddings")},
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(folder / "model.safetensors"))
    loaded.tokenizer.save(folder)
    home = tmp_path_factory.mktemp("hf-home")
    files = {p.name: p for p in folder.iterdir()}
    commit = hub_cache(home, REPO_ID, files)
    gguf_commit = hub_cache(home, GGUF_REPO, {loaded.path.name: loaded.path})
    return home, commit, gguf_commit


def run_offline(home, *args, **kwargs) -> subprocess.CompletedProcess:
    # A fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is first imported.
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, **kwargs)


LOCATE = """
import json, sys
from batchjob.model.errors import ModelNotFoundError
from batchjob.model.loader import locate_model
out = []
for name in sys.argv[1:]:
    try:
        where = locate_model(name)
        out.append([str(where.path), where.revision])
    except ModelNotFoundError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def test_hub_ids_resolve_offline_to_the_cached_commit(hub):
    home, commit, gguf_commit = hub
    names = [REPO_ID, f"{REPO_ID}@{commit}", f"{GGUF_REPO}/SmolLM2-135M-Instruct.Q4_1.gguf", "nobody/no-such-model"]
    proc = run_offline(home, "-c", LOCATE, *names)
    assert proc.returncode == 0, proc.stderr
    by_name, by_commit, gguf, missing = json.loads(proc.stdout)
    snapshot = str(home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit)
    assert by_name == [snapshot, commit] and by_commit == [snapshot, commit]
    assert gguf[0].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and gguf[1] == gguf_commit
    assert "nobody/no-such-model" in missing and "Hugging Face Hub" in missing


def test_job_on_a_hub_id_matches_the_builtin_model_and_records_the_revision(hub, engine, tmp_path):
    home, commit, _ = hub
    texts = ["What is 2+2?", "Name a colour."]
    data = write_parquet(tmp_path / "in.parquet", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    job = {
        "model": REPO_ID,
        "input": {"path": str(data)},
        "sampling": {"max_tokens": 8, "temperature": 0},
        "engine": {"max_model_len": 256},
        "output": {"path": str(tmp_path / "out")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = run_offline(home, "-m", "batchjob.cli", "run", str(tmp_path / "job.yaml"))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert meta["fingerprint"]["model_revision"] == commit
    got = {r["id"]: r["output"] for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    want = [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    assert [got["0"], got["1"]] == want
