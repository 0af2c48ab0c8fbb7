"""Decode steps padded to a CUDA graph's batch size: the sizes and buckets, the padded layout, and the padded body a
graph captures (run eagerly here, as it is for the warm-up before each capture) giving the unpadded step's logits
and greedy tokens; graphs are off on a CPU and with enforce_eager."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from batchjob.engine.config import EngineConfig
from batchjob.engine.decode_graphs import graph_batch_sizes, padded_size
from batchjob.engine.engine import Engine
from batchjob.engine.model_runner import use_cuda_graphs
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence
from batchjob.engine.step_inputs import Padding, build_step_inputs, pack_step


def test_batch_sizes_and_the_bucket_of_a_step():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(8) == [1, 2, 4, 8] and graph_batch_sizes(1) == [1] and graph_batch_sizes(3) == [1, 2, 3]
    sizes = graph_batch_sizes(40)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 8, 9, 17, 33, 40, 41)] == [1, 4, 8, 8, 16, 32, 40, 40, None]


def decode_step(rng: random.Random, num_seqs: int, block_size: int) -> SchedulerOutput:
    out = SchedulerOutput()
    free = list(range(400))
    rng.shuffle(free)
    for i in range(num_seqs):
        seq = Sequence(Request(str(i), [rng.randrange(500) for _ in range(rng.randint(1, 40))], SamplingParams()), i)
        seq.token_ids.append(rng.randrange(500))
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_table = [free.pop() for _ in range(-(-seq.num_tokens // block_size))]
        out.scheduled.append((seq, 1))
    return out


def test_padding_rows_use_the_pad_block_and_never_sample():
    rng = random.Random(0)
    for _ in range(20):
        bs, n = rng.choice([1, 4, 16]), rng.randint(1, 7)
        out = decode_step(rng, n, bs)
        width = -(-64 // bs)
        plain = build_step_inputs(out, bs, torch.device("cpu"))
        packed = pack_step(out, bs, Padding(8, width, 999))
        padded = packed.unpack(packed.host)
        p, m = padded.meta, plain.meta
        assert padded.input_ids[:n].tolist() == plain.input_ids.tolist() and padded.input_ids[n:].eq(0).all()
        assert padded.positions[:n].tolist() == plain.positions.tolist() and padded.positions[n:].eq(0).all()
        assert p.slot_mapping[:n].tolist() == m.slot_mapping.tolist() and p.slot_mapping[n:].eq(999 * bs).all()
        assert p.seq_lens[:n].tolist() == m.seq_lens.tolist() and p.seq_lens[n:].eq(1).all()
        assert p.query_start_loc.tolist() == list(range(9)) and p.seq_lens_host[n:] == [1] * (8 - n)
        assert p.block_tables.shape == (8, width)
        assert p.block_tables[:n, : m.block_tables.shape[1]].tolist() == m.block_tables.tolist()
        assert p.block_tables[:n, m.block_tables.shape[1] :].eq(-1).all()
        assert p.block_tables[n:, 0].eq(999).all() and p.block_tables[n:, 1:].eq(-1).all()
        assert padded.sample_rows.tolist() == plain.sample_rows.tolist() == list(range(n))
        assert packed.sample_rows(packed.host).tolist() == list(range(n))


def tiny_engine(ops: str, **config) -> Engine:
    config = dict(block_size=16, num_kv_blocks=64, max_model_len=1024, max_num_seqs=8, dtype="float32") | config
    return Engine("tiny-llama", load_format="dummy", device="cpu", ops_backend=ops, **config)


@pytest.mark.parametrize("ops", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_a_padded_decode_step_gives_the_unpadded_logits(ops):
    if ops == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    engine = tiny_engine(ops)
    runner, scheduler = engine.runner, engine.scheduler
    assert runner.decode_graphs is None  # a CPU, whatever the ops: the padded body runs only when asked for here
    rng = random.Random(1)
    for i, n in enumerate((17, 20, 26, 33, 40)):  # five sequences (padded to eight rows) over two or three blocks
        scheduler.add(Sequence(Request(str(i), [rng.randrange(3, 500) for _ in range(n)], SamplingParams()), i))
    sched = scheduler.schedule()  # the prompts, then the first decode step
    tokens = runner.execute(sched).argmax(-1).tolist()
    for seq, token in zip(scheduler.advance(sched), tokens):
        seq.token_ids.append(token)
    sched = scheduler.schedule()
    graphs = runner.make_decode_graphs(capture=False)
    assert graphs.fits(sched) and len(sched.scheduled) == 5
    eager = runner.execute(sched)
    hidden, rows = graphs.run(sched)
    assert hidden.shape[0] == 8 and rows.tolist() == list(range(5))
    torch.testing.assert_close(runner.model.compute_logits(hidden[rows]), eager, rtol=1e-4, atol=1e-4)


def test_what_decodes_through_a_graph():
    engine = tiny_engine("torch", max_num_seqs=3, max_model_len=40, block_size=4)
    graphs = engine.runner.make_decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 3] and graphs.max_seq_len == 40
    rng = random.Random(2)
    assert graphs.fits(decode_step(rng, 3, 4))
    assert not graphs.fits(decode_step(rng, 4, 4))  # more sequences than the largest size
    step = decode_step(rng, 2, 4)
    step.scheduled[0][0].num_computed_tokens = 40  # a context past the captured length
    assert not graphs.fits(step)
    step = decode_step(rng, 2, 4)
    step.scheduled[1] = (step.scheduled[1][0], 2)  # a prefill chunk
    assert not graphs.fits(step)


def test_padded_decode_steps_keep_the_greedy_tokens_of_the_real_model():
    """The default model; one prefill step, then decode batches shrinking from 7 to 1 as requests finish."""
    config = dict(max_num_seqs=8, max_model_len=256, num_kv_blocks=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(4, 60))] for _ in range(7)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 3, 5, 8, 12, 16, 20)]
    plain = Engine(**config)
    padded = Engine(**config)
    padded.runner.decode_graphs = padded.runner.make_decode_graphs(capture=False)
    padded_steps = []
    padded.add_step_callback(padded_steps.append)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in padded.generate(prompts, params, use_tqdm=False)] == want
    assert {s.num_seqs for s in padded_steps if s.num_prefill_tokens == 0} == {7, 6, 5, 4, 3, 2, 1}  # 7, 6, 5, 3 padded


def test_graphs_only_on_a_gpu_with_capturable_ops_and_without_enforce_eager():
    """Which ops are capturable is tests/model/test_backend.py's; here, the decision."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capturable, syncing = SimpleNamespace(CAPTURABLE=True), SimpleNamespace(CAPTURABLE=False)
    assert use_cuda_graphs(EngineConfig(), cuda, capturable)
    assert not use_cuda_graphs(EngineConfig(enforce_eager=True), cuda, capturable)
    assert not use_cuda_graphs(EngineConfig(), cuda, syncing)
    assert not use_cuda_graphs(EngineConfig(), cpu, capturable) and not use_cuda_graphs(EngineConfig(), cpu, syncing)
    assert tiny_engine("torch").runner.decode_graphs is None
    assert not EngineConfig().enforce_eager  # vLLM's default: graphs on (where they can be)


@pytest.mark.triton
def test_padded_decode_steps_of_a_moe_model_on_the_triton_ops_keep_the_greedy_tokens(tmp_path):
    """The body a CUDA graph captures for Qwen3-MoE (fused MoE: padding rows are routed like any row, and change
    nothing in the real rows' sums), run eagerly: the torch path's tokens, as decode batches shrink from 4 to 1."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    pytest.importorskip("transformers", reason="the tiny model is made by transformers (test extra)")
    from tests.oracle.test_tiny_architectures import build, tiny_tokenizer

    build("qwen3moe-top2of8-normtopk-mlponly", tmp_path, tiny_tokenizer().to_str())
    config = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, num_kv_blocks=32, block_size=8)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 3, 4, 6)]
    want = [o.token_ids for o in Engine(str(tmp_path), ops_backend="torch", **config).generate(prompts, params)]
    padded = Engine(str(tmp_path), ops_backend="triton", **config)
    padded.runner.set_decode_graphs(True, capture=False)
    steps = []
    padded.add_step_callback(steps.append)
    assert [o.token_ids for o in padded.generate(prompts, params, use_tqdm=False)] == want
    assert {s.num_seqs for s in steps if s.num_prefill_tokens == 0} == {4, 3, 2, 1}  # 3 padded to 4
