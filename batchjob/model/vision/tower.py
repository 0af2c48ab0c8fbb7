"""The SigLIP-style vision tower of Idefics3: patch embedding, learned position embeddings indexed by bucketed
fractional coordinates (so that a tile with padding keeps the positions of the grid it was scaled from), pre-LN
encoder layers with bidirectional attention over a tile's real patches, and a final layernorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.model.vision.config import VisionConfig

PREFIX = "model.vision_model."


class VisionTower:
    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        w = {k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith(PREFIX)}
        self.patch_weight = w["embeddings.patch_embedding.weight"]
        self.patch_bias = w["embeddings.patch_embedding.bias"]
        self.position_embedding = w["embeddings.position_embedding.weight"]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layers.{i}."
            attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
            self.layers.append(
                {
                    "norm1": (w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"]),
                    "qkv": (torch.cat([w[n + ".weight"] for n in attn]), torch.cat([w[n + ".bias"] for n in attn])),
                    "out": (w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"]),
                    "norm2": (w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"]),
                    "fc1": (w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]),
                    "fc2": (w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"]),
                }
            )
        self.post_norm = (w["post_layernorm.weight"], w["post_layernorm.bias"])

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, patches]: each real patch's fractional (row, col) within its tile's real patches, bucketed into
        the learned grid; padding patches take position 0, as in transformers."""
        side = self.config.patches_per_side
        device = patch_mask.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        rows, cols = patch_mask.shape[1:]

        def buckets(n_real: torch.Tensor, length: int) -> torch.Tensor:
            frac = torch.arange(length, device=device, dtype=torch.float32)[None, :] * (1.0 / n_real)[:, None]
            return torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)

        h = buckets(patch_mask[:, :, 0].sum(1), rows)
        w = buckets(patch_mask[:, 0, :].sum(1), cols)
        ids = (h[:, :, None] * side + w[:, None, :]).reshape(len(patch_mask), -1)
        return torch.where(patch_mask.reshape(len(patch_mask), -1), ids, 0)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, hidden] for pixel_values [tiles, 3, H, W] and patch_mask [tiles, H/patch, W/patch]."""
        c = self.config
        x = F.conv2d(pixel_values, self.patch_weight, self.patch_bias, stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + F.embedding(self.position_ids(patch_mask), self.position_embedding)
        tiles, n, d = x.shape
        heads, head_dim = c.num_attention_heads, d // c.num_attention_heads
        # padding patches are never attended to (they still attend, and are shuffled into features, as in HF)
        keys = patch_mask.reshape(tiles, 1, 1, n)
        bias = torch.zeros(keys.shape, dtype=x.dtype, device=x.device).masked_fill(~keys, torch.finfo(x.dtype).min)
        approximate = "tanh" if c.hidden_act == "gelu_pytorch_tanh" else "none"
        for layer in self.layers:
            h = F.layer_norm(x, (d,), *layer["norm1"], c.layer_norm_eps)
            q, k, v = F.linear(h, *layer["qkv"]).view(tiles, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = x + F.linear(attn.transpose(1, 2).reshape(tiles, n, d), *layer["out"])
            h = F.layer_norm(x, (d,), *layer["norm2"], c.layer_norm_eps)
            x = x + F.linear(F.gelu(F.linear(h, *layer["fc1"]), approximate=approximate), *layer["fc2"])
        return F.layer_norm(x, (d,), *self.post_norm, c.layer_norm_eps)
