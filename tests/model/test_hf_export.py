"""The default model written out as an HF folder (what vLLM reads in the bench) is the same model: our loader reads
back the same weights and tokenizer, and transformers loads it and computes the same logits as its GGUF loader."""

from __future__ import annotations

import sys

import pytest
import torch

from batchjob.bench.hf_export import export_hf
from batchjob.model.loader import load_model


def test_exported_folder_is_the_same_model(loaded, hf_oracle, tmp_path):
    folder = export_hf(loaded, tmp_path / "hf")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    back = load_model(str(folder))
    assert back.config == loaded.config
    assert back.weights.keys() == loaded.weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(back.weights[k], loaded.weights[k]) for k in back.weights)
    text = "Summarize this text in two sentences: café, naïve — 東京."
    messages = [{"role": "user", "content": text}]
    assert back.tokenizer.encode_chat(messages) == loaded.tokenizer.encode_chat(messages)

    transformers = pytest.importorskip("transformers")
    hf_model, hf_tok = hf_oracle
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.encode(text) == hf_tok.encode(text)
    ids = torch.tensor([loaded.tokenizer.encode_chat(messages)])
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, hf_model(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["gemma3-gqa2-window8-linearrope", "gemma2-mha-window12-softcap"])
def test_exported_gemma_folder_is_the_same_model(case, tmp_path):
    """Gemma's windows, scales, soft-caps and ropes survive the export: transformers computes the same logits."""
    tiny = pytest.importorskip("tests.oracle.test_tiny_architectures", reason="the oracle needs the test extra")
    hf_model = tiny.build(case, tmp_path / "src", tiny.tiny_tokenizer().to_str())
    loaded = load_model(str(tmp_path / "src"))
    folder = export_hf(loaded, tmp_path / "hf")
    assert load_model(str(folder)).config == loaded.config
    transformers = pytest.importorskip("transformers")
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, tiny.VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(ours.eval()(ids).logits, hf_model(ids).logits, rtol=0, atol=1e-5)


def test_a_model_written_a_shard_at_a_time_reads_back_whole(tmp_path, monkeypatch):
    """bench --gguf at 8B: the dummy draw goes to disk a shard at a time in bf16 (the float32 draw would not fit in
    memory). Shards with an index, as transformers writes them: our loader and transformers read back every tensor,
    each the draw rounded to bf16, and the writer never held more than about one shard."""
    from batchjob.bench import hf_export
    from batchjob.model.dummy import dummy_spec

    spec = dummy_spec("tiny-llama", 7)
    monkeypatch.setattr(hf_export, "SHARD_BYTES", 40_000)
    held, most = {}, 0

    def watched():
        nonlocal most
        for name, t in spec.tensors(dtype=torch.bfloat16):
            held[name] = t
            most = max(most, sum(w.nbytes for w in held.values() if sys.getrefcount(w) > 3))
            yield name, t

    folder = hf_export.write_hf_folder(spec.config, spec.tokenizer, watched(), tmp_path / "hf", torch.bfloat16)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert most <= 40_000 + max(t.nbytes for t in held.values())  # one shard and the tensor past its limit
    back = load_model(str(folder)).weights
    drawn = dict(spec.tensors())
    assert back.keys() == drawn.keys()
    assert all(torch.equal(back[k], drawn[k].to(torch.bfloat16).float()) for k in drawn)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert hf.dtype == torch.bfloat16
    assert torch.equal(hf.state_dict()["lm_head.weight"], drawn["lm_head.weight"].to(torch.bfloat16))
