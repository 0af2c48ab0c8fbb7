"""load_lora on adapters written by hand for a tiny model config (no weights loaded): the digest is of the bytes the
weights come from, and an adapter of modules the base model does not have (another family's fused projections, a
projection under the wrong block) is refused naming the adapter, whatever its shapes."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.model.config import ModelConfig
from batchjob.model.lora import weights
from batchjob.model.lora.files import LoraError, read_adapter
from batchjob.model.lora.weights import load_lora

# hidden 16, q 4 x 4, k and v 2 x 4, intermediate 32
LLAMA = ModelConfig("LlamaForCausalLM", 64, 16, 32, 2, 4, 2, 4, 1e-5, 1e4, 128, True, False)
PHI3 = dataclasses.replace(LLAMA, architecture="Phi3ForCausalLM")
# module -> (its block, in, out) in LLAMA's dimensions
SEPARATE = {
    "q_proj": ("self_attn", 16, 16),
    "k_proj": ("self_attn", 16, 8),
    "v_proj": ("self_attn", 16, 8),
    "o_proj": ("self_attn", 16, 16),
    "gate_proj": ("mlp", 16, 32),
    "up_proj": ("mlp", 16, 32),
    "down_proj": ("mlp", 32, 16),
}
FUSED = {
    "qkv_proj": ("self_attn", 16, 32),
    "o_proj": ("self_attn", 16, 16),
    "gate_up_proj": ("mlp", 16, 64),
    "down_proj": ("mlp", 32, 16),
}
O_A = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"


def write_adapter(folder: pathlib.Path, modules: dict, seed: int, rank: int = 4) -> pathlib.Path:
    """A PEFT folder with random lora_A [rank, in] and lora_B [out, rank] for `modules` on every layer."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LLAMA.num_hidden_layers):
        for module, (block, n_in, n_out) in modules.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g)
    folder.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": sorted(modules)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def test_the_digest_is_of_the_bytes_the_weights_were_read_from(tmp_path, monkeypatch):
    """The weights file replaced by another adapter's right after load_lora first reads it (by whichever call): the
    adapter it returns holds one file's weights and that same file's digest, never one's weights with the other's
    digest (the fingerprint and the results cache would file the second adapter's rows under the first)."""
    first = write_adapter(tmp_path / "first", SEPARATE, seed=1)
    second = write_adapter(tmp_path / "second", SEPARATE, seed=2)
    second_digest = read_adapter("second", second)[2]
    target = first / "adapter_model.safetensors"
    first_weights, first_digest = load_file(target), read_adapter("first", first)[2]
    swapped = []

    def swap_after(read):
        def reading(path, *args, **kwargs):
            out = read(path, *args, **kwargs)
            if pathlib.Path(path) == target and not swapped:
                shutil.copyfile(second / "adapter_model.safetensors", tmp_path / "next")
                (tmp_path / "next").replace(target)
                swapped.append(True)
            return out

        return reading

    monkeypatch.setattr(pathlib.Path, "read_bytes", swap_after(pathlib.Path.read_bytes))
    if hasattr(weights, "safe_open"):  # a read through safetensors' own file handle
        monkeypatch.setattr(weights, "safe_open", swap_after(weights.safe_open))
    adapter = load_lora("first", first, LLAMA, 64, torch.float32)
    assert swapped
    o_a = adapter.layers[0]["o"].a  # o_proj's lora_A, the o matmul's only update
    if adapter.digest == first_digest:
        assert torch.equal(o_a, first_weights[O_A])
    else:
        assert adapter.digest == second_digest
        second_weights = load_file(second / "adapter_model.safetensors")
        assert torch.equal(o_a, second_weights[O_A])


def test_each_family_loads_its_own_projections(tmp_path):
    load_lora("llama", write_adapter(tmp_path / "llama", SEPARATE, 3), LLAMA, 64, torch.float32)
    load_lora("phi3", write_adapter(tmp_path / "phi3", FUSED, 4), PHI3, 64, torch.float32)


@pytest.mark.parametrize(
    ("modules", "config", "missing"),
    [
        (FUSED, LLAMA, "mlp.gate_up_proj"),  # a Phi-3 adapter on a Llama base: q/k/v stored apart
        (SEPARATE, PHI3, "mlp.gate_proj"),  # a Llama adapter on a Phi-3 base: one qkv_proj
        ({"q_proj": ("mlp", 16, 16)}, LLAMA, "mlp.q_proj"),  # a projection under the wrong block
    ],
    ids=["fused-on-llama", "separate-on-phi3", "wrong-block"],
)
def test_an_adapter_of_modules_the_base_model_lacks_is_refused(tmp_path, modules, config, missing):
    """Shapes that fit the fused matmul are no licence: peft cannot apply these to the base model either."""
    folder = write_adapter(tmp_path / "other", modules, 5)
    with pytest.raises(LoraError, match=f"LoRA adapter 'other': layer 0 .*{missing}.* the base model has no"):
        load_lora("other", folder, config, 64, torch.float32)


def test_an_adapter_whose_shapes_do_not_fit_the_base_model_is_refused(tmp_path):
    wide = {"k_proj": ("self_attn", 16, 16)}  # k as wide as q: a model without grouped-query attention
    with pytest.raises(LoraError, match="LoRA adapter 'wide': layer 0 k_proj: .* do not fit the base model"):
        load_lora("wide", write_adapter(tmp_path / "wide", wide, 6), LLAMA, 64, torch.float32)
