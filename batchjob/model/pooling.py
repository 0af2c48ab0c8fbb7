"""A sentence embedding from an encoder's last hidden states, as sentence-transformers' Pooling and Normalize
modules compute it: the mean of a sequence's rows, its first row (CLS) or its last, then L2-normalised or not; with
include_prompt false, a prompt's tokens at the start of each sequence are left out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from batchjob.model.errors import ModelLoadError

PoolingMode = Literal["mean", "cls", "lasttoken"]
# 1_Pooling/config.json's flags (sentence-transformers < 5.2; later versions write "pooling_mode" itself)
_FLAGS: dict[str, PoolingMode | None] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass(frozen=True)
class Pooling:
    mode: PoolingMode
    normalize: bool
    include_prompt: bool = True

    @classmethod
    def from_config(cls, cfg: dict, normalize: bool) -> Pooling:
        modes = [cfg["pooling_mode"]] if "pooling_mode" in cfg else [f for f in _FLAGS if cfg.get(f)]
        if len(modes) != 1 or _FLAGS.get(modes[0], modes[0]) not in ("mean", "cls", "lasttoken"):
            # sentence-transformers concatenates several modes' vectors; none of the models wanted here does
            raise ModelLoadError(f"its pooling {modes} is not supported (one of mean, cls, lasttoken)")
        return cls(_FLAGS.get(modes[0], modes[0]), normalize, bool(cfg.get("include_prompt", True)))

    @classmethod
    def from_folder(cls, path: Path, modules: list[dict]) -> Pooling:
        """From a sentence-transformers folder's modules.json entries and its pooling module's config.json."""
        kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        if "Pooling" not in kinds:
            raise ModelLoadError("its modules.json has no Pooling module")
        cfg = json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text())
        return cls.from_config(cfg, normalize="Normalize" in kinds)

    def __call__(
        self,
        hidden: torch.Tensor,
        cu_seqlens: torch.Tensor | list[int],
        prompt_lengths: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """[number of sequences, hidden] in float32 from the packed hidden states [T, hidden]; sequence i is rows
        cu_seqlens[i]:cu_seqlens[i + 1], its first prompt_lengths[i] rows a prompt's. Computed where `hidden` is,
        reading no device value on the host."""
        hidden = hidden.float()  # sums and norms in fp32 whatever the model computed in
        device = hidden.device
        cu = torch.as_tensor(cu_seqlens, device=device).long()
        starts, ends = cu[:-1], cu[1:]
        # the sequence of each row
        seq = torch.repeat_interleave(torch.arange(len(starts), device=device), ends - starts, output_size=len(hidden))
        if not self.include_prompt and prompt_lengths is not None:
            # masked as sentence-transformers masks them: a sequence all prompt pools to zeros
            starts = torch.minimum(starts + torch.as_tensor(prompt_lengths, device=device), ends)
            hidden = hidden * (torch.arange(len(hidden), device=device) >= starts[seq]).unsqueeze(1)
        if self.mode == "cls":
            pooled = hidden[torch.minimum(starts, ends - 1)]
        elif self.mode == "lasttoken":
            pooled = hidden[ends - 1]
        else:
            sums = hidden.new_zeros(len(starts), hidden.shape[1]).index_add_(0, seq, hidden)
            pooled = sums / (ends - starts).clamp(min=1).unsqueeze(1)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled
