"""The version of each numerics path's arithmetic, recorded in a job's numerics as `arithmetic` (results cache keys
and a resume's check read it): a change that moves any result's bits on a path (another kernel, another order of
sums, smoothing) bumps that path's version, so that rows computed before and after the change are never mixed in one
dataset or taken from the cache for one another. Version 1 is the arithmetic of before the label (not recorded, so
those jobs keep their numerics). tests/model/test_arithmetic.py pins a digest of each path's results beside its
version and fails on a change of results that kept the version."""

from __future__ import annotations

VERSIONS: dict[str, int] = {
    "float32": 1,
    # 2: oneDNN's AMX bf16 GEMM in row blocks (linear.py); the LM head on bf16_dot with AVX512_BF16 (lm_head.py)
    # 3: prompt logprobs without alternatives from the head fused with its log-softmax (bf16_dot_logprobs)
    "bfloat16": 3,
    "float16": 1,
    "w8a8": 2,  # 2: SmoothQuant's scales folded in at load (smoothing.py)
    # GGUF's blocks dequantized inside the matmul (matmul/gguf_linear.py): a GGUF's own, or weight-only int8/int4's
    "quantized float32": 1,
    "quantized bfloat16": 1,
    # 2: an encoder's attention one SDPA call per run of one length, unpadded (ops.varlen_attention)
    "embed float32": 2,
    "embed bfloat16": 2,
    "embed float16": 2,
}


# The `engine.weights` settings whose matmuls read GGUF blocks (matmul/gguf_linear.py): one arithmetic, whoever
# quantized them.
QUANTIZED_BLOCKS = ("quantized", "int8", "int4")


def arithmetic_path(dtype: str, weights: str = "dequantize", task: str = "generate") -> str:
    """The path's name: its dtype (float32, bfloat16, float16), `w8a8` with W8A8 matmuls, `quantized` before the
    dtype where the matmuls read quantized blocks (a GGUF's, or weight-only int8/int4), `embed` before an embedding
    model's."""
    path = "w8a8" if weights == "w8a8" else f"quantized {dtype}" if weights in QUANTIZED_BLOCKS else dtype
    return f"embed {path}" if task == "embed" else path


def arithmetic_label(path: str) -> dict[str, str]:
    """The numerics' `arithmetic` entry of `path`: its version, recorded from 2 on."""
    version = VERSIONS[path]
    return {"arithmetic": str(version)} if version > 1 else {}
