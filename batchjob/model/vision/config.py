"""An Idefics3 (SmolVLM) config.json split into its language model's config (a Llama's, for ModelConfig.from_hf)
and the vision side's."""

from __future__ import annotations

from dataclasses import dataclass

IDEFICS3 = "Idefics3ForConditionalGeneration"


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP-style tower (HF's vision_config) and the connector: pixel shuffle by scale_factor, then one linear
    into the language model's hidden size."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # the tile side the position embeddings were learned for
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int
    text_hidden_size: int
    image_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens a tile becomes: its patches, pixel-shuffled scale_factor**2 into one."""
        return self.patches_per_side**2 // self.scale_factor**2


def split_config(cfg: dict) -> tuple[dict, VisionConfig]:
    """The text model's config.json (as a LlamaForCausalLM's) and the vision config. `tie_word_embeddings` is the
    top level's: transformers ties Idefics3's lm_head by it."""
    text, vision = dict(cfg["text_config"]), cfg["vision_config"]
    if text.get("model_type", "llama") != "llama":
        raise ValueError(f"Idefics3 with a {text.get('model_type')!r} language model is not supported (llama is)")
    text["architectures"] = ["LlamaForCausalLM"]
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"vision hidden_act {act!r} is not supported (gelu_pytorch_tanh, gelu)")
    config = VisionConfig(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_hidden_layers=vision["num_hidden_layers"],
        num_attention_heads=vision["num_attention_heads"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        hidden_act=act,
        scale_factor=cfg.get("scale_factor", 2),
        text_hidden_size=text["hidden_size"],
        image_token_id=cfg["image_token_id"],
    )
    if config.hidden_size % config.num_attention_heads or config.patches_per_side % config.scale_factor:
        raise ValueError("vision_config: hidden_size must split into the heads, and the patch grid by scale_factor")
    return text, config
