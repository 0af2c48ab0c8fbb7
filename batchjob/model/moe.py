"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and each expert's
SiLU MLP runs once a step over all the tokens routed to it.

The step's (token, expert) pairs are sorted by expert, so that each active expert's rows lie together: one gate_up
and one down matmul an active expert (packed Linears, as the dense MLP's), not a loop over tokens. Sizing those
matmuls reads the per-expert counts on the host once a layer: a MoE model's steps are not CUDA-graph capturable
(LlamaModel.capturable)."""

from __future__ import annotations

import torch

from batchjob.model.backend import OpsBackend
from batchjob.model.linear import Linear


class SparseMoeBlock:
    def __init__(self, router: Linear, experts: list[tuple[Linear, Linear]], top_k: int, norm_topk_prob: bool):
        """`experts`: each expert's fused gate_up [2I, H] and down [H, I]."""
        self.router, self.experts = router, experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def linears(self) -> list[Linear]:
        """The router's matmul and every expert's."""
        return [self.router] + [lin for pair in self.experts for lin in pair]

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
        t, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        flat = experts.flatten()  # pair p = (row p // k, its p % k-th expert)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the host read
        rows = x[order // k]
        out = torch.empty_like(rows)
        start = 0
        for (gate_up, down), n in zip(self.experts, counts):
            if n:
                out[start : start + n] = down(ops.silu_and_mul(gate_up(rows[start : start + n])))
                start += n
        out *= weights.flatten()[order].unsqueeze(-1)
        # back to pair order, then each row's k terms summed in a fixed order (no atomics: the same sums on a GPU)
        pairs = torch.empty_like(out)
        pairs[order] = out
        return pairs.view(t, k, x.shape[-1]).sum(dim=1)
