"""LoRA adapters per request against transformers + peft on the same weights, in float32: random adapters (rank 8
on every projection, rank 64 with rsLoRA on some) built with peft itself and saved as PEFT folders; rows of both
adapters and of the base model generate greedily in one batch, and each equals peft's output with its adapter."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.engine import Engine, SamplingParams
from batchjob.model.lora.files import LoraError
from tests.conftest import hf_generate
from tests.helpers import peft_adapter

peft = pytest.importorskip("peft", reason="the LoRA oracle needs the test extra")
transformers = pytest.importorskip("transformers", reason="the LoRA oracle needs the test extra")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Scaled up (lora_B x 8) so that each changes the greedy text; the third one as peft draws it, for logprobs
# (logits pushed far apart lose float32 digits in both systems alike).
ADAPTERS = {
    "every-projection-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "some-r64-rslora": {
        "r": 64,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "use_rslora": True,
    },
}
AS_DRAWN = {"as-drawn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL}}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three facts about owls:",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(loaded, tmp_path_factory):
    """name -> (folder, peft model with that adapter)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        name: (root / name, peft_adapter(loaded, root / name, 100 + i, 8.0 if name in ADAPTERS else 1.0, **settings))
        for i, (name, settings) in enumerate((ADAPTERS | AS_DRAWN).items())
    }


@pytest.fixture(scope="module")
def lora_engine(adapters):
    return Engine(
        "smollm2-135m-instruct", dtype="float32",
        lora={"adapters": {name: str(folder) for name, (folder, _) in adapters.items()}, "max_loras": 2},
    )  # fmt: skip


def test_rows_of_two_adapters_and_the_base_model_in_one_batch_equal_peft(lora_engine, adapters, hf_oracle):
    """Every prompt through each adapter and through the base model, all twelve requests in one batch: each row's
    greedy tokens equal transformers + peft with its adapter (the base rows: transformers alone), and an adapter's
    output differs from the base model's (the update is applied, not dropped)."""
    tok = lora_engine.tokenizer
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    outs = lora_engine.generate(prompts, params, use_tqdm=False, lora=loras)
    for prompt, name, out in zip(prompts, loras, outs):
        ids = tok.encode(prompt)
        oracle = hf_oracle[0] if name is None else adapters[name][1]
        want = hf_generate(oracle, ids, MAX_TOKENS, eos_token_id=-1)[0, len(ids) :].tolist()
        assert out.token_ids == want, (prompt, name)
    by = {(p, n): o.token_ids for p, n, o in zip(prompts, loras, outs)}
    for p in PROMPTS:
        assert by[(p, "every-projection-r8")] != by[(p, None)] and by[(p, "some-r64-rslora")] != by[(p, None)]


def test_scoring_through_an_adapter_equals_peft_logprobs(lora_engine, adapters):
    model = adapters["as-drawn-r8"][1]
    ids = lora_engine.tokenizer.encode("A short text to score, through an adapter and without one.")
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    got, base = lora_engine.score([ids, ids], lora=["as-drawn-r8", None], use_tqdm=False)
    expected = [want[i - 1, t].item() for i, t in enumerate(ids) if i]
    assert max(abs(t.logprob - e) for t, e in zip(got.token_logprobs, expected)) <= 1e-4
    assert max(abs(t.logprob - e) for t, e in zip(base.token_logprobs, expected)) > 1e-2


def test_an_adapters_prefix_blocks_are_its_own(lora_engine):
    """The same prompt through the base model, then through an adapter: the adapter's request reads nothing from
    the prefix cache (K/V computed without its update are not its K/V); the same adapter again reads its own."""
    prompt = lora_engine.tokenizer.encode("word " * 40)
    params = SamplingParams(max_tokens=1)
    lora_engine.reset_prefix_cache()
    runs = [
        lora_engine.generate([prompt], params, use_tqdm=False, lora=name)[0]
        for name in (None, "some-r64-rslora", "some-r64-rslora", "every-projection-r8")
    ]
    assert [r.num_cached_tokens for r in runs] == [0, 0, (len(prompt) - 1) // 16 * 16, 0]


def test_an_unknown_adapter_fails_its_request_alone(lora_engine):
    outs = lora_engine.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, lora=["nope", None])
    assert outs[0].finish_reason == "error" and "unknown LoRA adapter 'nope'" in outs[0].error
    assert outs[1].finish_reason in ("length", "stop") and outs[1].error is None


def test_more_adapters_than_slots_run_in_turns(adapters, tmp_path):
    """max_loras 1 with two adapters' rows queued together: the rows of one adapter run at a time, and each row
    still gets its own adapter's tokens."""
    folders = {name: str(folder) for name, (folder, _) in adapters.items()}
    one_slot = Engine("smollm2-135m-instruct", dtype="float32", lora={"adapters": folders, "max_loras": 1})
    names = [*ADAPTERS, *ADAPTERS]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = one_slot.generate([PROMPTS[0]] * 4, params, use_tqdm=False, lora=names)
    alone = {n: one_slot.generate([PROMPTS[0]], params, use_tqdm=False, lora=n)[0].token_ids for n in ADAPTERS}
    assert [o.token_ids for o in outs] == [alone[n] for n in names]
    assert one_slot.runner.lora.loads >= 2 and len(one_slot.runner.lora.slots) == 1


def _copy(folder, dest, config=None, weights=None):
    dest.mkdir()
    cfg = json.loads((folder / "adapter_config.json").read_text()) | (config or {})
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file(weights(tensors) if weights else tensors, dest / "adapter_model.safetensors")
    return dest


def _with_fused_qkv(tensors: dict) -> dict:
    """Layer 0's q_proj also as Phi-3's fused qkv_proj: both would add onto the same output columns of q."""
    q = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    k = q.replace("q_proj", "k_proj").replace("lora_A", "lora_B")
    rank, width = tensors[q].shape[0], tensors[q.replace("lora_A", "lora_B")].shape[0] + 2 * tensors[k].shape[0]
    fused = {q.replace("q_proj", "qkv_proj"): tensors[q].clone()}
    return tensors | fused | {q.replace("q_proj", "qkv_proj").replace("lora_A", "lora_B"): torch.zeros(width, rank)}


def test_a_damaged_or_mismatched_adapter_refuses_the_engine_naming_it(adapters, tmp_path):
    folder = adapters["every-projection-r8"][0]
    first_a = next(k for k in load_file(folder / "adapter_model.safetensors") if "lora_A" in k)
    cases = {
        "dora": (_copy(folder, tmp_path / "dora", {"use_dora": True}), "use_dora"),
        "rank": (_copy(folder, tmp_path / "rank"), "above max_lora_rank 4"),
        "shape": (
            _copy(folder, tmp_path / "shape", weights=lambda t: t | {first_a: torch.zeros(8, 100)}),
            "do not fit the base model",
        ),
        "nan": (
            _copy(folder, tmp_path / "nan", weights=lambda t: t | {first_a: t[first_a] * float("nan")}),
            "NaN",
        ),
        "ints": (
            _copy(folder, tmp_path / "ints", weights=lambda t: t | {first_a: t[first_a].to(torch.int32)}),
            "holds I32, not floating-point weights",
        ),
        "embed": (
            _copy(
                folder,
                tmp_path / "embed",
                weights=lambda t: t | {"base_model.model.lm_head.lora_A.weight": t[first_a].clone()},
            ),
            "not a LoRA weight of a decoder projection",
        ),
        "missing": (tmp_path / "none", "is not a folder"),
        # PEFT's key of a vision-language adapter's tower: the same layer number and projection as a decoder's
        "twice": (
            _copy(
                folder,
                tmp_path / "twice",
                weights=lambda t: (
                    t | {f"vision_model.encoder.{first_a[first_a.index('layers.') :]}": t[first_a].clone()}
                ),
            ),
            "two lora_A weights",
        ),
    }
    cases["overlap"] = (
        _copy(folder, tmp_path / "overlap", weights=_with_fused_qkv),
        "_proj and qkv_proj update the same",
    )
    cases["alpha"] = (_copy(folder, tmp_path / "alpha", {"lora_alpha": 1e308}), "NaN or infinite")
    for name, text in (("garbage", "{not json"), ("deep", "[" * 100_000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(text)
        cases[name] = (tmp_path / name, "not readable JSON")
    for name, (path, why) in cases.items():
        rank = 4 if name == "rank" else 64
        with pytest.raises(LoraError, match=why) as e:
            Engine("smollm2-135m-instruct", lora={"adapters": {name: str(path)}, "max_lora_rank": rank})
        assert f"LoRA adapter {name!r}" in str(e.value)


@pytest.mark.parametrize("ops_backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_adapters_on_a_tiny_qwen3_equal_peft(tmp_path, ops_backend):
    """Qwen3's q/k norms and head_dim 32 (wider than hidden / heads): rank 8 on every projection and rank 64 with
    rsLoRA on some, rows of both and base rows in one batch, each equal to transformers + peft greedily in fp32; on
    the torch ops and on the GPU path's Triton kernels (in the interpreter here)."""
    tiny = pytest.importorskip("tests.oracle.test_tiny_architectures", reason="the oracle needs the test extra")
    base = tiny.build("qwen3-gqa2-headdim32-tied", tmp_path / "qwen3", tiny.tiny_tokenizer().to_str())
    models = {}
    for i, (name, settings) in enumerate(ADAPTERS.items()):
        torch.manual_seed(40 + i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **settings))
        model.save_pretrained(tmp_path / name)
        models[name] = model.eval()
    folders = {name: str(tmp_path / name) for name in ADAPTERS}
    engine = Engine(str(tmp_path / "qwen3"), dtype="float32", lora={"adapters": folders}, ops_backend=ops_backend)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist() for n in (7, 19, 33)]
    names = [None, *ADAPTERS]
    rows = [(p, n) for p in prompts for n in names]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    outs = engine.generate([p for p, _ in rows], params, use_tqdm=False, lora=[n for _, n in rows])
    for (prompt, name), out in zip(rows, outs):
        oracle = base if name is None else models[name]
        assert out.token_ids == hf_generate(oracle, prompt, 10, eos_token_id=-1)[0, len(prompt) :].tolist(), name
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # the adapters change what the model writes


def test_an_adapter_beyond_the_engines_dtype_refuses_it(adapters, tmp_path):
    """Weights finite in float32 but past float16's range once scaled (alpha 1e9 / r 8: lora_B times 1.25e8)
    would be infinite on a float16 engine's slots, every row of the adapter NaN; refused at start, as NaN weights."""
    folder = _copy(adapters["every-projection-r8"][0], tmp_path / "big", {"lora_alpha": 1e9})
    with pytest.raises(LoraError, match="'big'.*beyond float16's range"):
        Engine("smollm2-135m-instruct", dtype="float16", device="cpu", lora={"adapters": {"big": str(folder)}})
    Engine("smollm2-135m-instruct", dtype="float32", device="cpu", lora={"adapters": {"big": str(folder)}})
