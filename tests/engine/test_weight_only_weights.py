"""`engine.weights: int8 | int4` (weight-only, model/matmul/weight_only.py) on the built-in model, end to end: each
decoder layer's matmuls on blocks and nothing float kept beside them, the bytes they take, the NLL of fp32's greedy
continuations within the issue's 1 %, greedy output that starts as fp32's and does not depend on the batch, a job
run through the CLI, and the setting refused where it cannot run.

The built-in SmolLM2 is a Q4_1 GGUF, dequantized at load: its "fp32" is the file's values. int4 (Q4_1) requantizes
those to exactly themselves, so there int4 must equal fp32's greedy output (a check that the blocks and their matmul
are right, not a measure of int4's loss on a float checkpoint); int8 (Q8_0) rounds them to its own grid."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from batchjob.engine import model_runner
from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine
from batchjob.engine.errors import DeviceSettingError
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.exit_codes import EXIT_OK
from batchjob.model.matmul.gguf_linear import GGUFLinear, computable
from batchjob.model.matmul.linear import Linear
from batchjob.model.matmul.weight_only import BLOCK_TYPES
from tests.conftest import teacher_forced_nll
from tests.helpers import documents, summarize_prompts, write_jsonl
from tests.test_cli import ENGINE, run

KINDS = ["int8", "int4"]
CONTINUATION = SamplingParams(max_tokens=32, ignore_eos=True)
pytestmark = pytest.mark.skipif(not computable(torch.float32), reason="a CPU build with AVX-512 computes the blocks")


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {w: Engine("smollm2-135m-instruct", dtype="float32", weights=w) for w in ["dequantize", *KINDS]}


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return summarize_prompts(engines["dequantize"].tokenizer)


@pytest.fixture(scope="module")
def reference(engines, prompts) -> list[list[int]]:
    return [o.token_ids for o in engines["dequantize"].generate(prompts, CONTINUATION)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoder_layers_matmuls_are_blocks_and_the_numerics_say_so(engines, kind):
    engine, exact = engines[kind], engines["dequantize"]
    model = engine.runner.model
    layers = [lin for i in range(len(model.layers)) for lin in model.linears(i)]
    assert all(isinstance(lin, GGUFLinear) for lin in layers)
    assert {p.ggml_type for lin in layers for p in lin.parts} == {int(BLOCK_TYPES[kind])}
    # the embedding stays a float table for the lookup, and the LM head (tied to it) a float matmul
    assert isinstance(model.embed, torch.Tensor) and model.embed.dtype == torch.float32
    assert isinstance(model.lm_head, Linear)
    assert engine.numerics == {**exact.numerics, "matmul": "gguf+onednn", "weights": kind}


@pytest.mark.parametrize(("kind", "share"), [("int8", 8.5 / 32), ("int4", 5 / 32)])
def test_the_layers_weights_take_their_bits_and_no_float_copy_is_kept(engines, kind, share):
    """Per weight 8.5 bits (int8) or 5 (int4) against fp32's 32: the blocks are all a layer's matmuls hold (the
    engine's weight bytes count what each matmul keeps); bf16's 16 bits would be twice int8's share less its scales."""
    model, exact = engines[kind].runner.model, engines["dequantize"].runner.model
    ours = sum(lin.nbytes for i in range(len(model.layers)) for lin in model.linears(i))
    ref = sum(lin.nbytes for i in range(len(exact.layers)) for lin in exact.linears(i))
    assert ours == pytest.approx(share * ref, rel=1e-9)
    assert all(not hasattr(lin, "weight") for i in range(len(model.layers)) for lin in model.linears(i))


@pytest.mark.parametrize("kind", KINDS)
def test_the_nll_of_fp32s_greedy_continuations_is_within_1_percent(engines, prompts, reference, kind):
    """Per-token NLL of the fp32 engine's 32-token greedy continuations of 12 summarize prompts, teacher-forced
    through each model: the weight-only one's within the issue's 1 % of fp32's (measured: int8 +0.46 %, int4 0)."""
    ours = teacher_forced_nll(engines[kind].runner.model, prompts, reference)
    ref = teacher_forced_nll(engines["dequantize"].runner.model, prompts, reference)
    assert ref < 1.5  # the exact model's own greedy continuation: confident
    assert abs(ours - ref) <= 0.01 * ref, (ours, ref)


def test_int8_greedy_output_starts_as_fp32s_and_a_prompt_alone_gives_what_it_gives_in_the_batch(
    engines, prompts, reference
):
    """Measured: the first token as fp32's on 12 of 12, whole 32-token continuations equal on 7."""
    engine = engines["int8"]
    ours = [o.token_ids for o in engine.generate(prompts, CONTINUATION)]
    first = sum(a[0] == b[0] for a, b in zip(ours, reference))
    shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, reference)]
    assert first >= 11, (first, shared)
    assert [engine.generate([p], CONTINUATION)[0].token_ids for p in prompts[:4]] == ours[:4]


def test_int4_on_the_q4_1_file_reproduces_its_values_and_so_fp32s_greedy_output(engines, prompts, reference):
    engine = engines["int4"]
    assert [o.token_ids for o in engine.generate(prompts, CONTINUATION)] == reference
    assert [engine.generate([p], CONTINUATION)[0].token_ids for p in prompts[:4]] == reference[:4]


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_with_weight_only_weights_runs_through_the_cli(tmp_path, kind):
    data = write_jsonl(tmp_path / "in.jsonl", documents(4))
    spec = {
        "model": "smollm2-135m-instruct",
        "input": {"path": str(data)},
        "sampling": {"max_tokens": 6},
        "engine": {**ENGINE, "dtype": "float32", "weights": kind},
        "output": {"path": str(tmp_path / "out")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run(str(tmp_path / "job.yaml"))
    assert result.returncode == EXIT_OK, result.stderr
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert len(rows) == 4 and all(row["output"] and row["error"] is None for row in rows)


def test_the_setting_is_refused_where_it_cannot_run(monkeypatch):
    cpu, loaded = torch.device("cpu"), type("Loaded", (), {"weights": {}, "path": "float weights"})()
    for kind in KINDS:
        assert model_runner.pick_weights(EngineConfig(weights=kind), cpu, loaded, torch.float32) == kind
        with pytest.raises(DeviceSettingError, match=f"weights: {kind} computes its quantized blocks on a CPU"):
            model_runner.pick_weights(EngineConfig(weights=kind), torch.device("cuda"), loaded, torch.float32)
    assert model_runner.pick_weights(EngineConfig(), cpu, loaded, torch.float32) == "dequantize"  # auto: not these
    monkeypatch.setenv("BATCHJOB_CPU_OPS", "torch")  # no C++ kernels: nothing computes the blocks
    with pytest.raises(DeviceSettingError, match="weights: int4 computes its quantized blocks on a CPU with AVX-512"):
        Engine(dtype="float32", weights="int4")
