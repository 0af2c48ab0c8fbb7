"""Llama-family decoder (Llama, Mistral, Qwen2, Phi-3, Qwen3 with its q/k norms; Qwen3-MoE and Mixtral with sparse
MoE MLPs, moe.py) over a paged KV cache. Numeric ops come from an ops backend
(backend.OpsBackend: `batchjob.model.cpu_ops` on a CPU, `batchjob.kernels.ops` in Triton on a GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.backend import OpsBackend
from batchjob.model.config import ModelConfig, moe_weight_names
from batchjob.model.lora.slots import LoraBatch
from batchjob.model.matmul.gguf_linear import GGUFLinear, QuantizedWeight
from batchjob.model.matmul.int8_linear import Int8Linear
from batchjob.model.matmul.linear import Linear
from batchjob.model.matmul.lm_head import Bf16DotLinear
from batchjob.model.matmul.lm_head import lm_head as make_lm_head
from batchjob.model.moe import SparseMoeBlock
from batchjob.model.smoothing import AbsMaxRecorder, smoothing_scales

_CALIBRATION_BLOCK = 16  # the scratch KV cache's block size for the calibration pass (any works)
# Rows of a CPU step's MLP computed at once (LlamaModel.mlp): as llama.cpp's micro-batch; at 512 rows a quantized
# matmul dequantizes its weights 4 times a 2,048-token step, ~1 % of its time, and a bf16 GEMM keeps its rate.
MLP_SLICE_ROWS = 512


def _fused(w: dict, prefix: str, fused: str, parts: list[str]) -> torch.Tensor | list[QuantizedWeight]:
    """The weight of projections `parts` (popped from `w`) stacked into one matmul; a checkpoint that stores them
    fused already (Phi-3's qkv_proj and gate_up_proj, in this order) gives its tensor as it is, without a copy. GGUF
    blocks stay apart (each part may have its own type): a list, stacked by the matmul (GGUFLinear); where only some
    parts are blocks, all are dequantized."""
    if prefix + fused + ".weight" in w:
        return w.pop(prefix + fused + ".weight")
    weights = [w.pop(prefix + part + ".weight") for part in parts]
    quantized = [isinstance(t, QuantizedWeight) for t in weights]
    if all(quantized):
        return weights
    return torch.cat([t.dequantize() if q else t for t, q in zip(weights, quantized)])


def embedding(table: torch.Tensor | QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of an embedding table, dequantizing only those of one kept in GGUF blocks."""
    return table.rows(ids) if isinstance(table, QuantizedWeight) else F.embedding(ids, table)


class LlamaModel:
    """Weights fused for fewer, larger matmuls: q/k/v in one, gate/up in one; each matmul a Linear (packed for the
    CPU's GEMM where it can be), or with `w8a8` each decoder layer's dense matmul an Int8Linear (W8A8)."""

    # The norm whose output is the MLP's input, into whose weight the gate_up matmul's smoothing folds.
    MLP_INPUT_NORM = "post_norm"

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: OpsBackend,
        rope_freqs: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        lm_head: bool = True,
        w8a8: bool = False,
        calibration: list[int] | None = None,
    ):
        """Without `lm_head` (an embedding model's hidden states are its output) no head is built, and the weights
        need none. `w8a8` (a CPU's) leaves the LM head, the embedding and a sparse MoE layer's matmuls in the model's
        dtype, and needs `calibration`, the token ids of smoothing.CALIBRATION_TEXT (quantize_w8a8)."""
        self.config, self.ops = config, ops

        def dense(weight, bias=None):  # with w8a8, kept unpacked until quantize_w8a8 smooths and quantizes it
            if isinstance(weight, QuantizedWeight | list):
                return GGUFLinear(weight if isinstance(weight, list) else [weight], bias)
            return Linear(weight, bias, pack=not w8a8)

        c = config
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # a tensor, or GGUF blocks (QuantizedWeight)
        self.norm = w["model.norm.weight"]
        tied = c.tie_word_embeddings
        head = self.embed if tied or not lm_head else w["lm_head.weight"]
        self.lm_head = make_lm_head(head, device, keep_weight=tied) if lm_head else None
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = _fused(w, p + "self_attn.", "qkv_proj", ["q_proj", "k_proj", "v_proj"])
            bias = [w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"] if c.attention_bias else None
            layer = {
                "input_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "qkv": dense(qkv, torch.cat(bias) if bias else None),
                # Llama's attention_bias also biases o_proj, and its mlp_bias all three MLP projections.
                "o": dense(w.pop(p + "self_attn.o_proj.weight"), w.get(p + "self_attn.o_proj.bias")),
                "q_norm": w[p + "self_attn.q_norm.weight"] if c.qk_norm else None,
                "k_norm": w[p + "self_attn.k_norm.weight"] if c.qk_norm else None,
                "moe": None,
            }
            if c.is_moe_layer(i):
                router, names = moe_weight_names(c, i)
                gate, up, down = ([w.pop(expert[j]) for expert in names] for j in range(3))
                experts = ops.moe_experts(gate, up, down)  # laid out for the backend's fused_moe
                layer["moe"] = SparseMoeBlock(Linear(w.pop(router)), experts, c.num_experts_per_tok, c.norm_topk_prob)
            else:
                gate_up = _fused(w, p + "mlp.", "gate_up_proj", ["gate_proj", "up_proj"])
                bias_names = [p + f"mlp.{n}_proj.bias" for n in ("gate", "up")]
                mlp_bias = [w[n] for n in bias_names] if bias_names[0] in w else None
                layer["gate_up"] = dense(gate_up, torch.cat(mlp_bias) if mlp_bias else None)
                layer["down"] = dense(w.pop(p + "mlp.down_proj.weight"), w.get(p + "mlp.down_proj.bias"))
            self.layers.append(layer)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        # [positions, rotary_dim]: the ops turn each head's first rotary_dim dims (partial rotary) and pass the rest.
        self.cos_sin_cache = c.cos_sin_cache(c.max_position_embeddings, rope_freqs, max_model_len).to(device)
        if w8a8 and type(self) is LlamaModel:  # a subclass finishes its own setup first, then quantizes
            self.quantize_w8a8(calibration)

    def quantize_w8a8(self, calibration: list[int] | None) -> None:
        """Each decoder layer's dense matmuls (built unpacked) into Int8Linears, smoothed first (smoothing.py): one
        float pass over the `calibration` tokens records each matmul input's channel maxima; each input channel's
        scale then multiplies the matmul's weight column and divides what writes that channel: the norm before qkv
        and before gate_up, the `up` rows of gate_up before down (act(gate) * up is linear in up), and the v rows of
        qkv before o. The float model's output is unchanged (up to rounding); only what int8 loses changes."""
        if not calibration:
            raise ValueError("w8a8 weights need calibration tokens (smoothing.CALIBRATION_TEXT, tokenized)")
        names = ["qkv", "o", "gate_up", "down"]
        for w in self.layers:
            for name in names:
                if name in w:
                    w[name] = AbsMaxRecorder(w[name])
        self._calibrate(calibration)
        c = self.config
        for w in self.layers:
            absmax = {name: w[name].absmax for name in names if name in w}
            lin = {name: w[name].linear for name in names if name in w}
            weight = {name: lin[name].weight.float().clone() for name in lin}
            bias = {name: None if lin[name].bias is None else lin[name].bias.float().clone() for name in lin}
            dtype = lin["qkv"].weight.dtype
            # qkv's input: the input norm's output
            s = smoothing_scales(absmax["qkv"], weight["qkv"])
            w["input_norm"] = (w["input_norm"].float() / s).to(w["input_norm"].dtype)
            weight["qkv"] *= s
            # o's input: attention's output, per query head a weighted sum of its KV head's v rows. The scale of a
            # channel (head h, dim d) divides v's row (KV head of h, d), so the query heads that share a KV head
            # must share scales: the largest of theirs.
            s = smoothing_scales(absmax["o"], weight["o"])
            group = c.num_attention_heads // c.num_key_value_heads
            s_kv = s.view(c.num_key_value_heads, group, c.head_dim).amax(dim=1)
            weight["o"] *= s_kv[:, None, :].expand(-1, group, -1).reshape(-1)
            v = slice(self.q_size + self.kv_size, None)
            weight["qkv"][v] /= s_kv.reshape(-1, 1)
            if bias["qkv"] is not None:
                bias["qkv"][v] /= s_kv.reshape(-1)
            if w["moe"] is None:
                norm = self.MLP_INPUT_NORM
                s = smoothing_scales(absmax["gate_up"], weight["gate_up"])
                w[norm] = (w[norm].float() / s).to(w[norm].dtype)
                weight["gate_up"] *= s
                s = smoothing_scales(absmax["down"], weight["down"])
                up = slice(weight["down"].shape[1], None)
                weight["down"] *= s
                weight["gate_up"][up] /= s[:, None]
                if bias["gate_up"] is not None:
                    bias["gate_up"][up] /= s
            for name in lin:
                w[name] = Int8Linear(weight[name].to(dtype), bias[name])

    @torch.inference_mode()
    def _calibrate(self, tokens: list[int]) -> None:
        """One prefill of `tokens` on a scratch KV cache, its output unused: the matmuls' recorders keep what they
        saw."""
        c, n = self.config, len(tokens)
        blocks = -(-n // _CALIBRATION_BLOCK)
        shape = (blocks, _CALIBRATION_BLOCK, c.num_key_value_heads, c.head_dim)
        device = self.norm.device
        caches = [tuple(torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2)) for _ in self.layers]
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)), device)
        ids = torch.tensor(tokens, device=device)
        self.forward(ids, torch.arange(n, device=device), meta, caches)

    def linears(self, layer: int) -> list[Linear | Int8Linear]:
        """The decoder layer's matmuls that one token goes through: fused qkv, o, then fused gate_up and down, or a
        sparse layer's router and as many experts' gate_up and down as a token is routed to (all of one shape)."""
        w = self.layers[layer]
        if w["moe"] is None:
            return [w["qkv"], w["o"], w["gate_up"], w["down"]]
        return [w["qkv"], w["o"]] + w["moe"].linears(w["moe"].top_k)

    def all_linears(self) -> list[Linear | Int8Linear | Bf16DotLinear | GGUFLinear]:
        """Every matmul of the model: each layer's (every expert's), then the LM head (where there is one)."""
        every = []
        for w in self.layers:
            every += [w["qkv"], w["o"]] + (w["moe"].linears() if w["moe"] else [w["gate_up"], w["down"]])
        return every + ([self.lm_head] if self.lm_head is not None else [])

    @property
    def capturable(self) -> bool:
        """No host read inside a step besides the ops' own: a sparse MoE layer on the per-expert matmuls reads its
        experts' row counts (moe.py); on the Triton backend's grouped GEMM it reads nothing."""
        return all(w["moe"] is None or w["moe"].capturable for w in self.layers)

    def weight_bytes(self) -> int:
        """What a decode step reads of the weights: every layer's matmuls and norms, and the LM head (every expert:
        a batch of tokens routes to most of them)."""
        norms = sum(
            t.numel() * t.element_size()
            for w in self.layers
            for t in (w["input_norm"], w["post_norm"], w["q_norm"], w["k_norm"])
            if t is not None
        )
        return sum(lin.nbytes for lin in self.all_linears()) + norms

    @property
    def matmul_backend(self) -> str:
        """Whose GEMM runs the matmuls (`onednn` where they are packed, `torch` otherwise), as the numerics name it."""
        return "+".join(sorted({lin.backend for lin in self.all_linears()}))

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
        lora: LoraBatch | None = None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens; K/V of every token is written to the cache. With `lora`,
        each row's adapter (if any) adds its update to the decoder's matmuls. With `image_embeds` (rows, features),
        those rows' embeddings are the image features (a vision-language model's image tokens)."""
        c, ops = self.config, self.ops
        h = embedding(self.embed, input_ids)
        if image_embeds is not None:
            rows, features = image_embeds
            h[rows] = features.to(h.dtype)
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if residual is None:
                x, residual = ops.rms_norm(h, layer["input_norm"], c.rms_norm_eps), h
            else:
                x, residual = ops.rms_norm(h, layer["input_norm"], c.rms_norm_eps, residual)
            qkv = self.project(i, "qkv", x, lora)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, c.num_attention_heads, c.head_dim)
            k = k.view(-1, c.num_key_value_heads, c.head_dim)
            v = v.view(-1, c.num_key_value_heads, c.head_dim)
            if layer["q_norm"] is not None:  # Qwen3: RMSNorm over each head's dims, before rotary
                q = ops.rms_norm(q.reshape(-1, c.head_dim), layer["q_norm"], c.rms_norm_eps).view(q.shape)
                k = ops.rms_norm(k.reshape(-1, c.head_dim), layer["k_norm"], c.rms_norm_eps).view(k.shape)
            q, k = ops.rotary(q, k, positions, self.cos_sin_cache)
            k_cache, v_cache, *scales = cache
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, *scales)
            h = self.project(i, "o", attn.view(-1, self.q_size), lora)
            x, residual = ops.rms_norm(h, layer["post_norm"], c.rms_norm_eps, residual)
            h = layer["moe"](x, ops) if layer["moe"] is not None else self.mlp(i, x, lora)
        out, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
        return out

    def mlp(self, layer: int, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """The dense MLP: down(silu(gate) * up). On a CPU a step of more rows than MLP_SLICE_ROWS runs it a slice of
        rows at a time, so that its largest activations ([rows, 2 x intermediate] and [rows, intermediate]) exist for
        a slice only: at 2,048 rows of Llama-3.2-1B's shape they were 96 MiB of a prefill step's peak memory."""
        rows, ops = x.shape[0], self.ops
        if lora is not None or x.device.type != "cpu" or rows <= MLP_SLICE_ROWS:  # a LoraBatch indexes whole steps
            return self.project(layer, "down", ops.silu_and_mul(self.project(layer, "gate_up", x, lora)), lora)
        gate_up, down = self.layers[layer]["gate_up"], self.layers[layer]["down"]
        out = None
        for start in range(0, rows, MLP_SLICE_ROWS):
            part = down(ops.silu_and_mul(gate_up(x[start : start + MLP_SLICE_ROWS])))
            if out is None:
                out = part.new_empty(rows, part.shape[1])
            out[start : start + part.shape[0]] = part
        return out

    def project(self, layer: int, matmul: str, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """One of the layer's matmuls ("qkv", "o", "gate_up", "down"), with the rows' LoRA updates where any."""
        y = self.layers[layer][matmul](x)
        return y if lora is None else lora.add_to(layer, matmul, x, y, self.ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def score_tokens(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's log-probability of its target token and the count of tokens with a larger logit, without
        the rows' logits materialised, where the head can (Bf16DotLinear); None where only compute_logits can."""
        if isinstance(self.lm_head, Bf16DotLinear):
            return self.lm_head.logprobs(hidden, targets)
        return None
