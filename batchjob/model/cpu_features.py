"""What this CPU offers, read from /proc/cpuinfo's flags (Linux); elsewhere `platform.processor()`, which names no
flags, so that nothing is assumed."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from batchjob import env

# Instructions that compute on bf16 in hardware (AVX512_BF16's vdpbf16ps, AMX's tiles): oneDNN's bf16 GEMM runs
# about twice the fp32 rate on them, and emulates bf16 slower than fp32 elsewhere.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


# Flags a BATCHJOB_CPU_ISA=avx2 run hides: those an AVX2-only CPU (Zen 3, Intel client cores) lacks.
_BEYOND_AVX2 = ("avx512", "amx")


@functools.cache
def cpu_flags() -> str:
    """The CPU's flags line, less the AVX-512 and AMX flags under BATCHJOB_CPU_ISA=avx2."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    if env.cpu_isa() == "avx2":
        line = " ".join(f for f in line.split() if not f.startswith(_BEYOND_AVX2))
    return line


def has_native_bf16(flags: str | None = None) -> bool:
    """Whether the CPU (or a flags line as /proc/cpuinfo writes it) computes bf16 natively."""
    names = set((cpu_flags() if flags is None else flags).split())
    return any(f in names for f in NATIVE_BF16_FLAGS)
