"""Test helpers: small inputs, job specs, the fake engine and a progress sink that keeps messages."""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.job.spec import JobSpec
from batchjob.job.telemetry.progress import LogProgress
from tests.fakes import FakeEngine

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "sample_data"


def documents(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "id": f"doc-{i:03d}",
            "title": f"title {i}",
            "source": "austen" if i % 2 else "python",
            "text": " ".join(f"w{i}x{k}" for k in range(1 + i % 7)),
        }
        for i in range(start, start + n)
    ]


def write_parquet(path: Path, rows: list[dict], row_group_size: int | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def make_job(input_path: Path, out: Path, **sections) -> JobSpec:
    raw = {
        "model": "fake",
        "input": {"path": str(input_path)},
        "output": {"path": str(out)},
        "sampling": {"max_tokens": 64},
    }
    for key, value in sections.items():
        if value is None:  # the section left out (sampling=None for a scoring job)
            raw.pop(key, None)
        else:
            raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    return JobSpec.model_validate(raw)


class Messages(LogProgress):
    """Log progress into memory, keeping the messages for assertions."""

    def __init__(self):
        super().__init__(io.StringIO(), interval=3600)
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)


def fake_factory(**config):
    return lambda job: FakeEngine(job.model, **config)


def short_documents(folder: Path, rows: int, words: int) -> Path:
    """The first `rows` sample documents cut to `words` words (short prompts keep prefill cheap on a CPU)."""
    docs = pq.read_table(SAMPLE_DATA / "documents.parquet").slice(0, rows).to_pylist()
    for doc in docs:
        doc["text"] = " ".join(doc["text"].split()[:words])
    path = folder / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(docs), path)
    return path


def hub_cache(home: Path, repo: str, files: dict[str, Path], revision: str = "main") -> str:
    """A Hugging Face Hub cache under `home` (as HF_HOME) holding `files` as one commit of `repo`, laid out as
    huggingface_hub lays out its downloads (blobs, refs, snapshots of links); returns the commit hash."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repr(sorted((n, os.path.getsize(p)) for n, p in files.items())).encode()).hexdigest()
    for name, path in files.items():
        with open(path, "rb") as f:
            blob = root / "blobs" / hashlib.file_digest(f, "sha256").hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(Path(path).resolve())
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return commit


def protocol_gaps(obj, protocol: type) -> list[str]:
    """How `obj` falls short of the typing.Protocol: members it lacks, and methods whose parameters differ (by name
    and order) from the protocol's."""
    members = set(vars(protocol).get("__annotations__", {})) | {
        name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value)
    }
    members |= {name for name, value in vars(protocol).items() if isinstance(value, property)}
    gaps = []
    for name in sorted(members):
        if not hasattr(obj, name):
            gaps.append(f"{name}: missing")
            continue
        wanted = vars(protocol).get(name)
        if callable(wanted) and not isinstance(wanted, property):
            want = list(inspect.signature(wanted).parameters)[1:]  # without self
            have = list(inspect.signature(getattr(obj, name)).parameters)
            if have != want:
                gaps.append(f"{name}: parameters {have}, the protocol's {want}")
    return gaps


def assert_json_output(text: str, finish_reason: str, schema: dict | None = None) -> None:
    """A constrained row's output is what its contract promises: a finished row ("stop") is a JSON object valid
    against `schema`; a row cut at max_tokens ("length") is a prefix of one. The prefix check is xgrammar's own JSON
    Schema grammar built here, permissive (any whitespace, extra properties), not the engine's compiled grammar."""
    import jsonschema
    import xgrammar as xgr

    schema = schema or {"type": "object"}
    if finish_reason == "stop":
        value = json.loads(text)
        assert isinstance(value, dict), text
        jsonschema.validate(value, schema)
        return
    assert finish_reason == "length", (finish_reason, text)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=False)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert text and matcher.accept_string(text), f"not a prefix of a JSON object valid against the schema: {text!r}"


def summarize_prompts(tokenizer, n: int = 12) -> list[list[int]]:
    """`n` chat prompts asking to summarize the sample documents' starts, of about 40 to 330 tokens (n = 12)."""
    docs = pq.read_table(REPO / "sample_data" / "documents.parquet").column("text").to_pylist()
    return [
        tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + " ".join(docs[i].split()[: 20 + 23 * i])}])
        for i in range(n)
    ]


# The capabilities that let root pass any file's mode bits (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH).
DAC_CAPABILITIES = (1, 2)
CAPABILITY_VERSION_3 = 0x20080522


def deny_by_mode() -> None:
    """Make this process one that file modes deny, as they deny any user (a folder of mode 000 unreadable, one of
    0555 unwritable): as root, it gives up the capabilities that pass a mode and keeps uid 0, so root's own files
    (the venv, the checkout, in a private folder or not) stay readable by their owner. Becoming another user (nobody)
    instead denied the lazy imports of a venv in a folder of mode 700. Irreversible: for a test's child process."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)  # this process
    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: capabilities 0-31, then 32-63
    if libc.capget(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    for i in range(3):
        sets[i] &= ~sum(1 << c for c in DAC_CAPABILITIES)
    if libc.capset(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def peft_adapter(loaded, folder: Path, seed: int, boost: float = 1.0, **settings):
    """A random LoRA adapter of the built-in model made by peft itself (A and B drawn: init_lora_weights=False; B
    times `boost`), saved as a PEFT folder at `folder`; returns peft's model with it, the oracle of its outputs."""
    import peft
    import torch
    import transformers

    path, name = os.path.dirname(loaded.path), os.path.basename(loaded.path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, gguf_file=name, dtype=torch.float32)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base.eval(), peft.LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.mul_(boost)
    model.save_pretrained(folder)
    return model.eval()
