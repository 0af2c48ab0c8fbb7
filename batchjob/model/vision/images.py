"""A prompt with images made into model inputs by the folder's own transformers processor: the image files read
(untrusted: a bad one raises ImageError for its request alone), each `<image>` expanded into the tokens of its tiles
as the processor places them, the tiles' pixels, and each image's content digest for the prefix cache."""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from batchjob.model.vision.config import VisionConfig

ImageSource = Image.Image | bytes | str | os.PathLike


class ImageError(ValueError):
    """An image that cannot be read, or a prompt whose images do not fit it: its request fails, the batch goes on."""


@dataclass
class ImagePrompt:
    token_ids: list[int]
    # [tiles, 3, H, W], every image's tiles in prompt order, and [tiles, H, W], 0 where the processor padded; None
    # once encoded (the engine keeps the features, a fraction of the pixels' size)
    pixel_values: torch.Tensor | None
    pixel_attention_mask: torch.Tensor | None
    positions: list[int]  # the image tokens' positions in token_ids: the feature rows replace them in this order
    image_starts: list[int]  # each image's first image-token position
    digests: list[bytes]  # each image's content digest: identical placeholder tokens, different images


def open_image(source: ImageSource) -> Image.Image:
    """A decoded RGB image from a PIL image, encoded bytes or a local path. Pillow's decompression-bomb limit
    (Image.MAX_IMAGE_PIXELS) stays in force; a truncated or unknown file fails here, not in the processor."""
    try:
        if isinstance(source, Image.Image):
            img = source
        elif isinstance(source, bytes | bytearray):
            img = Image.open(io.BytesIO(source))
        elif isinstance(source, str | os.PathLike):
            img = _load_file(Path(source))
        else:
            raise ImageError(f"an image is a PIL image, bytes or a local path, got {type(source).__name__}")
        img.load()
        if 0 in img.size:  # the processor divides by the sides
            raise ImageError(f"an image with no pixels ({img.size[0]}x{img.size[1]})")
        return img.convert("RGB")
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        raise ImageError("unreadable image: not a format Pillow reads (or not an image)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # Pillow's ways of refusing bytes
        raise ImageError(f"unreadable image: {type(e).__name__}: {str(e)[:200]}") from None


def _load_file(path: Path) -> Image.Image:
    """The image in a regular file, decoded: a FIFO's open would wait for a writer, and a device may never end, so
    the file is opened without blocking and checked to be one before Pillow reads it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError(f"{path} is not a file (a FIFO, a device or a folder)")
    with open(fd, "rb") as f:
        img = Image.open(f)
        img.load()
        return img


def digest(img: Image.Image) -> bytes:
    """sha256 of the decoded pixels and their size: the same picture keys the same blocks whatever its encoding."""
    h = hashlib.sha256(f"{img.mode}:{img.size}".encode())
    h.update(img.tobytes())
    return h.digest()


class ImagePrompter:
    def __init__(self, folder: Path, config: VisionConfig):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(folder)
        self.config = config
        tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token
        self.global_token_id = tokenizer.convert_tokens_to_ids(self.processor.global_image_tag)
        if tokenizer.convert_tokens_to_ids(self.image_token) != config.image_token_id:
            raise ValueError("the processor's image token is not the model's image_token_id")
        tile = (getattr(self.processor.image_processor, "max_image_size", None) or {}).get("longest_edge")
        if tile != config.image_size:
            raise ValueError(f"the image processor's tiles ({tile}) are not the vision tower's {config.image_size}")
        if self.processor.image_seq_len != config.tokens_per_tile:
            raise ValueError(
                f"the processor's image_seq_len {self.processor.image_seq_len} is not the model's "
                f"{config.tokens_per_tile} tokens a tile"
            )

    def __call__(self, prompt: str, images: list[ImageSource]) -> ImagePrompt:
        count = prompt.count(self.image_token)
        if count != len(images):
            raise ImageError(f"the prompt has {count} {self.image_token} but {len(images)} images are given")
        decoded = [open_image(s) for s in images]
        try:
            inputs = self.processor(text=[prompt], images=[decoded], return_tensors="pt")
        except (ValueError, OSError) as e:
            raise ImageError(f"the image processor refused the images: {str(e)[:200]}") from None
        ids = inputs["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.config.image_token_id]
        pixels, mask = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0]
        starts = self._image_starts(ids, positions)
        if len(starts) != len(images) or len(positions) != pixels.shape[0] * self.config.tokens_per_tile:
            raise ImageError("the processor's image tokens do not match its tiles")  # a processor of another family
        return ImagePrompt(ids, pixels, mask.bool(), positions, starts, [digest(img) for img in decoded])

    def _image_starts(self, ids: list[int], positions: list[int]) -> list[int]:
        """Each image's first image-token position: an image's tiles end with its global tile, the run of image
        tokens after `<global-img>`."""
        n = self.config.tokens_per_tile
        starts, opening = [], True
        for run in range(0, len(positions), n):
            first = positions[run]
            if opening:
                starts.append(first)
            opening = first > 0 and ids[first - 1] == self.global_token_id
        return starts
