"""The LM head on the bf16 dot product (matmul/lm_head.py, csrc/bf16_dot.cpp): float32 logits from bf16 W and x, each
product exact and summed in float32, a row's logits the same whatever its batch. Where the CPU has no AVX512_BF16 (or
the C++ kernels do not build) the head is a float32 Linear, which these tests check too."""

from __future__ import annotations

import pytest
import torch

from batchjob.model.matmul.linear import Linear
from batchjob.model.matmul.lm_head import Bf16DotLinear, bf16_dot_ops, lm_head

CPU = torch.device("cpu")
# What a bf16 head is on this CPU: the bf16 dot product with AVX512_BF16 (and the C++ kernels), else float32 Linear.
HEAD = Linear if bf16_dot_ops(CPU) is None else Bf16DotLinear


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()  # the exact sums of the same bf16 values, rounded once


@pytest.mark.parametrize("n, k", [(49152, 576), (1000, 64), (70, 2)])
def test_logits_keep_float32_precision(n, k):
    w = weight(n, k)
    head = lm_head(w, CPU, keep_weight=False)
    assert isinstance(head, HEAD) and head.shape == (n, k)
    x = torch.randn(2, 3, k).to(torch.bfloat16)  # leading dimensions kept
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, n)
    ref = reference(w, x.reshape(-1, k)).view(2, 3, n)
    # float32 sums: ~1e-6 of the logits' scale; bf16 output would be off by ~4e-3 of it
    assert (logits - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_a_rows_logits_do_not_depend_on_its_batch():
    w = weight(300, 128)
    head = lm_head(w, CPU, keep_weight=False)
    x = torch.randn(41, 128).to(torch.bfloat16)
    alone = torch.cat([head(x[i : i + 1]) for i in range(len(x))])
    for rows in [*range(1, 14), 37, 41]:
        assert torch.equal(head(x[:rows]), alone[:rows]), rows
    assert torch.equal(head(x.flip(0)), alone.flip(0))  # nor on its place


def test_without_the_bf16_dot_product_the_head_is_float32(monkeypatch):
    monkeypatch.setenv("BATCHJOB_CPU_OPS", "torch")  # no C++ kernels: the float32 head, as on a CPU without bf16 dots
    w = weight(100, 64)
    head = lm_head(w, CPU, keep_weight=False)
    assert isinstance(head, Linear) and head.backend in ("onednn", "torch")
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert head(x).dtype == torch.float32 and torch.allclose(head(x), reference(w, x), atol=1e-5)
    assert isinstance(lm_head(w.float(), CPU, keep_weight=True), Linear)  # a float32 model's head: as it was


def test_logits_memory_is_handed_out_again_only_once_nothing_holds_it():
    """Past malloc's 32 MiB a new block faults in afresh each call: the head hands its last block out again, but
    never one a caller still holds (a view of it included)."""
    w = weight(200, 64)
    head = lm_head(w, CPU, keep_weight=False)
    if HEAD is Linear:  # no bf16 dot product here: the float32 head, whose logits are torch's own each call
        assert isinstance(head, Linear) and head(torch.randn(2, 64).to(torch.bfloat16)).dtype == torch.float32
        return
    x, y = torch.randn(8, 64).to(torch.bfloat16), torch.randn(8, 64).to(torch.bfloat16)
    first = head(x)[:3]  # a view held
    kept = first.clone()
    second = head(y)
    assert torch.equal(first, kept) and torch.allclose(second, reference(w, y), atol=1e-5)
    assert first.data_ptr() != second.data_ptr()
    address = second.data_ptr()
    del first, kept, second
    assert head(x).data_ptr() == address  # nothing holds it: the same memory again
    assert torch.equal(head(y[:5]), head(y)[:5])  # the first still held while the second is computed


needs_bf16_dot = pytest.mark.skipif(HEAD is Linear, reason="no AVX512_BF16 bf16_dot here: the fused head is not built")


@needs_bf16_dot
@pytest.mark.parametrize("n, k", [(49152, 576), (1000, 64), (70, 2), (1025, 32)])
def test_fused_logprobs_equal_the_log_softmax_of_the_logits(n, k):
    """bf16_dot_logprobs: log p(target) and the logits above the target's, as log_softmax and count_greater of the
    head's own logits give them, for row counts across its 6-row and 96-row tiles and vocabularies across its
    64-column blocks and 1,024-column chunks (a partial last block too)."""
    w = weight(n, k)
    head = lm_head(w, CPU, keep_weight=False)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 97, 200):
        x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
        targets = torch.randint(0, n, (rows,), generator=g)
        targets[0] = n - 1  # the last column of a partial block
        logits = head(x)
        logprobs, above = head.logprobs(x, targets)
        expected = logits.double().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
        assert logprobs.dtype == torch.float32 and above.dtype == torch.int64
        assert (logprobs.double() - expected).abs().max() < 2e-5 * max(1.0, expected.abs().max().item())
        picked = logits.gather(1, targets[:, None])
        assert torch.equal(above, (logits > picked).sum(-1)), rows  # the very logits: exact counts


@needs_bf16_dot
def test_fused_logprobs_of_a_row_do_not_depend_on_its_batch():
    w = weight(3000, 64)
    head = lm_head(w, CPU, keep_weight=False)
    x = torch.randn(130, 64).to(torch.bfloat16)
    targets = torch.randint(0, 3000, (130,))
    alone = [head.logprobs(x[i : i + 1], targets[i : i + 1]) for i in range(len(x))]
    together = head.logprobs(x, targets)
    assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
    assert torch.equal(together[1], torch.cat([a[1] for a in alone]))


@needs_bf16_dot
def test_fused_logprobs_refuse_targets_outside_the_vocabulary():
    head = lm_head(weight(100, 64), CPU, keep_weight=False)
    x = torch.randn(2, 64).to(torch.bfloat16)
    for bad in ([0, 100], [-1, 0]):
        with pytest.raises(RuntimeError, match="outside the 100 columns"):
            head.logprobs(x, torch.tensor(bad))
    with pytest.raises(RuntimeError, match="one int64 target a row"):
        head.logprobs(x, torch.tensor([0]))
