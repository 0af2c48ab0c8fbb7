"""`batchjob selftest`: the whole device check in one command, ending in one table and one JSON file.

Parts, each guarded (a part that raises is recorded as failed with its error, and the next one runs) and each under
a time cap (what is left when the cap is reached is recorded as skipped), the JSON rewritten after every part so a
run cut short still leaves what it measured:
  kernels     every Triton kernel against the torch reference, per activation dtype, fp8 KV among the cases, decodes
              with the KV bytes read per second; then the attention kernel's tuning sweep (decode split size, key
              tile and warps in bf16; fp32 prefill tiles at head dim 128), each configuration checked and timed;
  equality    the engine on dummy weights, Triton ops against torch ops on the same device, greedy, fp32, mixed-length
              prompts, chunked prefill and preemption forced (both are counted, and the check fails without them);
  graphs      decode steps through CUDA graphs against the same engine with enforce_eager: greedy tokens equal, and
              the decode tokens/s of each;
  throughput  engine (Triton ops; CUDA graphs unless the graphs part failed) against engine (torch ops) and HF
              generate at a fixed batch, on a fixed-length and a mixed-length workload, per model shape, with achieved
              FLOP/s and HBM bytes/s against measured peaks;
  sampling    the sampler on the device against the same sampler on the host (seeded rows of every kind draw the
              same tokens), its draw without a host synchronisation, JSON-constrained outputs that parse, and the
              engine's tokens/s on sampled (temperature 0.7, top_p 0.95, top 5 logprobs), JSON-constrained and
              sampled-and-constrained workloads as a share of greedy's;
  host_sync   the engine (Triton ops) stepping with every host synchronisation inside a step raising;
  kv_sizing   torch's peak memory against kv_cache_memory_fraction of device memory, with CUDA graphs captured up to
              max_num_seqs and a step at the largest token budget;
  real_model  real weights (each built-in model found here without downloading, and each --model path): the engine
              (Triton ops) against transformers on the device, greedy on fixed chat prompts, in fp32 (near-total
              equality) and bf16 (agreement reported against a floor), with both systems' tokens/s; a model not
              found is a skipped row saying how to bring it. Last, so that loading real weights holds up no other.
On a CPU the same parts run on tiny shapes in Triton's interpreter (the tiny-llama config; real_model on its dummy
weights exported as an HF folder, fp32 only, plus any --model path)."""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from batchjob import env
from batchjob.bench.measure import best_seconds, roofline, synchronize
from batchjob.bench.tables import format_check


@dataclass(frozen=True)
class Workload:
    """A throughput workload: random prompts, lengths uniform in len * (1 -/+ range_ratio)."""

    name: str
    prompts: int
    input_len: int
    output_len: int
    range_ratio: float


@dataclass(frozen=True)
class StressShape:
    """The equality and host-sync runs: prompts longer than the token budget are prefilled in chunks, and the pool
    holds fewer blocks than the sequences want, so that they are preempted."""

    prompts: int
    input_len: int
    output_len: int
    token_budget: int
    block_size: int
    kv_blocks: int

    def engine_config(self) -> dict:
        return dict(
            max_num_batched_tokens=self.token_budget,
            num_kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.prompts,
        )


@dataclass(frozen=True)
class GraphsShape:
    """The graphs run: prompts = max_num_seqs, output lengths mixed so that batches shrink through graph sizes."""

    prompts: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class RealShape:
    """The real-model run: the first `prompts` of CHAT_PROMPTS, greedy, `new_tokens` each, in each dtype."""

    prompts: int
    new_tokens: int
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]  # model shapes, dummy weights by default
    kernel_dtypes: tuple[torch.dtype, ...]
    workloads: tuple[Workload, ...]
    batch: int  # the HF baseline's fixed batch
    stress: StressShape
    graphs: GraphsShape
    real: RealShape


PLANS = {
    "cuda": Plan(
        ("smollm2-135m-instruct", "llama-3-8b"),
        (torch.bfloat16, torch.float16, torch.float32),
        (Workload("64x256/64", 64, 256, 64, 0.0), Workload("mixed", 64, 256, 64, 0.75)),
        64,
        StressShape(8, 120, 32, 64, 16, 24),
        GraphsShape(48, 32, 96),
        RealShape(16, 64, ("float32", "bfloat16")),
    ),
    "cpu": Plan(
        ("tiny-llama",),
        (torch.float16,),
        (Workload("2x8/2", 2, 8, 2, 0.0), Workload("mixed", 2, 8, 2, 0.5)),
        2,
        StressShape(3, 30, 6, 16, 4, 14),
        GraphsShape(3, 6, 4),
        RealShape(3, 6, ("float32",)),  # bf16 tl.dot is wrong in the interpreter
    ),
}
# seconds per part, 505 in all: inside device_check.sh's 540 s with start-up. Each part ran far under its cap on the
# last device run (kernels 55 s, equality 15 s, graphs 17 s, throughput 99 s, host_sync 3 s, kv_sizing 4 s), which
# pays for the kernels' new cases (encoder attention, fused MoE: a few compiles per dtype), their tuning sweep (18
# compiles; it stops at the cap by itself) and real_model's: two models' first GGUF conversions (7 s and 21 s
# on a 2-core CPU), exports and transformers' loads.
CAPS = {
    "kernels": 150,
    "equality": 30,
    "throughput": 140,
    "graphs": 30,
    "sampling": 45,
    "host_sync": 10,
    "kv_sizing": 15,
    "real_model": 85,
}
# The real-model part's built-in models, each run where it is here already (never downloaded there).
REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
# Its prompts: short, fixed chat turns of several kinds (facts, code, lists, arithmetic, translation, prose).
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a one-sentence summary of the water cycle.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "Write a haiku about autumn leaves.",
    "What does HTTP stand for?",
    "Explain recursion to a child.",
    "How many days are there in a leap year?",
    "Suggest a name for a friendly robot.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a SQL query that counts the rows of a table named users.",
    "Describe a cat in five words.",
)
# The real-model part's pass floors, per dtype, as shares of the prompts: (first tokens equal, mean share of each
# sequence equal up to its first divergence, sequences equal throughout).
AGREEMENT_FLOORS = {
    # fp32 is the exact mode: the two systems differ by summation order only, so a greedy path parts only at a
    # near-tie of two logits. On the CPU (the dry run's tiny model in the interpreter, and this part's 16 x 64 run
    # of both built-in models on the CPU ops) every sequence was equal; one near-tie in 16 is allowed, not two.
    "float32": (1.0, 0.95, 0.9),
    # bf16 rounds each system's matmuls differently; a near-tie flips and a parted greedy path never rejoins. The
    # same CPU run in bf16: SmolLM2 15/16 first tokens and a prefix share of 0.56, Gemma 3 270M 16/16 and 0.78. The
    # floors leave room under those for the device's other rounding; a broken bf16 path, wrong from its first
    # tokens, lands far below them.
    "bfloat16": (0.85, 0.4, 0.0),
}
# The sampling part's row settings: one of each kind, each seeded so that the device and the host draw alike.
SAMPLED_ROWS = (
    dict(temperature=0.7, top_p=0.95),
    dict(temperature=1.0, top_k=20),
    dict(temperature=0.8, min_p=0.05, repetition_penalty=1.2),
    dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, logprobs=True, top_logprobs=5),
)


class TimeCap(Exception):
    pass


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_peaks(device: torch.device) -> dict:
    """Measured, not spec-sheet: a large matmul in the compute dtype and a device-to-device copy."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    reps = 10 if device.type == "cuda" else 3
    flops = 2 * n**3 / best_seconds(lambda: a @ b, reps, device)
    x = torch.empty((1 << 30) if device.type == "cuda" else (1 << 24), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() / best_seconds(lambda: y.copy_(x), reps, device)  # bytes read and written
    return {"matmul_flops": flops, "matmul_dtype": str(dtype).replace("torch.", ""), "copy_bytes_per_s": bandwidth}


class Check:
    def __init__(
        self,
        device: str,
        json_path: str | None,
        load_format: str = "dummy",
        small: bool | None = None,
        models: tuple[str, ...] = (),  # real_model's model paths, besides the built-in models found here
    ):
        if device == "cpu":
            env.use_triton_interpreter()  # before anything imports the kernels
        self.device = torch.device(device)
        self.small = device == "cpu" if small is None else small
        self.plan = PLANS["cpu" if self.small else "cuda"]
        self.load_format = load_format
        self.models = models
        self.json_path = json_path
        self.rows: list[dict] = []
        self.report: dict = {"device": self._describe(), "parts": {}, "rows": self.rows}

    def _describe(self) -> dict:
        d = {"device": str(self.device), "torch": torch.__version__, "python": platform.python_version()}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            d |= {"name": p.name, "total_memory": p.total_memory, "sm": f"{p.major}.{p.minor}"}
        try:
            import triton

            d["triton"] = triton.__version__
        except ImportError:
            d["triton"] = None
        return d

    def row(self, part: str, check: str, ok: bool | None, **figures) -> None:
        self.rows.append({"part": part, "check": check, "ok": ok, **figures})

    def save(self) -> None:
        if self.json_path:
            tmp = f"{self.json_path}.part"
            with open(tmp, "w") as f:
                json.dump(self.report, f, indent=2, default=str)
            os.replace(tmp, self.json_path)

    def run(self) -> dict:
        for part, fn in (
            ("kernels", self.kernels),
            ("equality", self.equality),
            ("graphs", self.graphs),
            ("throughput", self.throughput),
            ("sampling", self.sampling),
            ("host_sync", self.host_sync),
            ("kv_sizing", self.kv_sizing),
            ("real_model", self.real_model),
        ):
            t0 = time.perf_counter()
            deadline = t0 + CAPS[part]
            status = "passed"
            try:
                fn(deadline)
            except TimeCap as e:
                status = "capped"
                self.row(part, "time cap", None, error=f"{CAPS[part]} s reached; skipped: {e}")
            except Exception as e:  # a failing part is a failed row, not a failed run
                status = "failed"
                self.row(part, "part", False, error=f"{type(e).__name__}: {e}"[:500], trace=traceback.format_exc())
            if status == "passed" and any(r["ok"] is False for r in self.rows if r["part"] == part):
                status = "failed"
            self.report["parts"][part] = {"status": status, "seconds": time.perf_counter() - t0}
            _free(self.device)
            self.save()
        self.report["passed"] = all(p["status"] == "passed" for p in self.report["parts"].values())
        self.save()
        return self.report

    @staticmethod
    def _within(deadline: float, what: str) -> None:
        if time.perf_counter() > deadline:
            raise TimeCap(what)

    # -- parts ------------------------------------------------------------------------------------------------
    def kernels(self, deadline: float) -> None:
        """Every kernel per dtype, then the attention kernel's tuning sweep (last: the cap cuts it first)."""
        from batchjob.bench.kernel_selftest import run_selftest, run_tuning

        device, reps = str(self.device), 0 if self.small else 10
        for dtype in self.plan.kernel_dtypes:
            self._within(deadline, f"kernels in {dtype} and after")
            self._kernel_rows(run_selftest(device, self.small, dtype, reps))
        # the sweep stops at the part's cap by itself, with a row counting what it left: a tuning aid, not a check
        self._kernel_rows(run_tuning(device, self.small, reps, until=deadline))

    def _kernel_rows(self, rows: list[dict]) -> None:
        for r in rows:
            self.row(
                "kernels",
                f"{r['kernel']} {r['case']} {r.get('dtype', '')}",
                r["passed"],
                max_abs_err=r.get("max_abs_err"),
                triton_ms=r.get("triton_ms"),
                torch_ms=r.get("torch_ms"),
                kv_read_tb_per_s=r.get("kv_read_tb_per_s"),
                error=r.get("error"),
            )

    def _engine(self, model: str, ops: str, **config):
        from batchjob.engine.engine import Engine

        config = {"load_format": self.load_format, **config}  # real weights where a part asks for them
        return Engine(model, device=self.device.type, ops_backend=ops, **config)

    def equality(self, deadline: float) -> None:
        from batchjob.bench.workloads import synthetic

        model = self.plan.models[0]
        st = self.plan.stress
        n, inp, out, budget = st.prompts, st.input_len, st.output_len, st.token_budget
        config = dict(dtype="float32", **st.engine_config())
        outputs, counts = {}, {}
        for ops in ("triton", "torch"):
            self._within(deadline, f"equality with {ops} ops")
            engine = self._engine(model, ops, enforce_eager=True, **config)  # the kernels' check; graphs have theirs
            wl = synthetic(engine.model_config.vocab_size, n, inp, out, range_ratio=0.65, seed=1)
            steps = []
            engine.add_step_callback(steps.append)
            outs = list(engine.stream(wl.requests))
            outputs[ops] = {o.request_id: o.token_ids for o in outs}
            counts[ops] = {
                "preemptions": sum(s.num_preemptions for s in steps),
                "longest_prompt": max(len(r.prompt_token_ids) for r in wl.requests),
                "token_budget": budget,
            }
            del engine
            _free(self.device)
        a, b = outputs["triton"], outputs["torch"]
        same = sum(a[k] == b[k] for k in a)
        forced = counts["torch"]["preemptions"] > 0 and counts["torch"]["longest_prompt"] > budget
        self.row(
            "equality",
            f"{model} greedy triton == torch (fp32, {n} prompts)",
            same == len(a) and forced,
            sequences_equal=f"{same}/{len(a)}",
            **{f"{k}_{ops}": v for ops, c in counts.items() for k, v in c.items()},
        )

    def throughput(self, deadline: float) -> None:
        from batchjob.bench.systems import load_hf_model, run_engine, run_hf
        from batchjob.bench.workloads import synthetic

        peaks = device_peaks(self.device)
        self.report["peaks"] = peaks
        self.row(
            "throughput",
            "device peaks (measured)",
            None,
            matmul_tflops=peaks["matmul_flops"] / 1e12,
            copy_gb_per_s=peaks["copy_bytes_per_s"] / 1e9,
        )
        # the engine as users run it, decode through CUDA graphs, unless the graphs part found them failing
        graphs = self.report["parts"].get("graphs", {}).get("status") == "passed"
        for model in self.plan.models:
            results: dict[str, dict] = {}
            for system in ("triton", "torch", "hf"):
                self._within(deadline, f"{model} {system} and after")
                # the HF peer needs the engine's config, device and dtype, not its KV pool
                engine = (
                    self._engine(model, "torch", num_kv_blocks=16)
                    if system == "hf"
                    else self._engine(model, system, enforce_eager=not graphs)
                )
                workloads = [
                    (
                        w.name,
                        synthetic(engine.model_config.vocab_size, w.prompts, w.input_len, w.output_len, w.range_ratio),
                    )
                    for w in self.plan.workloads
                ]
                hf = load_hf_model(engine, engine.model_path) if system == "hf" else None
                # warm-up on the workloads themselves, untimed: a tiny one left the first full-budget steps (Triton's
                # compiles per shape, cuBLAS's first choices, the allocator growing, decode graphs captured) in the
                # first timed run, at a fraction of the next run's rate
                if hf is None:
                    for _, wl in workloads:
                        run_engine(engine, wl)
                for name, wl in workloads:
                    self._within(deadline, f"{model} {system} {name} and after")
                    synchronize(self.device)
                    r = run_hf(wl, self.plan.batch, hf) if hf is not None else run_engine(engine, wl, system)
                    results[f"{name}/{system}"] = row = r.row()
                    if hf is None:
                        row |= self._roofline(engine, r, peaks)
                del engine, hf
                _free(self.device)
            for name in (w.name for w in self.plan.workloads):
                base = results.get(f"{name}/triton")
                for system in ("triton", "torch", "hf"):
                    r = results.get(f"{name}/{system}")
                    if r is None:
                        continue
                    figures = {
                        "tokens_per_s": r["total_tokens_per_s"],
                        "output_tokens_per_s": r["output_tokens_per_s"],
                        "wall_s": r["wall"],
                        "speed_vs_triton": r["requests_per_s"] / base["requests_per_s"] if base else None,
                    }
                    figures |= {k: r[k] for k in ("prefill_tflops", "decode_tflops", "decode_hbm_gb_per_s") if k in r}
                    if system == "triton":
                        figures["cuda_graphs"] = graphs and self.device.type == "cuda"
                    self.row("throughput", f"{model} {name} {system}", None, **figures)
        self.report["throughput"] = results

    @staticmethod
    def _roofline(engine, r, peaks: dict) -> dict:
        """The bench's roofline against the device's measured peaks, as this report's figures."""
        phases = roofline(engine, r, peaks)
        out = {}
        if p := phases.get("prefill"):
            out |= {"prefill_tflops": p["achieved_gflops"] / 1e3, "prefill_fraction": p["fraction"]}
        if d := phases.get("decode"):
            out["decode_tflops"] = d["achieved_gflops"] / 1e3
            if "achieved_read_gb_per_s" in d:
                out["decode_hbm_gb_per_s"] = d["achieved_read_gb_per_s"]
                out["decode_hbm_fraction"] = d["achieved_read_gb_per_s"] / d["read_gb_per_s"]
        return out

    def graphs(self, deadline: float) -> None:
        """Decode steps through CUDA graphs against the same engine with enforce_eager, on mixed output lengths (so
        that batches shrink through several graph sizes): greedy tokens equal in fp32, and in each dtype the decode
        tokens/s of a second run (the first captures the sizes it replays). On a CPU graphs are off: the padded body
        a graph captures runs eagerly in their place, checked the same way."""
        from batchjob.bench.systems import run_engine
        from batchjob.bench.workloads import synthetic

        model = self.plan.models[0]
        n, inp, out = self.plan.graphs.prompts, self.plan.graphs.input_len, self.plan.graphs.output_len
        config = dict(max_num_seqs=n, num_kv_blocks=n * -(-(2 * inp + 2 * out) // 16) + 1, block_size=16)
        cuda = self.device.type == "cuda"
        for dtype in ("float32", "auto") if cuda else ("float32",):
            runs = {}
            for mode in ("graphs", "eager"):
                self._within(deadline, f"{mode} in {dtype} and after")
                engine = self._engine(model, "triton", enforce_eager=mode == "eager", dtype=dtype, **config)
                if mode == "graphs" and not cuda:
                    engine.set_decode_graphs(True, capture=False)
                graphs = engine.decode_graphs
                wl = synthetic(engine.model_config.vocab_size, n, inp, out, range_ratio=0.75, seed=3)
                first, second = run_engine(engine, wl, mode), run_engine(engine, wl, mode)
                runs[mode] = {
                    "outputs": first.outputs,
                    "in_use": graphs is not None,
                    "captured": sorted(graphs.graphs) if graphs else [],
                    "decode_tokens_per_s": second.decode_tokens / second.decode_time if second.decode_time else None,
                }
                del engine, graphs
                _free(self.device)
            g, e = runs["graphs"], runs["eager"]
            same = sum(g["outputs"][k] == e["outputs"][k] for k in e["outputs"])
            # graphs on where asked for (captured on a GPU), off with enforce_eager
            wiring = g["in_use"] and not e["in_use"] and (bool(g["captured"]) or not cuda)
            self.row(
                "graphs",
                f"{model} {dtype} decode graphs == eager, greedy ({n} prompts)",
                wiring and (same == len(e["outputs"]) or dtype != "float32"),
                sequences_equal=f"{same}/{len(e['outputs'])}",
                captured_sizes=",".join(map(str, g["captured"])) or None,
                graphs_decode_tokens_per_s=g["decode_tokens_per_s"],
                eager_decode_tokens_per_s=e["decode_tokens_per_s"],
                speedup=g["decode_tokens_per_s"] / e["decode_tokens_per_s"]
                if g["decode_tokens_per_s"] and e["decode_tokens_per_s"]
                else None,
            )

    def sampling(self, deadline: float) -> None:
        from batchjob.bench.systems import run_engine
        from batchjob.bench.workloads import synthetic
        from batchjob.engine.host_sync import forbid_host_sync
        from batchjob.engine.outputs import Request
        from batchjob.engine.sampler import Sampler
        from batchjob.engine.sampling_params import SamplingParams
        from batchjob.engine.sequence import Sequence

        engine = self._engine(self.plan.models[0], "triton")
        vocab, draws = engine.model_config.vocab_size, 3 if self.small else 50
        logits = torch.randn(len(SAMPLED_ROWS) * 4, vocab, generator=torch.Generator().manual_seed(0)) * 4
        tokens = {}
        for where in (self.device, torch.device("cpu")):
            params = [SamplingParams(seed=i, **SAMPLED_ROWS[i % len(SAMPLED_ROWS)]) for i in range(len(logits))]
            seqs = [Sequence(Request(str(i), [5, 6, 7, 7], p), i) for i, p in enumerate(params)]
            sampler, drawn = Sampler(0), []
            for _ in range(draws):
                drawn.append(sampler(logits.to(where), seqs)[0])
            tokens[where.type] = drawn
        same = sum(a == b for d, h in zip(tokens[self.device.type], tokens["cpu"]) for a, b in zip(d, h))
        total = draws * len(logits)
        # float sums in another order may move a draw that falls on a boundary between two tokens: rare
        self.row(
            "sampling", "device sampler == host sampler (seeded rows)", same >= 0.99 * total, equal=f"{same}/{total}"
        )
        # a CPU's top-p takes a partial sort and asks which rows it missed (on a GPU every row is sorted whole)
        kinds = [r for r in SAMPLED_ROWS if self.device.type == "cuda" or "top_p" not in r]
        seqs = [Sequence(Request(str(i), [5, 6, 7, 7], SamplingParams(**r)), i) for i, r in enumerate(kinds)]
        try:
            with forbid_host_sync(self.device):
                Sampler(0).draw(logits[: len(kinds)].to(self.device), seqs)
            waited = None
        except RuntimeError as e:  # torch's sync debug mode on a GPU, HostSync on a CPU
            waited = str(e).splitlines()[0]
        self.row("sampling", "the draw never waits for the device", waited is None, rows=len(kinds), error=waited)
        self._within(deadline, "sampled and constrained throughput")
        w = self.plan.workloads[0]
        base = synthetic(vocab, w.prompts, w.input_len, w.output_len, seed=3)
        schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}}}
        kinds = {
            "greedy": {},
            "sampled": dict(temperature=0.7, top_p=0.95, logprobs=True, top_logprobs=5),
            "json": dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        }
        kinds["sampled+json"] = kinds["sampled"] | kinds["json"]
        rates = {}
        for kind, extra in kinds.items():
            # a JSON row stops where its object closes; the others run to their length, as greedy's
            update = {"ignore_eos": "response_format" not in extra, **extra}
            params = [r.params.with_overrides(update) for r in base.requests]
            requests = [Request(r.request_id, r.prompt_token_ids, p) for r, p in zip(base.requests, params)]
            wl = replace(base, requests=requests, name=f"{base.name} {kind}")
            run_engine(engine, wl)  # warm-up: compiles and masks of this kind
            self._within(deadline, f"{kind} workload")
            rates[kind] = run_engine(engine, wl, kind).row()["output_tokens_per_s"]
        # an object the grammar closes within a few tokens, so that every row ends and is read whole
        closed = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
        closed |= {"additionalProperties": False}
        params = SamplingParams(
            max_tokens=32,
            temperature=0.7,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": closed}},
        )
        outputs = engine.generate([r.prompt_token_ids for r in base.requests[:4]], params, False)
        parsed = sum(o.finish_reason == "stop" and _parses(o.text) for o in outputs)
        self.row(
            "sampling", "JSON-constrained outputs parse", parsed == len(outputs), parsed=f"{parsed}/{len(outputs)}"
        )
        for kind in ("sampled", "json", "sampled+json"):
            self.row("sampling", f"{kind} tokens/s vs greedy", None, share=rates[kind] / rates["greedy"], **rates)

    def host_sync(self, deadline: float) -> None:
        """The Triton engine (eager: a capture waits for the device by design) steps through chunked prefills, mixed
        steps, decodes and preemption with every host synchronisation inside a step raising (torch's sync debug mode
        on a GPU; on a CPU the ops that would wait on one)."""
        from batchjob.bench.workloads import synthetic

        st = self.plan.stress
        n, inp, out, config = st.prompts, st.input_len, st.output_len, st.engine_config()
        engine = self._engine(self.plan.models[0], "triton", enforce_eager=True, **config)
        engine.forbid_host_sync()
        wl = synthetic(engine.model_config.vocab_size, n, inp, out, range_ratio=0.65, seed=2)
        steps = []
        engine.add_step_callback(steps.append)
        error = None
        try:
            list(engine.stream(wl.requests))
        except Exception as e:  # the guard's, or torch's on a GPU: recorded with the step count it reached
            error = f"{type(e).__name__}: {e}"[:300]
        self.row(
            "host_sync",
            f"{self.plan.models[0]} triton steps without a host synchronisation",
            error is None,
            steps=len(steps),
            mixed_steps=sum(bool(s.num_prefill_tokens and s.num_decode_tokens) for s in steps),
            preemptions=sum(s.num_preemptions for s in steps),
            error=error,
        )

    def kv_sizing(self, deadline: float) -> None:
        """On a GPU, decode through CUDA graphs: what torch's allocator holds at its peak (weights, KV pool,
        activations, the graphs' pool) against kv_cache_memory_fraction x device memory, within 2 % of it, over a
        run that takes a step at the largest token budget and captures the largest graph batch (decode batches
        shrinking from max_num_seqs) without OOM. Each row is written with what was measured, even when the run
        fails. On a CPU the pool against kv_cache_memory_gb."""
        from batchjob.engine.sampling_params import SamplingParams

        model = self.plan.models[0]
        if self.device.type != "cuda":
            engine = self._engine(model, "torch", kv_cache_memory_gb=0.01)
            pool = engine.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token
            self.row(
                "kv_sizing", "pool vs kv_cache_memory_gb=0.01", abs(pool / 2**30 - 0.01) / 0.01 < 0.02, pool_bytes=pool
            )
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        seqs = 256
        for fraction, budget in ((0.5, 8192), (0.9, 16384)):
            self._within(deadline, f"fraction {fraction}")
            _free(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            engine, figures, ran = None, {}, False
            try:
                engine = self._engine(
                    model, "triton", kv_cache_memory_fraction=fraction, max_num_batched_tokens=budget, max_num_seqs=seqs
                )
                m = engine.memory_profile
                figures |= {
                    "kv_blocks": engine.num_kv_blocks,
                    "step_peak_gib": m.step_peak / 2**30,
                    "graph_pool_gib": m.graph_pool / 2**30,
                }
                # prompts that fill the first step's budget to the token (none longer than the model allows, none
                # sharing a prefix), then decode batches from seqs - 1 rows down, 8 fewer a step
                longs = -(-budget // (engine.max_model_len - 1))
                lengths = [budget // longs + (j < budget % longs) for j in range(longs)]
                prompts = [[7 + j] * n for j, n in enumerate(lengths)] + [[11 + i] * 8 for i in range(seqs - 1)]
                params = [SamplingParams(max_tokens=1, ignore_eos=True)] * longs + [
                    SamplingParams(max_tokens=2 + i // 8, ignore_eos=True) for i in range(seqs - 1)
                ]
                steps = []
                engine.add_step_callback(steps.append)
                engine.generate(prompts, params, use_tqdm=False)
                figures["largest_step"] = max(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
                ran = True
            except torch.OutOfMemoryError as e:
                figures["oom"] = str(e)[:200]
            finally:
                synchronize(self.device)
                share = torch.cuda.max_memory_reserved(self.device) / total
                free, _ = torch.cuda.mem_get_info(self.device)
                graphs = engine.decode_graphs if engine is not None else None
                captured = sorted(graphs.graphs) if graphs is not None else []
                self.row(
                    "kv_sizing",
                    f"{model} fraction {fraction}, budget {budget}, graphs to {seqs}",
                    ran and abs(share - fraction) <= 0.02 and seqs in captured and figures["largest_step"] == budget,
                    peak_share=share,
                    device_used_share=(total - free) / total,  # the CUDA context and graph executables as well
                    graph_sizes=len(captured),
                    **figures,
                )
            del engine, graphs
            _free(self.device)

    def real_model(self, deadline: float) -> None:
        """Real weights: the engine (Triton ops, as users run it) against transformers on the same device, greedy on
        the plan's chat prompts in each of its dtypes, per model: each --model path, then each built-in model found
        here without downloading (a skipped row, saying how to bring it, for one that is not). On a CPU the tiny
        config's dummy weights exported as an HF folder stand in for the built-in models (in the interpreter those
        take minutes; the oracle tests hold them to transformers on the CPU ops)."""
        import tempfile

        from batchjob.bench.hf_export import export_hf
        from batchjob.model.dummy import load_dummy

        with tempfile.TemporaryDirectory() as tmp:
            found = self._real_models()
            if self.small:
                tiny = self.plan.models[0]
                found.insert(0, (f"{tiny} (dummy weights)", export_hf(load_dummy(tiny), Path(tmp) / tiny), None))
            for label, path, missing in found:
                if path is None:
                    self.row("real_model", label, None, skipped=missing)
                    continue
                self._within(deadline, f"{label} and after")
                try:
                    self._real_model(label, path, deadline)
                except TimeCap:
                    raise
                except Exception as e:  # one model's failure (a transformers too old for it) is its row's
                    error = f"{type(e).__name__}: {e}"[:500]
                    self.row("real_model", f"{label} vs transformers", False, error=error)
                _free(self.device)

    def _real_models(self) -> list[tuple[str, Path | None, str | None]]:
        """(label, path, why not found) of each --model path (labelled as the built-in model whose pinned GGUF it
        is, if it is one) and, on a GPU, of each built-in model not given, resolved from this machine only: its
        installed package, the cache's GGUF or its cached wheels, never pip or the Hub."""
        from batchjob.model.builtin import BUILTIN_MODELS
        from batchjob.model.errors import CacheDirError, ModelError
        from batchjob.model.loader import file_digest, locate_model

        found: list[tuple[str, Path | None, str | None]] = []
        for given in map(Path, self.models):
            digest = file_digest([given]) if given.is_file() else None
            name = next((n for n in REAL_MODELS if BUILTIN_MODELS[n].sha256 == digest), given.name)
            found.append((name, given, None))
        if self.small:
            return found
        for name in REAL_MODELS:
            if any(label == name for label, _, _ in found):
                continue
            try:
                found.append((name, locate_model(name, download=False).path, None))
            except (ModelError, CacheDirError):
                why = f"not on this machine; bring {BUILTIN_MODELS[name].filename} (docs/gpu.md) and pass --model PATH"
                found.append((name, None, why))
        return found

    def _real_model(self, label: str, path: Path, deadline: float) -> None:
        from batchjob.bench.hf_export import hf_folder
        from batchjob.bench.measure import first_difference
        from batchjob.bench.systems import hf_greedy, load_hf_model, run_engine
        from batchjob.bench.workloads import Workload as Requests
        from batchjob.engine.outputs import Request
        from batchjob.engine.sampling_params import SamplingParams

        shape = self.plan.real
        folder = hf_folder(str(path))  # transformers reads the loader's weights, exported once as an HF folder
        hf = None
        for dtype in shape.dtypes:
            self._within(deadline, f"{label} in {dtype} and after")
            # a pool for every prompt (each under 256 tokens) and its output at once: no preemption, and the rest
            # of the device left to transformers
            blocks = shape.prompts * -(-(256 + shape.new_tokens) // 16) + 1
            engine = self._engine(
                str(path), "triton", load_format="auto", dtype=dtype, max_num_seqs=shape.prompts, num_kv_blocks=blocks
            )
            tok = engine.tokenizer
            # the pretrained Gemma 3 270M has no chat template: its prompts are the plain texts
            prompts = [
                tok.encode_chat([{"role": "user", "content": text}]) if tok.chat_template else tok.encode(text)
                for text in CHAT_PROMPTS[: shape.prompts]
            ]
            params = SamplingParams(max_tokens=shape.new_tokens)
            wl = Requests([Request(str(i), ids, params) for i, ids in enumerate(prompts)], f"{label} chat prompts")
            if not self.small:
                run_engine(engine, wl)  # warm-up: Triton's compiles for this model's shapes, decode graphs captured
            ours = run_engine(engine, wl, "engine")
            if hf is None:  # loaded once, cast for each dtype
                hf = load_hf_model(engine, folder)
            hf.to(engine.dtype)
            synchronize(self.device)
            t0 = time.perf_counter()
            theirs = hf_greedy(wl, len(wl.requests), hf, engine.eos_token_ids)
            synchronize(self.device)
            hf_seconds = time.perf_counter() - t0
            parted = {k: first_difference(v, theirs[k]) for k, v in ours.outputs.items()}
            n = len(parted)
            equal = sum(at is None for at in parted.values())
            first = sum(at != 0 for at in parted.values())
            longer = {k: max(len(v), len(theirs[k])) for k, v in ours.outputs.items()}
            prefix = sum(1.0 if at is None else at / longer[k] for k, at in parted.items()) / n
            floors = AGREEMENT_FLOORS[dtype]
            self.row(
                "real_model",
                f"{label} {dtype} greedy vs transformers ({n} x {shape.new_tokens} tokens)",
                first >= floors[0] * n and prefix >= floors[1] and equal >= floors[2] * n,
                sequences_equal=f"{equal}/{n}",
                first_token_equal=f"{first}/{n}",
                prefix_share=prefix,
                engine_tokens_per_s=ours.row()["output_tokens_per_s"],
                hf_tokens_per_s=sum(map(len, theirs.values())) / hf_seconds,
                floors="first {:g}, prefix {:g}, equal {:g}".format(*floors),
            )
            del engine
            _free(self.device)
        del hf


def run_check(
    device: str,
    json_path: str | None,
    load_format: str = "dummy",
    log: Callable[[str], None] = print,
    models: tuple[str, ...] = (),
):
    check = Check(device, json_path, load_format, models=models)
    report = check.run()
    log(format_check(report))
    return report


def _parses(text: str) -> bool:
    """Whether the text starts with a JSON value (dummy weights' tokenizers may print the stop token after it)."""
    try:
        json.JSONDecoder().raw_decode(text)
        return True
    except ValueError:
        return False
