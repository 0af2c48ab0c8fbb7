"""The systems a workload runs through: this engine, fixed-batch baselines on its model runner (`static`),
transformers `generate` (`hf`), vLLM where installed (llama.cpp's llama-server is in llama_server.py); for
`--task embed`, the Embedder and sentence-transformers `encode`."""

from __future__ import annotations

import importlib.util
import shutil
import time

import torch

from batchjob import env
from batchjob.bench.llama_server import cached_binary, weight_types
from batchjob.bench.measure import Result, summarize
from batchjob.bench.workloads import Workload
from batchjob.engine.block_manager import KVPoolExhausted
from batchjob.engine.embedder import Embedder
from batchjob.engine.engine import Engine
from batchjob.engine.host_memory import peak_rss, reset_peak_rss
from batchjob.engine.outputs import Request, StepMetrics
from batchjob.engine.sequence import Sequence


def run_engine(engine: Engine, wl: Workload, system: str = "engine") -> Result:
    steps: list[StepMetrics] = []
    engine.reset_prefix_cache()  # each run starts cold, not with the previous run's prompts cached
    engine.add_step_callback(steps.append)
    reset_peak_rss()
    t0, c0, g0 = time.perf_counter(), time.process_time(), engine.structured.seconds
    try:
        outs = list(engine.stream(wl.requests))
    finally:
        engine.remove_step_callback(steps.append)
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    result = summarize(system, time.perf_counter() - t0, wl, tokens, steps)
    result.token_budget, result.cpu_s = engine.token_budget, time.process_time() - c0
    result.peak_rss = peak_rss()  # the whole process's: the peers loaded in it too (transformers; vLLM's front end)
    result.note = engine_mode(engine)
    result.constraint_s = engine.structured.seconds - g0
    result.outputs = {o.request_id: o.token_ids for o in outs}
    result.sample_tokens = {o.request_id: max(len(s.token_ids) for s in o.samples) for o in outs}
    return result


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
    runner = engine.step_runner()
    pad = engine.tokenizer.eos_token_id or 0
    output_tokens = 0
    largest = 0
    t0 = time.perf_counter()
    for batch in _fitting_batches(wl.requests, batch_size, runner.num_free_blocks, runner.block_size):
        largest = max(largest, len(batch))
        longest = max(len(r.prompt_token_ids) for r in batch)
        seqs = [
            Sequence(
                Request(r.request_id, [pad] * (longest - len(r.prompt_token_ids)) + r.prompt_token_ids, r.params), j
            )
            for j, r in enumerate(batch)
        ]
        for _ in range(max(r.params.max_tokens for r in batch)):
            ts = time.perf_counter()
            sched = runner.step(seqs)
            steps.append(
                StepMetrics(
                    step=len(steps),
                    time=time.time(),
                    step_time=time.perf_counter() - ts,
                    num_seqs=len(seqs),
                    num_prefill_tokens=sched.num_prefill_tokens,
                    num_decode_tokens=sched.num_decode_tokens,
                    kv_cache_usage=runner.kv_cache_usage,
                    num_preemptions=0,
                    prefix_cache_queries=0,
                    prefix_cache_hits=0,
                    num_waiting=0,
                    num_running=len(seqs),
                    token_budget=sched.num_batched_tokens,  # a padded batch runs all its tokens: no budget
                )
            )
        output_tokens += sum(r.params.max_tokens for r in batch)  # only the requested tokens count
        runner.release(seqs)
    result = summarize("static", time.perf_counter() - t0, wl, output_tokens, steps)
    if largest < min(batch_size, len(wl.requests)):
        result.note = f"batch {batch_size} split to <= {largest} rows: the KV pool holds no more padded rows"
    return result


def load_hf_model(engine: Engine, model_path):
    """transformers' model of the engine's weights: from the files, or with load_format dummy the same seeded draw
    (same config, seed and device give the same weights). fp32 on a CPU, the engine's dtype on a GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = engine.device
    dtype = engine.dtype if device.type == "cuda" else torch.float32
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


def _left_padded(batch: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompts as generate takes them: token ids left-padded to the longest, and the attention mask."""
    longest = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[j, longest - n :] = torch.tensor(r.prompt_token_ids)
        mask[j, longest - n :] = 1
    return ids.to(device), mask.to(device)


def run_hf(wl: Workload, batch_size: int, hf_model) -> Result:
    """transformers generate over fixed, left-padded batches (greedy, every row to its batch's longest)."""
    device = hf_model.device
    output_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(wl.requests), batch_size):
        batch = wl.requests[i : i + batch_size]
        ids, mask = _left_padded(batch, device)
        new = max(r.params.max_tokens for r in batch)
        with torch.inference_mode():
            hf_model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        output_tokens += sum(r.params.max_tokens for r in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    r = Result(
        "hf", time.perf_counter() - t0, wl.prompt_tokens, output_tokens, len(wl.requests), float(batch_size), batch_size
    )
    return r


def hf_greedy(wl: Workload, batch_size: int, hf_model, eos_token_ids: set[int]) -> dict[str, list[int]]:
    """transformers' greedy output of each request, by request id: to its max_tokens or through its first EOS id, as
    the engine stops. In batches of similar prompt lengths (sorted by length), to pad little."""
    if any(r.params.ignore_eos for r in wl.requests):
        raise ValueError("hf_greedy: requests with ignore_eos are not supported (generate stops a batch at EOS)")
    by_length = sorted(wl.requests, key=lambda r: len(r.prompt_token_ids))
    outputs = {}
    for i in range(0, len(by_length), batch_size):
        batch = by_length[i : i + batch_size]
        ids, mask = _left_padded(batch, hf_model.device)
        with torch.inference_mode():
            out = hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(r.params.max_tokens for r in batch),
                do_sample=False,
                eos_token_id=sorted(eos_token_ids),
                pad_token_id=0,
            )
        for r, row in zip(batch, out[:, ids.shape[1] :].tolist()):
            row = row[: r.params.max_tokens]
            stop = next((k for k, t in enumerate(row) if t in eos_token_ids), len(row) - 1)
            outputs[r.request_id] = row[: stop + 1]
    return outputs


# vLLM-CPU reserves one core for its scheduler by default: on a 2-core machine that halves its model's compute.
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")}
VLLM_CPU_MEMORY_SHARE = 0.3


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_mode(engine: Engine) -> str:
    """The dtype the engine computed in and, for a GGUF, the format its weights were read from."""
    mode = dtype_name(engine.dtype)
    if engine.model_path.suffix == ".gguf" and engine.config.load_format != "dummy":
        kept = engine.numerics.get("weights") == "quantized"
        mode += f", weights {weight_types(engine.model_path)} " + (
            "kept quantized" if kept else f"dequantized to {mode}"
        )
    weights = engine.numerics.get("weights")
    if weights == "w8a8":
        mode += ", int8 matmuls (W8A8)"
    elif weights in ("int8", "int4"):
        mode += f", {weights} weights (weight-only)"
    if engine.config.kv_cache_dtype != "auto":
        mode += f", KV {engine.config.kv_cache_dtype}"
    return mode


def load_vllm(engine: Engine, model_path, longest: int | None = None, dtype: str | None = None):
    """vLLM's LLM on the engine's weights, exported as an HF folder (vllm_llm)."""
    from batchjob.bench.hf_export import hf_folder

    # the engine's context, or at most the workload's longest request: vLLM refuses to start where one sequence of
    # its max_model_len would not fit its KV pool (a 128k-context config in 30% of RAM)
    max_model_len = min(engine.max_model_len, longest or engine.max_model_len)
    return vllm_llm(hf_folder(str(model_path)), engine, max_model_len, dtype)


def vllm_llm(folder, engine: Engine, max_model_len: int, dtype: str | None = None, **extra):
    """vLLM's LLM on an HF `folder` in `dtype`, by default the engine's (bf16 is also vLLM-CPU's default for a model
    whose config says bf16, as SmolLM2's does, on every x86 host: on one without native bf16 the engine's default is
    float32), with every core for the model and `extra` LLM arguments. Built once per bench: its init (compiling the
    model) takes minutes. Its workers spawn, so a script calling this needs an `if __name__ == "__main__":` guard."""
    from vllm import LLM  # type: ignore[import-not-found]

    # Its workers start here and keep this environment: vLLM's settings, and OpenMP at its own defaults, not ours.
    with env.scoped({**VLLM_ENV, **env.set_here()}):
        return LLM(
            model=str(folder),
            dtype=dtype or dtype_name(engine.dtype),
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            seed=engine.config.seed,
            # On the CPU backend this is the share of RAM vLLM reserves at start-up; its default 0.92 refuses to
            # start while this process (our engine) and others hold a few GiB.
            gpu_memory_utilization=VLLM_CPU_MEMORY_SHARE,
            **extra,
        )


def vllm_dtype(llm) -> str:
    """The dtype vLLM computes in."""
    return dtype_name(llm.model_config.dtype)


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
    settings = ", ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
    result.note = f"vllm {vllm.__version__}, {vllm_dtype(llm)}, both cores ({settings})"
    return result


def run_embedder(embedder: Embedder, texts: list[str], tokens: int) -> Result:
    """The Embedder on the texts; `tokens` is the texts' count (every system is credited with the same)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = embedder.embed(texts, use_tqdm=False)
    result = Result("embedder", time.perf_counter() - t0, tokens, 0, len(texts))
    result.cpu_s, result.note = time.process_time() - c0, f"{dtype_name(embedder.dtype)}, packed, sorted by length"
    result.note += f", up to {embedder.config.max_num_batched_tokens} tokens a pass"
    result.embeddings = torch.tensor([o.embedding for o in outs])
    return result


def load_sentence_transformer(folder, device: str = "cpu"):
    """sentence-transformers' model of the folder, on `device` (the Embedder's) in fp32 (its default)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device=device)


def run_sentence_transformer(model, texts: list[str], batch_size: int, tokens: int) -> Result:
    """sentence-transformers `encode` at `batch_size` (it sorts the texts by length and pads each batch)."""
    import sentence_transformers

    t0, c0 = time.perf_counter(), time.process_time()
    vectors = model.encode(texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    vectors = vectors.float().cpu()  # on the host, as the Embedder's are: on a GPU, timed to the end of its work
    result = Result(f"st batch {batch_size}", time.perf_counter() - t0, tokens, 0, len(texts), float(batch_size))
    result.cpu_s, result.embeddings = time.process_time() - c0, vectors
    result.note = f"sentence-transformers {sentence_transformers.__version__} encode, float32, sorted by length, padded"
    return result


def peer_status() -> dict[str, str | None]:
    """None for a peer that can run here, else why it is skipped."""
    return {
        "hf": None
        if importlib.util.find_spec("transformers")
        else "transformers not installed (pip install -e '.[test]')",
        "vllm": None if importlib.util.find_spec("vllm") else "vllm not installed",
        "llama-server": None
        if cached_binary() or shutil.which("cmake") and shutil.which("ninja")
        else "no llama-server build cached, and no cmake and ninja here to build one",
        "st": None
        if importlib.util.find_spec("sentence_transformers")
        else "sentence-transformers not installed (pip install -e '.[test]')",
    }
