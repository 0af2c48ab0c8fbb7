"""`batchjob bench`: one workload through this engine and through baselines in the same process, interleaved in
rounds so that machine drift cancels, reported as ratios to this engine.

Systems: `engine` (continuous batching); `unconstrained` (the engine on the same requests without their output
constraint, each held to the tokens its constrained run made: the same work token for token, so that the ratio is
what constrained decoding costs); `static` (the seed's fixed batch: prompts padded to the batch's longest,
the whole batch decoded until its longest request is done, then the next batch; it reproduces padding's cost, not
its masking); `hf` (transformers `generate` at a fixed batch, left-padded); `vllm` and `llama-cpp` when installed.
The sweep instead runs this engine at several fixed token budgets and at `auto` (token_budget.py).

Workloads: synthetic random tokens as vLLM's benchmark, or a job file's real rows, prompts and sampling."""

from __future__ import annotations

import importlib.util
import itertools
import random
import statistics
import time
from dataclasses import dataclass

import torch

from batchjob.engine.block_manager import KVPoolExhausted
from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request, StepMetrics
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence
from batchjob.job.planner import job_planner
from batchjob.job.reader import InputSource


@dataclass
class Workload:
    requests: list[Request]
    name: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def synthetic(
    vocab_size: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> Workload:
    """As `vllm bench throughput --dataset-name random`: random token ids, lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)], an optional shared prefix; outputs run to output_len."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(100, vocab_size - 100) for _ in range(n)]  # noqa: E731 - skip special ids
    span = lambda n: rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))  # noqa: E731
    prefix = draw(prefix_len)
    reqs = [
        Request(f"r{i}", prefix + draw(span(input_len)), SamplingParams(max_tokens=span(output_len), ignore_eos=True))
        for i in range(num_prompts)
    ]
    name = f"random in={input_len} out={output_len} n={num_prompts} range={range_ratio} prefix={prefix_len}"
    return Workload(reqs, name)


def job_workload(job, engine: Engine, num_rows: int | None = None) -> Workload:
    """A job's first `num_rows` input rows (all by default) as the job runner would send them: its reader, prompt
    builder and planner (order, dedupe, per-row sampling overrides); rows that fail before the model are left out."""
    failed = []
    planner = job_planner(job, engine, lambda row, error: failed.append(row))
    rows = list(itertools.islice(InputSource(job).rows(), num_rows))
    reqs = [w.request for w in planner.works(rows)]
    if not reqs:
        raise ValueError(f"{job.input.path}: none of its first {len(rows)} rows makes a request")
    name = (
        f"job {job.input.path}: {len(rows)} rows, {len(reqs)} requests ({len(failed)} rows fail before the "
        f"model), max_tokens {job.sampling.max_tokens}"
    )
    return Workload(reqs, name)


@dataclass
class Result:
    system: str
    wall: float
    prompt_tokens: int
    output_tokens: int
    num_requests: int
    mean_batch: float = 0.0
    max_batch: int = 0
    mean_kv_usage: float = 0.0
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_kv_usage: float = 0.0  # the KV pool's used fraction summed over decode-only steps: what their attention read
    token_budget: int | None = None  # the engine's at the end of the run: what `auto` chose
    cpu_s: float = 0.0  # this process's CPU time: steadier than wall time on a host shared with other work
    constraint_s: float = 0.0  # of the wall time, spent on output constraints (grammar masks and matchers)
    note: str = ""  # how the system was run, where it differs from its defaults or from the others
    outputs: dict[str, list[int]] | None = None  # output token ids by request id, to compare systems' greedy outputs
    sample_tokens: dict[str, int] | None = None  # by request id, its longest sample's output tokens

    def row(self) -> dict:
        d = dict(self.__dict__)
        d.pop("outputs")
        d.pop("sample_tokens")
        d.update(
            requests_per_s=self.num_requests / self.wall,
            total_tokens_per_s=(self.prompt_tokens + self.output_tokens) / self.wall,
            output_tokens_per_s=self.output_tokens / self.wall,
        )
        return d


def _summarize(system: str, wall: float, wl: Workload, output_tokens: int, steps: list[StepMetrics]) -> Result:
    batch = [s.num_seqs for s in steps] or [0]
    r = Result(
        system,
        wall,
        wl.prompt_tokens,
        output_tokens,
        len(wl.requests),
        statistics.mean(batch),
        max(batch),
        statistics.mean(s.kv_cache_usage for s in steps) if steps else 0.0,
        sum(s.num_preemptions for s in steps),
    )
    if steps:
        r.prefix_hit_rate = steps[-1].prefix_cache_hit_rate
    for s in steps:  # a mixed step counts as prefill: it carries the prompt work
        if s.num_prefill_tokens:
            r.prefill_time += s.step_time
            r.prefill_tokens += s.num_prefill_tokens + s.num_decode_tokens
        else:
            r.decode_time += s.step_time
            r.decode_tokens += s.num_decode_tokens
            r.decode_steps += 1
            r.decode_kv_usage += s.kv_cache_usage
    return r


def run_engine(engine: Engine, wl: Workload, system: str = "engine") -> Result:
    steps: list[StepMetrics] = []
    engine.reset_prefix_cache()  # each run starts cold, not with the previous run's prompts cached
    engine.add_step_callback(steps.append)
    t0, c0, g0 = time.perf_counter(), time.process_time(), engine.structured.seconds
    try:
        outs = list(engine.stream(wl.requests))
    finally:
        engine.remove_step_callback(steps.append)
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    result = _summarize(system, time.perf_counter() - t0, wl, tokens, steps)
    result.token_budget, result.cpu_s = engine.token_budget, time.process_time() - c0
    result.constraint_s = engine.structured.seconds - g0
    result.outputs = {o.request_id: o.token_ids for o in outs}
    result.sample_tokens = {o.request_id: max(len(s.token_ids) for s in o.samples) for o in outs}
    return result


def unconstrained(wl: Workload, sample_tokens: dict[str, int]) -> Workload:
    """The workload without output constraints, each request held to exactly the tokens its constrained run made
    (its longest sample's; ignore_eos), so that both runs compute the same tokens."""
    free = {"response_format": None, "regex": None, "choice": None, "ignore_eos": True}
    reqs = [
        Request(
            r.request_id,
            r.prompt_token_ids,
            r.params.model_copy(update={**free, "max_tokens": max(1, sample_tokens[r.request_id])}),
        )
        for r in wl.requests
    ]
    return Workload(reqs, f"{wl.name}, unconstrained")


def _fitting_batches(requests: list[Request], batch_size: int, free_blocks: int, block_size: int):
    """Fixed batches of `batch_size`; a batch whose padded rows (its longest prompt plus its largest max_tokens
    each) do not all fit `free_blocks` KV blocks is split into the fewest equal parts that do."""
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch) + max(r.params.max_tokens for r in batch)
        fit = free_blocks // -(-longest // block_size)
        if fit == 0:
            raise KVPoolExhausted(f"one padded row of {longest} tokens needs more than the pool's {free_blocks} blocks")
        parts = -(-len(batch) // fit)
        size = -(-len(batch) // parts)
        for j in range(0, len(batch), size):
            yield batch[j : j + size]


def run_static(engine: Engine, wl: Workload, batch_size: int) -> Result:
    """Fixed batches through the same model runner and sampler: each batch is one padded prefill step, then decode
    steps over every row until the longest request has its tokens (finished rows keep computing). A batch that does
    not fit the KV pool is split (the result's note says to what size)."""
    steps: list[StepMetrics] = []
    engine.reset_prefix_cache()
    bm, runner = engine.block_manager, engine.runner
    pad = engine.tokenizer.eos_token_id or 0
    output_tokens = 0
    largest = 0
    t0 = time.perf_counter()
    for batch in _fitting_batches(wl.requests, batch_size, bm.num_free_blocks, bm.block_size):
        largest = max(largest, len(batch))
        longest = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.params.max_tokens for r in batch)
        seqs = [
            Sequence(
                Request(r.request_id, [pad] * (longest - len(r.prompt_token_ids)) + r.prompt_token_ids, r.params), j
            )
            for j, r in enumerate(batch)
        ]
        for step in range(new):
            ts = time.perf_counter()
            sched = SchedulerOutput()
            for s in seqs:
                n = s.num_uncomputed_tokens
                bm.allocate(s, n)
                sched.scheduled.append((s, n))
            if step == 0:
                sched.num_prefill_tokens = len(seqs) * longest
            else:
                sched.num_decode_tokens = len(seqs)
            tokens, _ = engine.sampler(runner.execute(sched), seqs)
            for s, t in zip(seqs, tokens):
                s.num_computed_tokens = s.num_tokens
                s.token_ids.append(t)
            steps.append(
                StepMetrics(
                    step=len(steps),
                    time=time.time(),
                    step_time=time.perf_counter() - ts,
                    num_seqs=len(seqs),
                    num_prefill_tokens=sched.num_prefill_tokens,
                    num_decode_tokens=sched.num_decode_tokens,
                    kv_cache_usage=bm.usage,
                    num_preemptions=0,
                    prefix_cache_queries=0,
                    prefix_cache_hits=0,
                    num_waiting=0,
                    num_running=len(seqs),
                    token_budget=sched.num_batched_tokens,  # a padded batch runs all its tokens: no budget
                )
            )
        output_tokens += sum(r.params.max_tokens for r in batch)  # only the requested tokens count
        for s in seqs:
            bm.free(s)
    result = _summarize("static", time.perf_counter() - t0, wl, output_tokens, steps)
    if largest < min(batch_size, len(wl.requests)):
        result.note = f"batch {batch_size} split to <= {largest} rows: the KV pool holds no more padded rows"
    return result


def load_hf_model(engine: Engine, model_path):
    """transformers' model of the engine's weights: from the files, or with load_format dummy the same seeded draw
    (same config, seed and device give the same weights). fp32 on a CPU, the engine's dtype on a GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = engine.runner.device
    dtype = engine.runner.dtype if device.type == "cuda" else torch.float32
    if engine.config.load_format == "dummy":
        from batchjob.model.dummy import dummy_weights

        cfg = AutoConfig.from_pretrained(str(model_path))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        std = getattr(cfg, "initializer_range", 0.02)
        model.load_state_dict(dummy_weights(engine.model_config, engine.config.seed, std, device, dtype), strict=False)
        return model.eval()
    kw = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    folder = model_path.parent if model_path.suffix == ".gguf" else model_path
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).to(device).eval()


def run_hf(wl: Workload, batch_size: int, hf_model) -> Result:
    """transformers generate over fixed, left-padded batches (greedy, every row to its batch's longest)."""
    device = hf_model.device
    output_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(wl.requests), batch_size):
        batch = wl.requests[i : i + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[j, longest - n :] = torch.tensor(r.prompt_token_ids)
            mask[j, longest - n :] = 1
        new = max(r.params.max_tokens for r in batch)
        with torch.inference_mode():
            hf_model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        output_tokens += sum(r.params.max_tokens for r in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    r = Result(
        "hf", time.perf_counter() - t0, wl.prompt_tokens, output_tokens, len(wl.requests), float(batch_size), batch_size
    )
    return r


# vLLM-CPU reserves one core for its scheduler by default: on a 2-core machine that halves its model's compute.
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
VLLM_CPU_MEMORY_SHARE = 0.3


def load_vllm(engine: Engine, model_path):
    """vLLM's LLM on the engine's weights, exported as an HF folder, in fp32 with every core for the model. Built
    once per bench: its init (compiling the model) takes minutes. Its workers spawn, so a script calling this needs
    an `if __name__ == "__main__":` guard."""
    import os

    from vllm import LLM  # type: ignore[import-not-found]

    from batchjob.bench.hf_export import hf_folder

    os.environ.update(VLLM_ENV)
    return LLM(
        model=str(hf_folder(str(model_path))),
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=engine.max_model_len,
        seed=engine.config.seed,
        # On the CPU backend this is the share of RAM vLLM reserves at start-up; its default 0.92 refuses to start
        # while this process (our engine) and others hold a few GiB.
        gpu_memory_utilization=VLLM_CPU_MEMORY_SHARE,
    )


def run_vllm(llm, engine: Engine, wl: Workload) -> Result:
    """The same token ids, greedy, with each request's max_tokens and EOS rule (ignore_eos, or the engine's EOS
    ids as stop ids)."""
    import vllm  # type: ignore[import-not-found]
    from vllm import SamplingParams as VSP  # type: ignore[import-not-found]

    eos = sorted(engine.eos_token_ids)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests]
    params = [
        VSP(
            max_tokens=r.params.max_tokens,
            ignore_eos=r.params.ignore_eos,
            stop_token_ids=[] if r.params.ignore_eos else eos,
            temperature=0.0,
        )
        for r in wl.requests
    ]
    llm.reset_prefix_cache()  # each run starts cold, as the engine's
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = {r.request_id: list(o.outputs[0].token_ids) for r, o in zip(wl.requests, outs)}
    result = Result("vllm", wall, wl.prompt_tokens, sum(map(len, tokens.values())), len(wl.requests))
    result.cpu_s, result.outputs = time.process_time() - c0, tokens
    result.note = f"vllm {vllm.__version__}, fp32, both cores ({', '.join(f'{k}={v}' for k, v in VLLM_ENV.items())})"
    return result


def run_llama_cpp(model_path, wl: Workload, threads: int) -> Result:
    """llama-cpp-python, one request after another (its Python API has no batched generation)."""
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(model_path=str(model_path), n_ctx=4096, n_threads=threads, verbose=False)
    out_tokens = 0
    t0 = time.perf_counter()
    for r in wl.requests:
        llm.reset()
        for _k, _ in zip(range(r.params.max_tokens), llm.generate(r.prompt_token_ids, temp=0.0)):
            out_tokens += 1
    result = Result("llama-cpp", time.perf_counter() - t0, wl.prompt_tokens, out_tokens, len(wl.requests))
    result.note = "sequential: one request at a time (its Python API has no batched generation)"
    return result


def peer_status() -> dict[str, str | None]:
    """None for a peer that can run here, else why it is skipped."""
    return {
        "hf": None
        if importlib.util.find_spec("transformers")
        else "transformers not installed (pip install -e '.[test]')",
        "vllm": None if importlib.util.find_spec("vllm") else "vllm not installed",
        "llama-cpp": None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python not installed",
    }


def _best_seconds(engine: Engine, fn, reps: int) -> float:
    """The fastest of `reps` timed calls after one untimed: on a shared host, the slower ones timed the neighbours."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(engine: Engine, rows: int, reps: int = 5) -> float:
    """The machine's measured fp32 matmul FLOP/s at the model's weight shapes for `rows` tokens, through the model's
    own matmuls (packed for the CPU's GEMM where they are): the best this machine does at those shapes."""
    model = engine.runner.model
    linears = model.linears(0)
    xs = [torch.randn(rows, lin.shape[1], dtype=model.dtype, device=engine.runner.device) for lin in linears]
    secs = _best_seconds(engine, lambda: [lin(x) for x, lin in zip(xs, linears)], reps)
    return 2 * rows * sum(lin.shape.numel() for lin in linears) / secs


def memory_read_rate(engine: Engine, nbytes: int = 1 << 30, reps: int = 3) -> float:
    """Bytes/s at which the engine's threads read a buffer larger than any cache, front to back (a 1 GiB sum): the
    bound on a decode step's attention, which reads every running sequence's K and V once. Paged KV blocks lie at
    random places in the pool, and a random 12 KiB block was read at about half this rate here (README)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=engine.runner.device)
    return nbytes / _best_seconds(engine, buf.sum, reps)


def model_flops_per_token(engine: Engine) -> int:
    """Matmul FLOPs of one token through the decoder layers (the logits rows are few and left out)."""
    m = engine.runner.model
    return 2 * sum(lin.shape.numel() for i in range(len(m.layers)) for lin in m.linears(i))


def roofline(engine: Engine, result: Result) -> dict:
    per_token = model_flops_per_token(engine)
    out = {}
    for phase, tokens, secs, rows in (
        ("prefill", result.prefill_tokens, result.prefill_time, engine.token_budget),
        (
            "decode",
            result.decode_tokens,
            result.decode_time,
            max(1, round(result.decode_tokens / max(1, result.decode_steps))),
        ),
    ):
        if not tokens or not secs:
            continue
        achieved = per_token * tokens / secs
        peak = matmul_flops(engine, rows)
        out[phase] = {
            "achieved_gflops": achieved / 1e9,
            "matmul_gflops": peak / 1e9,
            "rows": rows,
            "fraction": achieved / peak,
        }
    if "decode" in out and result.decode_kv_usage:
        # Decode's other bound: its attention reads the KV of every running sequence, each step, at memory speed.
        pool_bytes = engine.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token
        kv_bytes = result.decode_kv_usage * pool_bytes
        read_rate = memory_read_rate(engine)
        bound = per_token * result.decode_tokens / (out["decode"]["matmul_gflops"] * 1e9) + kv_bytes / read_rate
        out["decode"] |= {
            "kv_gb_per_step": kv_bytes / result.decode_steps / 1e9,
            "read_gb_per_s": read_rate / 1e9,
            "bound_fraction": bound / result.decode_time,
        }
    return out


def run_bench(
    engine: Engine, model_path, wl: Workload, systems: list[str], batch_size: int, repeats: int, threads: int
) -> dict:
    """Every system once per round, rounds interleaved in rotating order; the median wall time per system is
    reported."""
    skipped = {k: v for k, v in peer_status().items() if k in systems and v}
    constrained = sum(r.params.grammar_key is not None for r in wl.requests)
    if "unconstrained" in systems and not constrained:
        skipped["unconstrained"] = "no request of the workload has an output constraint"
    elif "unconstrained" in systems and "engine" not in systems:
        skipped["unconstrained"] = "it runs the engine's requests at their lengths: needs the engine in --systems"
    systems = [s for s in systems if s not in skipped]
    engine.generate([wl.requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if "vllm" in systems and engine.config.load_format == "dummy":
        skipped["vllm"] = "load_format dummy: vLLM would draw other random weights"
        systems.remove("vllm")
    hf_model = None
    vllm = load_vllm(engine, model_path) if "vllm" in systems else None
    runs: dict[str, list[Result]] = {s: [] for s in systems}
    # With the unconstrained peer, an untimed constrained run first: it compiles the grammars, warms the engine up at
    # the workload's shapes and gives the lengths the unconstrained requests are held to.
    free = unconstrained(wl, run_engine(engine, wl).sample_tokens) if "unconstrained" in systems else None

    def run(system: str) -> Result:
        nonlocal hf_model
        if system == "engine":
            return run_engine(engine, wl)
        if system == "unconstrained":
            result = run_engine(engine, free, system)
            result.outputs = None  # other text by design: not compared
            return result
        if system == "static":
            return run_static(engine, wl, batch_size)
        if system == "hf":
            if hf_model is None:
                hf_model = load_hf_model(engine, model_path)
            return run_hf(wl, batch_size, hf_model)
        if system == "vllm":
            return run_vllm(vllm, engine, wl)
        if system == "llama-cpp":
            return run_llama_cpp(model_path, wl, threads)
        raise ValueError(f"unknown system {system!r}")

    if vllm is not None:
        # vLLM's init compiles and commits GiBs of RAM; whatever runs first after it paid for that in its first round
        # (one engine round 28 s, the other 34 s in one run). An untimed round of every system first.
        for system in systems:
            run(system)
    for k in range(repeats):
        # The order rotates so that no system always runs first.
        for system in systems[k % len(systems) :] + systems[: k % len(systems)]:
            runs[system].append(run(system))
    results = {s: sorted(r, key=lambda x: x.wall)[len(r) // 2] for s, r in runs.items()}
    rows = [results[s].row() for s in systems]
    for row, s in zip(rows, systems):
        row["round_walls"] = [r.wall for r in runs[s]]  # in the order run: the spread a noisy host gives
    base = results.get("engine")
    for row in rows:
        # By requests/s, i.e. wall time on the same requests: the baselines decode every request to max_tokens, so
        # on a workload that stops at EOS their token counts would credit them with tokens the engine never needed.
        row["ratio_to_engine"] = (row["requests_per_s"] / base.row()["requests_per_s"]) if base else None
    report = {
        "workload": wl.name,
        "systems": rows,
        "skipped": skipped,
        "repeats": repeats,
        "batch_size": batch_size,
        "threads": threads,
        "engine_config": engine.config.model_dump(),
        "num_kv_blocks": engine.num_kv_blocks,
    }
    if "unconstrained" in results:
        cpu = {s: statistics.median(r.cpu_s for r in runs[s]) for s in ("engine", "unconstrained")}
        report["constrained"] = {
            "requests": constrained,
            "total": len(wl.requests),
            "ratio": results["unconstrained"].wall / base.wall,
            "cpu_ratio": cpu["unconstrained"] / cpu["engine"],
            "round_ratios": [f.wall / e.wall for e, f in zip(runs["engine"], runs["unconstrained"])],
            "constraint_share": statistics.median(r.constraint_s / r.wall for r in runs["engine"]),
        }
        rows[systems.index("unconstrained")]["note"] = (
            f"engine at {report['constrained']['ratio']:.2f}x of this (constrained: {constrained}/{len(wl.requests)})"
        )
    if base:
        report["roofline"] = roofline(engine, base)
        report["agreement"] = {
            s: agreement(base.outputs, r.outputs) for s, r in results.items() if s != "engine" and r.outputs
        }
    return report


def agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict:
    """How many requests have token-for-token equal outputs, and where the first difference lies in the others."""
    differ = {
        k: next((i for i, (a, b) in enumerate(zip(v, theirs[k])) if a != b), min(len(v), len(theirs[k])))
        for k, v in ours.items()
        if v != theirs.get(k)
    }
    return {"equal": len(ours) - len(differ), "total": len(ours), "first_difference_at": sorted(differ.values())}


def run_sweep(engine: Engine, wl: Workload, budgets: list[int], repeats: int) -> dict:
    """The engine at each fixed token budget and at `auto` (a fresh tuner each run, as at the start of a job), in
    interleaved rounds whose order rotates so that no setting always runs first. Each setting is compared with the
    best fixed budget by its median wall time and, separately, by its median CPU time, which other processes on a
    shared host disturb far less (the engine's threads are this process's)."""
    settings: list[int | str] = [*budgets, "auto"]
    engine.generate([wl.requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    runs: dict[int | str, list[Result]] = {s: [] for s in settings}
    tuners: list[dict] = []
    for k in range(repeats):
        for setting in settings[k % len(settings) :] + settings[: k % len(settings)]:
            engine.set_token_budget(setting)
            runs[setting].append(run_engine(engine, wl, f"budget {setting}"))
            if setting == "auto":
                tuners.append(engine.auto_budget.summary())
    results = {s: sorted(r, key=lambda x: x.wall)[len(r) // 2] for s, r in runs.items()}
    cpu = {s: statistics.median(x.cpu_s for x in r) for s, r in runs.items()}
    rows = [{**results[s].row(), "median_cpu_s": cpu[s]} for s in settings]
    best = max((r for r, s in zip(rows, settings) if s != "auto"), key=lambda r: r["requests_per_s"])
    best_cpu = min(cpu[s] for s in budgets)
    for row, setting in zip(rows, settings):
        row["ratio_to_best_fixed"] = row["requests_per_s"] / best["requests_per_s"]
        row["cpu_ratio_to_best_fixed"] = best_cpu / cpu[setting]
    return {
        "workload": wl.name,
        "systems": rows,
        "best_fixed": best["system"],
        "best_fixed_cpu": f"budget {min(budgets, key=cpu.get)}",
        "auto_ratio": rows[-1]["ratio_to_best_fixed"],
        "auto_cpu_ratio": rows[-1]["cpu_ratio_to_best_fixed"],
        "auto_tuner": tuners,
        "repeats": repeats,
        "budget_cap": engine.budget_cap,
        "engine_config": engine.config.model_dump(),
        "num_kv_blocks": engine.num_kv_blocks,
    }


def format_sweep(report: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"token budget sweep: {report['workload']}")
    for col in (
        "setting",
        "budget used",
        "wall s",
        "total tok/s",
        "vs best fixed",
        "CPU s",
        "vs best (CPU)",
        "mean batch",
        "KV use",
        "preempt",
    ):
        table.add_column(col, justify="right")
    for r in report["systems"]:
        table.add_row(
            r["system"],
            str(r["token_budget"]),
            f"{r['wall']:.2f}",
            f"{r['total_tokens_per_s']:.1f}",
            f"{100 * r['ratio_to_best_fixed']:.1f}%",
            f"{r['median_cpu_s']:.1f}",
            f"{100 * r['cpu_ratio_to_best_fixed']:.1f}%",
            f"{r['mean_batch']:.1f}",
            f"{100 * r['mean_kv_usage']:.1f}%",
            str(r["preemptions"]),
        )
    buf = StringIO()
    console = Console(file=buf, width=150)
    console.print(table)
    console.print(
        f"auto reached {100 * report['auto_ratio']:.1f}% of the best fixed budget by wall time "
        f"({report['best_fixed']}) and {100 * report['auto_cpu_ratio']:.1f}% by CPU time "
        f"({report['best_fixed_cpu']}); medians of {report['repeats']} run(s); tuner cap "
        f"{report['budget_cap']}"
    )
    for k, t in enumerate(report["auto_tuner"]):
        rates = ", ".join(f"{b}: {v:,.0f}" for b, v in t["tokens_per_s_by_budget"].items())
        console.print(
            f"auto run {k + 1}: ended at {t['budget']} ({'settled' if t['settled'] else 'still probing'}, "
            f"{t['moves']} moves); tokens/s by budget {rates}"
        )
    return buf.getvalue()


def format_report(report: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=report["workload"])
    for col in (
        "system",
        "req/s",
        "total tok/s",
        "out tok/s",
        "ratio",
        "mean batch",
        "max batch",
        "KV use",
        "preempt",
        "prefix hit",
    ):
        table.add_column(col, justify="right")
    table.add_column("how it ran")
    for r in report["systems"]:
        ratio = "" if r["ratio_to_engine"] is None else f"{r['ratio_to_engine']:.2f}x"
        table.add_row(
            r["system"],
            f"{r['requests_per_s']:.2f}",
            f"{r['total_tokens_per_s']:.1f}",
            f"{r['output_tokens_per_s']:.1f}",
            ratio,
            f"{r['mean_batch']:.1f}",
            str(r["max_batch"]),
            f"{100 * r['mean_kv_usage']:.1f}%",
            str(r["preemptions"]),
            f"{100 * r['prefix_hit_rate']:.1f}%",
            r["note"],
        )
    buf = StringIO()
    console = Console(file=buf, width=160)
    console.print(table)
    if c := report.get("constrained"):
        console.print(
            f"constrained decoding ({c['requests']}/{c['total']} requests constrained): the engine runs at "
            f"{c['ratio']:.2f}x the throughput of the same requests unconstrained ({c['cpu_ratio']:.2f}x by CPU "
            f"time; rounds {', '.join(f'{r:.2f}x' for r in c['round_ratios'])}), same prompts and output lengths; "
            f"{100 * c['constraint_share']:.1f}% of its wall time went to the grammar (masks and matchers)"
        )
    if report["repeats"] > 1:
        walls = "; ".join(f"{r['system']} {', '.join(f'{w:.1f}' for w in r['round_walls'])}" for r in report["systems"])
        console.print(f"wall time of each round (s): {walls}")
    for phase, v in report.get("roofline", {}).items():
        kv = (
            f"; with its KV reads ({v['kv_gb_per_step']:.2f} GB a step at the host's sequential read rate, "
            f"{v['read_gb_per_s']:.1f} GB/s), "
            f"{100 * v['bound_fraction']:.0f}% of the two bounds' time"
            if "bound_fraction" in v
            else ""
        )
        console.print(
            f"roofline {phase}: engine {v['achieved_gflops']:.1f} GFLOP/s = {100 * v['fraction']:.0f}% of "
            f"measured fp32 matmul {v['matmul_gflops']:.1f} GFLOP/s at {v['rows']} rows{kv}"
        )
    for name, a in report.get("agreement", {}).items():
        where = (
            f"; the others first differ at output tokens {a['first_difference_at']}" if a["equal"] < a["total"] else ""
        )
        console.print(f"greedy outputs of {name} equal to the engine's: {a['equal']}/{a['total']}{where}")
    for name, why in report["skipped"].items():
        console.print(f"skipped {name}: {why}")
    return buf.getvalue()
