"""A tiny random-weight Idefics3 (SmolVLM's family) saved by transformers as an HF folder with its processor: the
built-in SmolLM2 tokenizer plus Idefics3's image tokens, and an image processor small enough for tests to take
seconds."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken

from batchjob.model.loader import load_model

# A tile: 16x16 pixels, 4x4 patches, 4 image tokens after the pixel shuffle by 2.
PATCH, IMAGE_SIZE, SCALE = 4, 16, 2
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
IMAGE_TOKENS += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
# SmolVLM-Instruct's processor chat template, which reads a message's content as a list of parts only.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """SmolLM2's tokenizer (the built-in model's) with Idefics3's special tokens added after its vocabulary."""
    backend = load_model("smollm2-135m-instruct").tokenizer.backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<end_of_utterance>"
    )


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that greedy logits are well apart; norms away from 1, biases non-zero."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def build(
    folder: Path, image_size: int = IMAGE_SIZE, scale: int = SCALE
) -> transformers.Idefics3ForConditionalGeneration:
    """SmolVLM-256M's shape is image_size 32 patches a side, scale 4; 2-fold is Idefics3-8B's."""
    tok = tokenizer()
    vocab = len(tok)
    config = transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=PATCH,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=0,
        ),
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(folder)
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 2 * image_size}, max_image_size={"longest_edge": image_size}
    )
    seq_len = (image_size // PATCH) ** 2 // scale**2
    processor = transformers.Idefics3Processor(image_processor, tok, image_seq_len=seq_len, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return model


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB image of (width, height)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
