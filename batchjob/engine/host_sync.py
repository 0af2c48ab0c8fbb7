"""A guard that raises where a step would make the host wait for the device (a GPU engine allows one wait per step:
reading the sampled rows' logits). On a GPU it is torch's sync debug mode, which sees every synchronising call. On a
CPU nothing waits, so it raises on the ops whose result the host must read before going on (`.item()`, `bool()`,
`nonzero`, masking): the ones that would wait on a GPU. A `.tolist()` or `.cpu()` of a device tensor shows only on a
GPU: on a CPU no copy is made."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose output the host reads (a scalar, or a shape that depends on the data)
_READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.bincount.default,  # sized by the largest value
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostSync(RuntimeError):
    pass


class _DataDependentOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
            raise HostSync(f"{func} reads a device value on the host")
        if func in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            raise HostSync(f"{func} with a boolean mask sizes its result on the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync(device: torch.device) -> Iterator[None]:
    """Raises HostSync (a CPU) or RuntimeError (torch's, on a GPU) at the first synchronisation inside the block."""
    if device.type != "cuda":
        # outside inference mode: in it, `.item()` of a CPU tensor skips the dispatcher
        with torch.inference_mode(False), _DataDependentOps():
            yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: copied from pinned memory, not blocking (a
    blocking copy to a GPU first waits for all the work queued before it, the step's forward pass among it)."""
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on `device`, for indexing a device tensor without a wait (a Python list would be copied blocking)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)
