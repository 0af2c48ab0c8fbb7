"""Our Idefics3 image encoder (vision tower + connector) against transformers' get_image_features, fp32."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchjob.model.dummy import load_dummy
from batchjob.model.errors import ModelLoadError
from batchjob.model.loader import load_model
from batchjob.model.vision.idefics3 import ImageEncoder
from tests.vision.tiny_idefics3 import build, image


def test_loads_text_model_as_llama_and_vision_apart(idefics3):
    folder, hf = idefics3
    loaded = load_model(str(folder))
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.vocab_size == hf.config.text_config.vocab_size
    assert not any(k.startswith("model.vision_model") for k in loaded.weights)
    assert torch.equal(loaded.weights["model.embed_tokens.weight"], hf.model.text_model.embed_tokens.weight)
    assert loaded.vision.config.tokens_per_tile == 4


def test_features_equal_transformers(idefics3):
    folder, hf = idefics3
    processor = transformers.AutoProcessor.from_pretrained(folder)
    # a wide image split into 2x2 tiles plus its global one, and a small one kept whole
    inputs = processor(
        text=["<image> and <image>"], images=[[image(0, (40, 24)), image(1, (9, 13))]], return_tensors="pt"
    )
    pixels, mask = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0]
    # padding as the processor leaves it for smaller images of a batch: the bottom rows and right columns
    mask[1, 10:, :] = 0
    mask[2, :, 7:] = 0
    pixels[1, :, 10:, :] = 0
    pixels[2, :, :, 7:] = 0
    loaded = load_model(str(folder))
    ours = ImageEncoder(loaded.vision.config, loaded.vision.weights)(pixels, mask)
    with torch.inference_mode():
        ref = hf.get_image_features(pixels[None], mask[None]).pooler_output
    ref = torch.cat(ref)
    assert ours.shape == ref.shape == (pixels.shape[0] * 4, hf.config.text_config.hidden_size)
    assert (ours - ref).abs().max() <= 1e-5


def test_features_equal_transformers_with_a_fourfold_shuffle(tmp_path):
    """SmolVLM's connector: 8x8 patches a tile, each 4x4 square folded into one token."""
    hf = build(tmp_path, image_size=32, scale=4)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)
    inputs = processor(text=["<image>"], images=[[image(2, (70, 40))]], return_tensors="pt")
    pixels, mask = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0]
    loaded = load_model(str(tmp_path))
    assert loaded.vision.config.tokens_per_tile == 4
    ours = ImageEncoder(loaded.vision.config, loaded.vision.weights)(pixels, mask)
    with torch.inference_mode():
        ref = torch.cat(hf.get_image_features(pixels[None], mask[None]).pooler_output)
    assert ours.shape == ref.shape == (pixels.shape[0] * 4, hf.config.text_config.hidden_size)
    assert (ours - ref).abs().max() <= 1e-5


def test_dummy_weights_refuse_a_vision_model(idefics3):
    folder, _ = idefics3
    with pytest.raises(ModelLoadError, match="draws text models only"):
        load_dummy(str(folder))
