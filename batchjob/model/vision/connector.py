"""Idefics3's connector: a pixel shuffle that folds each scale x scale square of patches into one token of
scale**2 times the width, then one linear (no bias) into the language model's hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT = "model.connector.modality_projection.proj.weight"


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] -> [tiles, side*side / scale**2, d * scale**2], in transformers' element order: a
    token gathers its square's patches row by row, each patch's d dims together."""
    tiles, n, d = x.shape
    side = int(n**0.5)
    x = x.view(tiles, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, n // scale**2, d * scale * scale)


def connect(x: torch.Tensor, weight: torch.Tensor, scale: int) -> torch.Tensor:
    return F.linear(pixel_shuffle(x, scale), weight)
