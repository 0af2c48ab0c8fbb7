"""The GPU path's LoRA kernel (kernels/lora.py, SGMV over runs of one adapter) against the torch form
(model/lora/slots.py) in the interpreter on a CPU, for every way a step's rows fall (the torch form's own test's
layouts), in fp32 and fp16, with ranks and widths that do not fill the kernel's tiles."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.kernels import ops as kops
from batchjob.model import ops as ref
from batchjob.model.lora.slots import LoraBatch, LoraSlots
from tests.model.test_lora_slots import STEPS, _adapter

pytestmark = pytest.mark.triton

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sgmv_equals_the_torch_form(device, step, dtype):
    g = torch.Generator().manual_seed(3)
    adapters = [_adapter("a", 2, True, g), _adapter("b", 5, False, g), _adapter("c", 3, True, g)]
    slots = LoraSlots(adapters, 3, torch.device(device), dtype)
    for s, adapter in enumerate(adapters):
        slots.load(s, adapter)
    rows = sum(n for _, n in STEPS[step])
    batch = LoraBatch.build(slots, STEPS[step], torch.device(device))
    for matmul in ("qkv", "o"):
        a, b = slots.a[(0, matmul)], slots.b[(0, matmul)]
        x = (torch.randn(rows, a.shape[1], generator=g) / 2).to(device, dtype)
        y = torch.randn(rows, b.shape[2], generator=g).to(device, dtype)
        expected = y.clone()
        ref.lora_add(x, expected, a, b, batch)
        kops.lora_add(x, y, a, b, batch)
        torch.testing.assert_close(y, expected, **TOL[dtype])


def test_a_step_of_base_rows_only_is_left_alone(device):
    g = torch.Generator().manual_seed(4)
    slots = LoraSlots([_adapter("a", 2, True, g)], 1, torch.device(device), torch.float32)
    batch = LoraBatch.build(slots, [(None, 3)], torch.device(device))
    y = torch.randn(3, 10, generator=g).to(device)
    before = y.clone()
    kops.lora_add(torch.randn(3, 12, generator=g).to(device), y, slots.a[(0, "o")], slots.b[(0, "o")], batch)
    assert torch.equal(y, before)
