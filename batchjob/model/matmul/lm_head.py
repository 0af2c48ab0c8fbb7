"""The LM head: hidden states to float32 logits. On a CPU a bf16 model's head runs on the C++ kernel bf16_dot
(csrc/bf16_dot.cpp) where the CPU has AVX512_BF16: W read as bf16 (half the bytes of a float32 copy, the LM head being
the largest matmul of a small model's decode step) at the bf16 dot product's rate, each product exact and summed in
float32, so the logits keep float32's precision (bf16 logits fall on steps of 1/8 near the top: ties). Elsewhere the
head is a float32 Linear on a CPU and a Linear in the model's dtype on a GPU, as before."""

from __future__ import annotations

import torch

from batchjob.model.cpu_native import native_ops_for
from batchjob.model.matmul.gguf_linear import GGUFLinear, QuantizedWeight
from batchjob.model.matmul.linear import Linear


class Bf16DotLinear:
    """W [out_features, in_features] in bf16, packed once for bf16_dot; callable on x [..., in_features] (cast to
    bf16, exactly where x comes from a bf16 model) into float32 [..., out_features]."""

    backend = "bf16dot"

    def __init__(self, weight: torch.Tensor, ops):
        self.ops, self.shape = ops, weight.shape
        self.packed = ops.bf16_dot_pack(weight.contiguous())
        self._logits: torch.Tensor | None = None  # the last call's, handed out again once nothing holds it

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        out = self._output(rows.shape[0])
        self.ops.bf16_dot(rows, self.packed, out)
        return out.view(*x.shape[:-1], self.shape[0])

    def logprobs(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's log-softmax at its target id and how many logits exceed the target's ([rows] float32 and
        int64), in one pass over W with no [rows, vocab] logits written (bf16_dot_logprobs)."""
        return self.ops.bf16_dot_logprobs(self._rows(x), self.packed, self.shape[0], targets)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] as the kernels read it: contiguous bf16 rows."""
        return x.reshape(-1, self.shape[1]).to(torch.bfloat16).contiguous()

    def _output(self, rows: int) -> torch.Tensor:
        """[rows, out_features] float32 for the logits: the last call's memory where nothing holds any of it any more
        (a decode step's sampler is done with it), else a new block. Past 32 MiB (170 rows of a 49,152 vocabulary)
        malloc maps every new block afresh and its pages fault in again on first write: at 256 rows that cost as
        much as a third of the matmul, every step."""
        last = self._logits
        if last is None or last.shape[0] < rows or torch._C._storage_Use_Count(last.untyped_storage()._cdata) > 2:
            last = self._logits = torch.empty(rows, self.shape[0])
        return last[:rows]


def bf16_dot_ops(device: torch.device):
    """The C++ ops where a bf16 head runs on bf16_dot on this device, else None."""
    ops = native_ops_for(device, torch.bfloat16)
    return ops if ops is not None and ops.bf16_dot_available() else None


def lm_head(
    weight: torch.Tensor | QuantizedWeight, device: str | torch.device, keep_weight: bool
) -> Linear | Bf16DotLinear | GGUFLinear:
    """The head over `weight` (the tied embedding, kept where `keep_weight`, or lm_head.weight): GGUF blocks stay
    blocks, read by GGUFLinear into float32 logits."""
    if isinstance(weight, QuantizedWeight):
        return GGUFLinear([weight], out_dtype=torch.float32)
    device = torch.device(device)
    bf16_on_cpu = device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
    if bf16_on_cpu and (ops := bf16_dot_ops(device)) is not None:
        return Bf16DotLinear(weight, ops)
    # Logits in fp32 on a CPU whatever the model's dtype: bf16 logits keep 8 bits, so near the top (16 to 32 for
    # SmolLM2) they fall on steps of 1/8 and ties appear, which greedy breaks by the lowest id.
    dtype = torch.float32 if device.type == "cpu" else weight.dtype
    return Linear(weight.to(dtype), keep_weight=keep_weight and weight.dtype == dtype)
