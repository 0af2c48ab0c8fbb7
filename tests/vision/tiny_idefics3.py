"""A tiny random-weight Idefics3 (SmolVLM's family) saved by transformers as an HF folder with its processor
(batchjob.bench.vision.vlm_export's builder at a size for tests to take seconds), and images for it."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import transformers
from PIL import Image

from batchjob.bench.vision.vlm_export import TINY, write_idefics3


def build(
    folder: Path, image_size: int = TINY.image_size, scale: int = TINY.scale_factor
) -> transformers.Idefics3ForConditionalGeneration:
    """SmolVLM-256M's shape is image_size 32 patches a side, scale 4; 2-fold is Idefics3-8B's."""
    return write_idefics3(folder, dataclasses.replace(TINY, image_size=image_size, scale_factor=scale))


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB image of (width, height)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
