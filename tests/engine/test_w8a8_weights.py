"""`engine.weights: w8a8`: int8 matmuls (W8A8) on the real model, end to end through the engine, against the exact
(float32) mode; the setting validated, `auto`'s rule, and the numerics that record it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
import torch

from batchjob.engine import model_runner
from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine
from batchjob.engine.errors import DeviceSettingError
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.spec import JobFileError, load_job
from batchjob.model import llama
from batchjob.model.arithmetic import VERSIONS
from batchjob.model.matmul.int8_linear import Int8Linear
from batchjob.model.matmul.linear import Linear
from tests.conftest import forward_logits, teacher_forced_nll
from tests.helpers import summarize_prompts
from tests.model.test_arithmetic import IDS as TINY_IDS
from tests.model.test_arithmetic import decoder as tiny_decoder

ROOT = Path(__file__).resolve().parents[2]
CONTINUATION = SamplingParams(max_tokens=24, ignore_eos=True)
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's int8 GEMM")


def test_the_setting_is_validated():
    assert EngineConfig().weights == "auto"
    assert EngineConfig(weights="w8a8").weights == "w8a8"
    for bad in ("int2", "W8A8", "INT8", "", None, 8):
        with pytest.raises(pydantic.ValidationError, match="weights"):
            EngineConfig(weights=bad)


def test_a_job_file_takes_the_setting_and_names_a_bad_value(monkeypatch):
    monkeypatch.chdir(ROOT)  # the job file's input path is relative to the repository root
    assert load_job("jobs/summarize.yaml", ["engine.weights=w8a8"]).engine.weights == "w8a8"
    allowed = "'auto', 'dequantize', 'quantized', 'int8', 'int4' or 'w8a8'"
    with pytest.raises(JobFileError, match=f"engine.weights: Input should be {allowed}"):
        load_job("jobs/summarize.yaml", ["engine.weights=int2"])


def test_w8a8_runs_on_a_cpu_only_and_auto_dequantizes():
    cpu, dtype = torch.device("cpu"), torch.float32
    loaded = SimpleNamespace(weights={"w": torch.zeros(4, 4)}, path="float weights")  # no GGUF blocks to keep

    def pick(config: EngineConfig, device: torch.device) -> str:
        return model_runner.pick_weights(config, device, loaded, dtype)

    assert pick(EngineConfig(weights="w8a8"), cpu) == "w8a8"
    assert pick(EngineConfig(weights="dequantize"), cpu) == "dequantize"
    assert pick(EngineConfig(), cpu) == "dequantize"  # the rule: docs/cpu.md#w8a8-matmuls
    with pytest.raises(DeviceSettingError, match="weights: w8a8 runs on a CPU"):
        pick(EngineConfig(weights="w8a8"), torch.device("cuda"))
    assert pick(EngineConfig(), torch.device("cuda")) == "dequantize"


@pytest.fixture(scope="module")
def engines():
    w8a8 = Engine("smollm2-135m-instruct", max_num_batched_tokens=512, dtype="float32", weights="w8a8")
    exact = Engine("smollm2-135m-instruct", max_num_batched_tokens=512, dtype="float32")
    return w8a8, exact


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return summarize_prompts(engines[0].tokenizer)


def test_the_decoder_layers_matmuls_are_int8_and_the_numerics_say_so(engines):
    w8a8, exact = engines
    model = w8a8.runner.model
    assert all(isinstance(lin, Int8Linear) for i in range(len(model.layers)) for lin in model.linears(i))
    assert isinstance(model.lm_head, Linear)  # the LM head stays float: docs/cpu.md#w8a8-matmuls
    gemm = model.layers[0]["qkv"].backend  # onednn-int8, or onednn-int8-w7 without VNNI
    version = str(VERSIONS["w8a8"])  # smoothed: not the int8 of before smoothing
    assert w8a8.numerics == {**exact.numerics, "matmul": f"onednn+{gemm}", "weights": "w8a8", "arithmetic": version}
    assert "weights" not in exact.numerics  # dequantize, the default, is what results from before it were
    layer_bytes = sum(lin.nbytes for lin in model.linears(0))
    assert layer_bytes < 0.3 * sum(lin.nbytes for lin in exact.runner.model.linears(0))  # a quarter, plus scales


def test_w8a8_scores_the_exact_continuation_almost_as_well(engines, prompts):
    """Per-token NLL of the float32 engine's greedy continuation, teacher-forced through each model: w8a8's within
    3 % of float32's on these short continuations (a sanity bound: on the summarize job's 64-token continuations int8
    measured +4.6 %, outside the issue's 1 %, which is why `auto` does not pick it; docs/benchmarks.md). A scale on
    the wrong axis or a misplaced zero point makes it many times larger."""
    w8a8, exact = engines
    conts = [o.token_ids for o in exact.generate(prompts, CONTINUATION)]

    ours = teacher_forced_nll(w8a8.runner.model, prompts, conts)
    ref = teacher_forced_nll(exact.runner.model, prompts, conts)
    assert ref < 1.5  # the exact model's own greedy continuation: confident
    assert abs(ours - ref) <= 0.03 * ref, (ours, ref)


def test_w8a8_greedy_decoding_stays_close_and_does_not_depend_on_the_batch(engines, prompts):
    """Through the engine (batched prefill, decode steps): the first tokens equal float32's on most prompts and the
    continuations share prefixes (int8 moves a near-tie more often than bf16 does: test_bf16.py holds it to 10 of 12);
    each prompt alone gives the same tokens as in the batch (int32 sums are exact)."""
    w8a8, exact = engines
    ours = [o.token_ids for o in w8a8.generate(prompts, CONTINUATION)]
    ref = [o.token_ids for o in exact.generate(prompts, CONTINUATION)]
    first = sum(a[0] == b[0] for a, b in zip(ours, ref))
    shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, ref)]
    assert first >= 7, (first, shared)
    assert sum(shared) >= 0.25 * sum(len(r) for r in ref), shared
    assert [w8a8.generate([p], CONTINUATION)[0].token_ids for p in prompts[:4]] == ours[:4]


def test_smoothing_alone_leaves_the_float_model_as_it_was(monkeypatch, engines, prompts):
    """The SmoothQuant scales folded into the norms and weights at load (model/smoothing.py) cancel exactly: with
    the matmuls kept float (Linear in Int8Linear's place) the smoothed model's logits equal the plain fp32 model's up
    to fp32 rounding, though its weights moved (tens of times on the outlier channels)."""
    monkeypatch.setattr(llama, "Int8Linear", Linear)
    smoothed = Engine("smollm2-135m-instruct", max_num_batched_tokens=512, dtype="float32", weights="w8a8")
    model, exact = smoothed.runner.model, engines[1].runner.model
    assert all(type(lin) is Linear for i in range(len(model.layers)) for lin in model.linears(i))
    moved = model.layers[0]["input_norm"] / exact.layers[0]["input_norm"]
    assert moved.max() / moved.min() > 10, moved  # the scales are not all alike: smoothing did something
    for p in prompts[:4]:
        ours, ref = forward_logits(model, p, last_only=False), forward_logits(exact, p, last_only=False)
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-3)


def test_smoothing_leaves_a_qwen2_with_qkv_biases_as_it_was(monkeypatch):
    """On a Qwen2 shape (q/k/v biases, outlier input channels): the v bias is divided with v's rows, so that with the
    matmuls kept float the smoothed model's logits equal the plain one's up to fp32 rounding."""
    monkeypatch.setattr(llama, "Int8Linear", Linear)
    smoothed, plain = tiny_decoder(torch.float32, w8a8=True), tiny_decoder(torch.float32)
    assert plain.config.attention_bias
    moved = smoothed.layers[0]["input_norm"] / plain.layers[0]["input_norm"]
    assert moved.max() / moved.min() > 4, moved  # sqrt of the 30x outliers: smoothing did something
    ours, ref = forward_logits(smoothed, TINY_IDS, last_only=False), forward_logits(plain, TINY_IDS, last_only=False)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
