"""BATCHJOB_CPU_ISA=avx2, an AVX2-only host (Zen 3, Intel client cores) emulated on an AVX-512 one (batchjob/env.py,
cpu_features.py, cpu_native.py): the flags it hides, the build it keys apart, the libraries' caps before torch loads,
and the C++ kernels' op tests and the float32 oracle run again in a child process whose kernels are built without
AVX-512 (cpu_types.h's two-halves vectors and the AVX2 register blocking in paged_attention.cpp)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from batchjob import env
from batchjob.model import cpu_features, cpu_native
from tests.helpers import REPO

AVX2 = {"BATCHJOB_CPU_ISA": "avx2"}
SHOW_CAPS = (
    "import batchjob.env as e; e.configure_threads(); import os, torch\n"
    "print(*(os.environ.get(k) for k in e.ISA_CAPS['avx2']), torch.backends.cpu.get_cpu_capability())"
)


def _child(code: str, **extra: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("BATCHJOB_CPU_ISA", *env.ISA_CAPS["avx2"])}
    return subprocess.run(
        [sys.executable, "-c", code], env=base | extra, cwd=REPO, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def fresh_flags():
    cpu_features.cpu_flags.cache_clear()
    yield
    cpu_features.cpu_flags.cache_clear()


def test_avx2_hides_the_avx512_amx_and_vnni_flags_so_dtype_auto_is_float32(monkeypatch, fresh_flags):
    native = cpu_features.cpu_flags().split()
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "avx2")
    cpu_features.cpu_flags.cache_clear()
    flags = cpu_features.cpu_flags().split()
    assert not [f for f in flags if f.startswith(("avx512", "amx", "avx_vnni"))]
    assert flags == [f for f in native if not f.startswith(("avx512", "amx", "avx_vnni"))]  # the rest as they are
    assert not cpu_features.has_native_bf16()
    assert not cpu_features.has_vnni()  # oneDNN capped at AVX2 multiplies int8 without it


def test_the_avx2_build_has_its_own_flags_and_folder(monkeypatch, fresh_flags):
    native_flags, (native_folder, _) = cpu_native.compiler_flags(), cpu_native.build_paths()
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "avx2")
    cpu_features.cpu_flags.cache_clear()
    assert cpu_native.compiler_flags() == [*native_flags, "-mno-avx512f"]
    assert cpu_native.build_paths()[0] != native_folder


def test_an_unknown_isa_is_the_cpus_own_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "avx3")
    with caplog.at_level(logging.WARNING):
        assert env.cpu_isa() is None
        assert env.cpu_isa() is None
    assert sum("BATCHJOB_CPU_ISA='avx3'" in r.message for r in caplog.records) == 1


def test_configure_threads_caps_onednn_mkl_and_aten_before_torch_loads_unless_the_user_says_otherwise():
    assert _child(SHOW_CAPS).stdout.split()[:3] == ["None"] * 3
    assert _child(SHOW_CAPS, **AVX2).stdout.split() == ["AVX2", "AVX2", "avx2", "AVX2"]
    mine = _child(SHOW_CAPS, **AVX2, ONEDNN_MAX_CPU_ISA="AVX")
    assert mine.stdout.split()[0] == "AVX"


def test_int8_matmuls_are_exact_under_onednns_avx2_int8_gemm():
    """tests/model/test_int8_linear.py in a child whose oneDNN runs AVX2 code (vpmaddubsw, no VNNI): the weights take
    7 bits there, and the product of the quantized operands is still exact (8-bit weights saturate its int16 sums)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/model/test_int8_linear.py"],
        env=os.environ | AVX2 | env.ISA_CAPS["avx2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.slow
def test_the_kernels_built_for_avx2_pass_the_op_tests_and_the_float32_oracle():
    """The op tests (attention prefill, chunks and decodes on every head shape, windows, caps, norms, rotary, SiLU-mul,
    KV store, in float32 and bf16) and the float32 greedy oracle, in a child whose kernels are the -mno-avx512f build
    and whose oneDNN, MKL and ATen run AVX2 code; that build's object code holds no zmm (AVX-512) register."""
    caps = env.ISA_CAPS["avx2"]
    oracle = "tests/oracle/test_oracle.py::test_logits_and_greedy_continuation_match_transformers"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/model/test_cpu_ops.py", oracle],
        env=os.environ | AVX2 | caps,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
    where = _child("from batchjob.model import cpu_native; print(cpu_native.build_paths()[0])", **AVX2).stdout.strip()
    library = os.path.join(where, os.path.basename(where) + ".so")
    assert os.path.exists(library), "the child ran another build than BATCHJOB_CPU_ISA=avx2's"
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
        assert "vfmadd" in code and "ymm" in code and "zmm" not in code
