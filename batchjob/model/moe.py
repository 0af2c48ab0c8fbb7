"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and each expert's
SiLU MLP runs once a step over all the tokens routed to it.

The experts' weights are laid out by the ops backend at load (`ops.moe_experts`), for its `ops.fused_moe`:
- ExpertLinears (the torch ops and the CPU's): each expert's gate_up and down as packed Linears; the step's pairs
  sorted by expert, one matmul pair an active expert. Sizing those matmuls reads the per-expert counts on the host
  once a layer: such a model's steps are not CUDA-graph capturable.
- StackedExperts (the Triton ops): every expert's gate_up in one [E, 2I, H] tensor and down in one [E, H, I], for
  a grouped GEMM over all of them that never reads the device on the host (kernels/moe.py): capturable."""

from __future__ import annotations

import torch

from batchjob.model.backend import OpsBackend
from batchjob.model.matmul.linear import Linear


class ExpertLinears:
    capturable = False  # the per-expert matmuls are sized from counts read on the host

    def __init__(self, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]):
        """Each expert's gate [I, H], up [I, H] and down [H, I]."""
        self.pairs = [(Linear(torch.cat([g, u])), Linear(d)) for g, u, d in zip(gate, up, down)]

    def __len__(self) -> int:
        return len(self.pairs)

    def linears(self, num_experts: int | None = None) -> list[Linear]:
        """The first `num_experts` experts' (all by default) gate_up and down."""
        return [lin for pair in self.pairs[:num_experts] for lin in pair]


class StackedExperts:
    capturable = True

    def __init__(self, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]):
        """Copied into w13 [E, 2I, H] (gate then up, as a dense gate_up) and w2 [E, H, I], where the experts' tensors
        lie; the caller's per-expert tensors are let go once it drops them, one layer at a time."""
        (inter, hidden), e = gate[0].shape, len(gate)
        self.w13 = gate[0].new_empty(e, 2 * inter, hidden)
        self.w2 = down[0].new_empty(e, hidden, inter)
        for i, (g, u, d) in enumerate(zip(gate, up, down)):
            self.w13[i, :inter], self.w13[i, inter:], self.w2[i] = g, u, d

    def __len__(self) -> int:
        return self.w13.shape[0]

    def linears(self, num_experts: int | None = None) -> list[Linear]:
        """The first `num_experts` experts' (all by default) gate_up and down as Linears over views of the stacked
        weights, for counting and timing the model's matmuls (nothing is packed or copied)."""
        n = len(self) if num_experts is None else num_experts
        return [Linear(w[e], pack=False) for e in range(n) for w in (self.w13, self.w2)]


class SparseMoeBlock:
    def __init__(self, router: Linear, experts: ExpertLinears | StackedExperts, top_k: int, norm_topk_prob: bool):
        """`experts`: as the ops backend laid them out (ops.moe_experts)."""
        self.router, self.experts = router, experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def linears(self, num_experts: int | None = None) -> list[Linear]:
        """The router's matmul and the first `num_experts` experts' (every expert's by default)."""
        return [self.router] + self.experts.linears(num_experts)

    @property
    def capturable(self) -> bool:
        return self.experts.capturable

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [T, k] and their weights [T, k] in x's dtype: softmax over all experts in fp32,
        the top k, renormalised to sum 1 where the model says so (HF's Qwen3MoeTopKRouter, MixtralTopKRouter)."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def __call__(self, x: torch.Tensor, ops: OpsBackend) -> torch.Tensor:
        """x [T, H] -> [T, H]: the sum over each row's k experts of weight * down(silu(gate) * up)."""
        weights, experts = self.route(x)
        return ops.fused_moe(x, self.experts, weights, experts)
