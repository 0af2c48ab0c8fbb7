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


# Int8 dot products into int32 (vpdpbusd), in the 512-bit and the AVX2 encoding: without them oneDNN's int8 GEMM
# multiplies in vpmaddubsw, whose pairs of u8 x s8 products add up in int16 and saturate past 7-bit weights.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")

# Flags a BATCHJOB_CPU_ISA=avx2 run hides: those an AVX2-only CPU (Zen 3, Intel client cores before Alder Lake)
# lacks; AVX-VNNI too, which oneDNN's ISA cap AVX2 leaves out.
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni")


@functools.cache
def cpu_flags() -> str:
    """The CPU's flags line, less the AVX-512, AMX and AVX-VNNI flags under BATCHJOB_CPU_ISA=avx2."""
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


def has_vnni(flags: str | None = None) -> bool:
    """Whether the CPU (or a flags line) has int8 dot products into int32 (VNNI_FLAGS)."""
    names = set((cpu_flags() if flags is None else flags).split())
    return any(f in names for f in VNNI_FLAGS)


# The flags that decide which kernels run fast here (llama.cpp's and ours): 256- and 512-bit FMA, bf16 dot products,
# int8 dot products (VNNI, in its 512-bit and its AVX2 encoding) and AMX tiles.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_kind(cpuinfo: str | None = None) -> dict:
    """This CPU (or a /proc/cpuinfo text) as a bench report names it: vendor, model name, family and model, and which
    of ISA_FLAGS it has."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            break  # the first processor's block ends at its blank line: the others repeat it
        fields.setdefault(key.strip(), value.strip())
    names = set(fields.get("flags", "" if cpuinfo else platform.processor()).split())
    return {
        "vendor": fields.get("vendor_id", platform.machine()),
        "model_name": fields.get("model name", platform.processor()),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": {f: f in names for f in ISA_FLAGS},
    }


def describe_cpu(kind: dict) -> str:
    """One line: 'AMD EPYC (AuthenticAMD family 25 model 17): avx2 fma avx512f avx512_bf16 avx512_vnni; no ...'."""
    has = [f for f, v in kind["flags"].items() if v]
    lacks = [f for f, v in kind["flags"].items() if not v]
    where = f"{kind['vendor']} family {kind['family']} model {kind['model']}" if kind["family"] else kind["vendor"]
    return f"{kind['model_name']} ({where}): {' '.join(has) or '-'}" + (f"; no {' '.join(lacks)}" if lacks else "")
