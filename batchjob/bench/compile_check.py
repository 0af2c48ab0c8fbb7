"""Compile every kernel ahead of time for a CUDA target (default sm_90, H100/H200) on a machine without a GPU: it
catches front-end, type and lowering errors down to PTX and ptxas, which the interpreter cannot see.

    python -m batchjob.bench.compile_check [--arch 90] [--quick]

Needs TRITON_INTERPRET unset (the kernels must be JIT functions) and the ptxas that ships with triton's wheel.
It traces the same launches ops.py makes, for the model shapes below, by swapping each kernel's `[grid](...)`
launch for a recorder while running the wrappers on small CPU tensors.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchjob import env

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float8_e4m3fn: "fp8e4nv",
}


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kw)` records the call instead of launching it."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.fn, args, kwargs))

        return launch


def _signature(fn, args, kwargs):
    names = fn.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts = {}, {}
    for p in fn.params:
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v)}")
    options = {k: v for k, v in kwargs.items() if k not in names}
    return sig, consts, options


def trace_launches(quick: bool = False):
    """(kernel, args, kwargs) of every launch the wrappers make for the model shapes, dtypes and cache kinds."""
    from batchjob.bench.kernel_cases import make_attention_case
    from batchjob.kernels import attention, elementwise, encoder_attention, kv_cache
    from batchjob.model import ops as ref

    calls = []
    patched = []
    modules = (attention, elementwise, encoder_attention, kv_cache)
    for mod in modules:
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                patched.append((mod, name, obj))
                setattr(mod, name, _Recorder(obj, calls))
    checks = [(mod, mod.check_device) for mod in modules]
    try:
        for mod, _ in checks:
            mod.check_device = lambda *a: None  # CPU tensors stand in for CUDA ones: nothing is launched
        shapes = [(9, 3, 64)] if quick else [(9, 3, 64), (32, 8, 128)]
        dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
        for H, KVH, D in shapes:
            for dt in dtypes:
                x = torch.randn(4, 64, dtype=dt)
                w = torch.ones(64, dtype=dt)
                elementwise.rms_norm(x, w, 1e-5)
                elementwise.rms_norm(x, w, 1e-5, x)
                elementwise.silu_and_mul(torch.randn(4, 128, dtype=dt))
                elementwise.gelu_tanh_and_mul(torch.randn(4, 128, dtype=dt))  # Gemma
                q, k = torch.randn(4, H, D, dtype=dt), torch.randn(4, KVH, D, dtype=dt)
                elementwise.rotary(q, k, torch.arange(4), torch.randn(8, D))
                elementwise.rotary(q, k, torch.arange(4), torch.randn(8, D * 3 // 4))  # partial (Phi-4-mini)
                for cache in (dt, ref.FP8_DTYPE):
                    c = make_attention_case(
                        [(5, 3), (99, 1)], heads=H, kv_heads=KVH, head_dim=D, page=16, dtype=dt, cache_dtype=cache
                    )
                    kv_cache.store_kv(c.step_k, c.step_v, c.k_cache, c.v_cache, c.meta.slot_mapping, *c.scales)
                    # split_size small enough that the 100-token decode takes the split + combine path
                    attention.paged_attention_impl(
                        c.q, c.k_cache, c.v_cache, c.meta, c.scale, *c.scales, split_size=attention.DECODE_BLOCK_N
                    )
                    attention.paged_attention_impl(
                        c.q, c.k_cache, c.v_cache, c.meta, c.scale, *c.scales, split_decodes=False
                    )
            # encoders: MiniLM's head dim, BERT-base's, and the largest taken (its narrower tiles, two stages)
            for D in [32] if quick else [32, 64, 256]:
                for dt in dtypes:
                    q = torch.randn(10, H, D, dtype=dt)
                    encoder_attention.varlen_attention(q, q, q, torch.tensor([0, 3, 10], dtype=torch.int32), 0.1)
    finally:
        for mod, check in checks:
            mod.check_device = check
        for mod, name, obj in patched:
            setattr(mod, name, obj)
    return calls


def compile_all(arch: int = 90, quick: bool = False, verbose: bool = True) -> list[tuple[str, str | None]]:
    """(kernel and constexprs, error or None) for each distinct compile."""
    if env.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(
            "batchjob.bench.compile_check needs TRITON_INTERPRET unset (the kernels must be JIT functions)"
        )
    target = GPUTarget("cuda", arch, 32)
    results, seen = [], set()
    for fn, args, kwargs in trace_launches(quick):
        sig, consts, options = _signature(fn, args, kwargs)
        key = (
            fn.__name__,
            tuple(sorted(sig.items())),
            tuple(sorted((k, str(v)) for k, v in consts.items())),
            tuple(sorted(options.items())),
        )
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} {', '.join(f'{k}={v}' for k, v in consts.items())}"
        t0 = time.time()
        try:
            triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
            err = None
        except Exception as e:  # report all, not just the first
            err = f"{type(e).__name__}: {e}"
        results.append((label, err))
        if verbose:
            print(
                f"{'ok  ' if err is None else 'FAIL'} {time.time() - t0:5.1f}s {label}" + (f"\n{err}" if err else ""),
                flush=True,
            )
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="one shape, bf16 only")
    a = ap.parse_args()
    res = compile_all(a.arch, a.quick)
    bad = [r for r in res if r[1]]
    print(f"{len(res) - len(bad)}/{len(res)} compiled for sm_{a.arch}")
    sys.exit(1 if bad else 0)
