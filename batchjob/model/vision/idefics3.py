"""Idefics3's image encoder: tiles of pixels in, the language model's embeddings of their image tokens out."""

from __future__ import annotations

import torch

from batchjob.model.vision.config import VisionConfig
from batchjob.model.vision.connector import WEIGHT, connect
from batchjob.model.vision.tower import PREFIX, VisionTower

TEXT_PREFIX = "model.text_model."


def split_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as (the language model's under a Llama's names, the vision tower's and connector's)."""
    text, vision = {}, {}
    for name, t in weights.items():
        if name.startswith(PREFIX) or name == WEIGHT:
            vision[name] = t
        elif name.startswith(TEXT_PREFIX):
            text["model." + name.removeprefix(TEXT_PREFIX)] = t
        else:
            text[name] = t  # lm_head.weight
    return text, vision


class ImageEncoder:
    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        """`weights`: the vision tower's and connector's (split_weights), moved to `device` in their dtype."""
        self.config = config
        w = {k: v.to(device) for k, v in weights.items()}
        self.tower = VisionTower(config, w)
        self.projection = w[WEIGHT]

    def takes(self, pixel_values: torch.Tensor | None, pixel_attention_mask: torch.Tensor | None) -> bool:
        """Whether these are tiles this encoder reads: [tiles, 3, H, W] whose patch grid is the learned one (the
        pixel shuffle folds it into tokens_per_tile tokens), with pixel masks [tiles, H, W]."""
        if not isinstance(pixel_values, torch.Tensor) or not isinstance(pixel_attention_mask, torch.Tensor):
            return False
        c, shape = self.config, tuple(pixel_values.shape)
        if len(shape) != 4 or shape[1] != 3 or tuple(pixel_attention_mask.shape) != (shape[0], *shape[2:]):
            return False
        return shape[2] == shape[3] == c.image_size  # square tiles of image_size: the processor's max_image_size

    @property
    def dtype(self) -> torch.dtype:
        return self.projection.dtype

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """[tiles * tokens_per_tile, text hidden] for tiles [tiles, 3, H, W] and their pixel masks [tiles, H, W]
        (0 where the image processor padded): a patch with any real pixel is real."""
        p = self.config.patch_size
        device = self.projection.device
        mask = pixel_attention_mask.to(device).unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        hidden = self.tower.forward(pixel_values.to(device, self.dtype), mask)
        features = connect(hidden, self.projection, self.config.scale_factor)
        return features.reshape(-1, features.shape[-1])
