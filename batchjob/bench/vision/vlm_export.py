"""A random-weight Idefics3 (SmolVLM's family) saved by transformers as an HF folder with its processor: the built-in
SmolLM2 tokenizer plus Idefics3's image tokens, SmolVLM-Instruct's chat template and an Idefics3 image processor.
`bench --task image` runs SmolVLM-256M-Instruct's shape (cached once built); the tests a tiny one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken

from batchjob.model.loader import cache_dir, load_model

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
IMAGE_TOKENS += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
# SmolVLM-Instruct's processor chat template, which reads a message's content as a list of parts only.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class Idefics3Shape:
    """The sizes of an Idefics3: a Llama language model, a SigLIP vision tower, the pixel shuffle between them, and
    whether the image processor splits an image into tiles (plus its global one) or squares it into one tile."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_layers: int
    vision_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    scale_factor: int
    image_splitting: bool

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


# A tile: 16x16 pixels, 4x4 patches, 4 image tokens after the pixel shuffle by 2; images split into tiles.
TINY = Idefics3Shape(64, 128, 2, 4, 2, 1024, 10000.0, 32, 64, 2, 4, 16, 4, 2, True)
# SmolVLM-256M-Instruct: SmolLM2-135M's language model; SigLIP base patch 16 at 512 px; a 4-fold shuffle gives 64
# tokens a tile. Every image squared into one 512 px tile (do_image_splitting false), the same for every system.
SMOLVLM_256M = Idefics3Shape(576, 1536, 30, 9, 3, 8192, 100000.0, 768, 3072, 12, 12, 512, 16, 4, False)


def tokenizer():
    """SmolLM2's tokenizer (the built-in model's) with Idefics3's special tokens added after its vocabulary."""
    import transformers

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


def write_idefics3(folder: Path, shape: Idefics3Shape):
    """Saves a random-weight Idefics3 of `shape` with its processor into `folder`; returns transformers' model (fp32).
    The same shape gives the same weights."""
    import transformers

    tok = tokenizer()
    config = transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=shape.vision_hidden_size,
            intermediate_size=shape.vision_intermediate_size,
            num_hidden_layers=shape.vision_layers,
            num_attention_heads=shape.vision_heads,
            image_size=shape.image_size,
            patch_size=shape.patch_size,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            vocab_size=len(tok),
            max_position_embeddings=shape.max_position_embeddings,
            rope_theta=shape.rope_theta,
            rms_norm_eps=1e-5,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=0,
        ),
        scale_factor=shape.scale_factor,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(folder)
    # Split: images up to two tiles a side, each tile plus the global one; otherwise one squared tile an image.
    longest = 2 * shape.image_size if shape.image_splitting else shape.image_size
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": longest},
        max_image_size={"longest_edge": shape.image_size},
        do_image_splitting=shape.image_splitting,
    )
    processor = transformers.Idefics3Processor(
        image_processor, tok, image_seq_len=shape.tokens_per_tile, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(folder)
    return model


def idefics3_folder(shape: Idefics3Shape = SMOLVLM_256M) -> Path:
    """The random-weight Idefics3 of `shape` as an HF folder, written once into the cache (by a digest of the shape),
    atomically: a reader never sees half of it."""
    key = hashlib.sha256(json.dumps(dataclasses.asdict(shape), sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir() / "hf" / f"idefics3-{key}"
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    write_idefics3(tmp, shape)
    if folder.exists():  # another process wrote it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)
    return folder
