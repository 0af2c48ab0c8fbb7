"""`batchjob bench --task score`: teacher-forced scoring throughput on the same rows through this engine's
`Engine.score` (`engine`), transformers' forward at each of a few batch sizes (`hf batch N`: the best is the peer) and
vLLM's `prompt_logprobs` where installed (`vllm`). Every system is credited with the same scored tokens, a row's
tokens after its first (the first has no context to be predicted from), and each peer's per-token logprobs are
compared with the engine's. With labels (a classification), each row is scored with each label as its
continuation: the engine through Engine.score's labels (the row's prompt computed once, its labels on the cached
prefix), the peers one sequence per row and label; every system is credited with the labels' tokens and compared
on each label's summed logprob."""

from __future__ import annotations

import time

import torch

from batchjob.bench.measure import Result, interleaved_rounds, scoring_floor, synchronize
from batchjob.bench.systems import VLLM_ENV, dtype_name, engine_mode, load_hf_model, load_vllm, peer_status, vllm_dtype
from batchjob.engine.engine import Engine
from batchjob.model.cpu_features import cpu_kind

HF_BATCHES = (1, 4, 16, 64)  # transformers' batch sizes tried unless --batch-size names one
HF_MAX_PADDED = 32_768  # a size whose largest padded batch holds more tokens is not tried: its attention's memory
HEAD_ROWS = 2048  # positions per LM-head matmul in transformers' scoring: bounds the logits held at once


def compared(logprobs: torch.Tensor, start: int) -> torch.Tensor:
    """What a peer hands back for one sequence, from its tokens' logprobs from token `start` on: those logprobs (a row
    scored from its second token), or their sum (a label after its row)."""
    return logprobs if start == 1 else logprobs.sum().reshape(1)


def label_sequences(rows: list[list[int]], labels: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each row followed by each label, row-major, and the index of each sequence's first label token: what the
    peers score, one sequence a row and label."""
    return [r + label for r in rows for label in labels], [len(r) for r in rows for _ in labels]


def run_engine_score(engine: Engine, rows: list[list[int]], labels: list[list[int]] | None = None) -> Result:
    """Engine.score on the rows' token ids (prompt-only requests, one prefill a row, packed and chunked), with
    `labels` each label's summed logprob a row."""
    engine.reset_prefix_cache()  # each run starts cold
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.score(rows, labels=labels, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if failed := next((o for o in outs if o.error), None):
        raise RuntimeError(f"engine: row {outs.index(failed)} failed: {failed.error}")
    result = Result("engine", wall, sum(map(len, rows)), 0, len(rows))
    result.cpu_s = cpu
    result.note = f"{engine_mode(engine)}, Engine.score, packed into its token budget ({engine.token_budget})"
    if labels is not None:
        result.note += ", each row's labels on its cached prompt"
        result.logprobs = [torch.tensor([lp], dtype=torch.float64) for o in outs for lp in o.label_logprobs]
    else:
        result.logprobs = [torch.tensor([t.logprob for t in o.token_logprobs], dtype=torch.float64) for o in outs]
    return result


def hf_batches(rows: list[list[int]], batch_size: int) -> list[list[int]]:
    """The rows' indices sorted by length, in batches of `batch_size`: rows of similar length pad little."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def largest_padded_batch(rows: list[list[int]], batch_size: int) -> int:
    """The tokens of the largest padded batch at `batch_size`: its rows times its longest row."""
    return max(len(b) * max(len(rows[i]) for i in b) for b in hf_batches(rows, batch_size))


def hf_logprobs(hf_model, batch: list[list[int]], starts: list[int] | None = None) -> list[torch.Tensor]:
    """Each row's scored tokens' logprobs (its tokens from `starts`' index on, default 1) from one right-padded batch
    through transformers' decoder, its LM head applied to the scored positions only (logits of every padded position
    would be rows x longest x vocabulary floats: 3 GB at 64 x 256 in fp32), log_softmax in fp32 and the next tokens
    gathered."""
    starts = starts or [1] * len(batch)
    longest = max(map(len, batch))
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    scored = torch.zeros(len(batch), longest - 1, dtype=torch.bool)
    for j, (row, start) in enumerate(zip(batch, starts)):
        ids[j, : len(row)] = torch.tensor(row)
        mask[j, : len(row)] = 1
        scored[j, start - 1 : len(row) - 1] = True  # position p predicts token p + 1
    ids, mask, scored = ids.to(hf_model.device), mask.to(hf_model.device), scored.to(hf_model.device)
    hidden = hf_model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    states, targets = hidden[:, :-1][scored], ids[:, 1:][scored]  # row-major: each row's positions in order
    head = hf_model.get_output_embeddings()
    cap = getattr(hf_model.config, "final_logit_softcapping", None)  # Gemma's, applied by its forward after the head
    out = []
    for k in range(0, len(states), HEAD_ROWS):
        logits = head(states[k : k + HEAD_ROWS])
        if cap:
            logits = torch.tanh(logits / cap) * cap
        out.append(logits.float().log_softmax(-1).gather(1, targets[k : k + HEAD_ROWS, None])[:, 0])
    return list(torch.cat(out).double().cpu().split([len(row) - start for row, start in zip(batch, starts)]))


def run_hf_score(hf_model, rows: list[list[int]], batch_size: int, starts: list[int]) -> Result:
    """transformers over the rows sorted by length, `batch_size` a batch, each batch padded to its longest, each
    row scored from its token at `starts` on (1: every token after the first; a label's first: that label, whose
    logprobs are summed)."""
    import transformers

    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for batch in hf_batches(rows, batch_size):
            for i, lp in zip(batch, hf_logprobs(hf_model, [rows[i] for i in batch], [starts[i] for i in batch])):
                logprobs[i] = compared(lp, starts[i])
    synchronize(hf_model.device)
    wall = time.perf_counter() - t0
    result = Result(f"hf batch {batch_size}", wall, sum(map(len, rows)), 0, len(rows), max_batch=batch_size)
    result.cpu_s, result.logprobs = time.process_time() - c0, logprobs
    result.note = (
        f"transformers {transformers.__version__} forward, {dtype_name(hf_model.dtype)}, sorted by length, "
        "right-padded per batch, LM head on the scored positions"
    )
    return result


def vllm_logprobs(prompt_logprobs, ids: list[int]) -> torch.Tensor:
    """One row's scored tokens' logprobs from vLLM's `prompt_logprobs` (None at the first token, then at each
    position a {token id: Logprob} that holds the prompt's own token)."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(ids) or prompt_logprobs[0] is not None:
        raise RuntimeError(f"vllm: prompt_logprobs of {len(prompt_logprobs or [])} positions for {len(ids)} tokens")
    return torch.tensor([prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))], dtype=torch.float64)


def run_vllm_score(llm, engine: Engine, rows: list[list[int]], starts: list[int]) -> Result:
    """vLLM's LLM.generate on the rows' token ids with prompt_logprobs=0 (each prompt token's own logprob) and
    max_tokens=1, its least: the one token it draws a row is computed but not counted. A row scored from a label
    (`starts` past 1) hands back that label's summed logprob."""
    import vllm  # type: ignore[import-not-found]
    from vllm import SamplingParams as VSP  # type: ignore[import-not-found]

    params = VSP(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    llm.reset_prefix_cache()  # each run starts cold, as the engine's
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = Result("vllm", wall, sum(map(len, rows)), 0, len(rows))
    result.cpu_s = time.process_time() - c0
    logprobs = [vllm_logprobs(o.prompt_logprobs, r) for o, r in zip(outs, rows)]
    result.logprobs = [compared(lp[start - 1 :], start) for lp, start in zip(logprobs, starts)]
    settings = ", ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
    result.note = f"vllm {vllm.__version__}, {vllm_dtype(llm)}, prompt_logprobs=0, both cores ({settings})"
    return result


def logprob_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> dict:
    """The largest absolute difference of two systems' per-token logprobs, where it is (row, and the token's index
    in its row: 1 is the first scored), and the mean, over every scored token."""
    worst, row, token, total, count = 0.0, 0, 0, 0.0, 0
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        d = (a - b).abs()
        if len(d) and float(d.max()) > worst:
            worst, row, token = float(d.max()), i, int(d.argmax()) + 1
        total, count = total + float(d.sum()), count + len(d)
    return {"max_abs": worst, "row": row, "token": token, "mean_abs": total / max(count, 1), "rows": len(ours)}


def _counted(result: Result, expected: list[int], tokens: int) -> Result:
    """The result, once it has scored exactly the workload's tokens (`expected` logprobs a row: each of its tokens
    after its first, or with labels one sum per row and label): the count every system is credited with, so a system
    that scored other tokens would be compared on other work."""
    got = [len(lp) for lp in result.logprobs]
    if got != expected:
        raise RuntimeError(
            f"{result.system} handed back {sum(got)} logprobs in {len(got)} rows; the workload scores {tokens} "
            f"tokens, {sum(expected)} logprobs in {len(expected)} rows"
        )
    return result


def run_score_bench(
    engine: Engine,
    model_path,
    rows: list[list[int]],
    workload: str,
    systems: list[str],
    hf_batch: int | None,
    repeats: int,
    labels: list[list[int]] | None = None,
    vllm_dtype: str | None = None,
) -> dict:
    """Every system once a round, rounds interleaved in rotating order, the median round per system reported;
    transformers at each size of HF_BATCHES that fits HF_MAX_PADDED (or at `hf_batch`), one row each. With
    `labels`, the peers score each row and label as one sequence (label_sequences)."""
    sequences, starts = label_sequences(rows, labels) if labels is not None else (rows, [1] * len(rows))
    # what each system hands back a row: every scored token's logprob, or with labels each label's sum
    expected = [1] * len(sequences) if labels is not None else [len(r) - 1 for r in rows]
    tokens = sum(len(s) - start for s, start in zip(sequences, starts))
    skipped = {k: v for k, v in peer_status().items() if k in systems and v}
    if "vllm" in systems and "vllm" not in skipped and engine.config.load_format == "dummy":
        skipped["vllm"] = "load_format dummy: vLLM would draw other random weights"
    runners = {}
    if "engine" in systems:
        runners["engine"] = lambda: run_engine_score(engine, rows, labels)
    sizes: list[int] = []
    left_out: dict[int, int] = {}  # batch size -> its largest padded batch's tokens
    if "hf" in systems and "hf" not in skipped:
        hf_model = load_hf_model(engine, model_path).to(engine.dtype)
        wanted = [hf_batch] if hf_batch else sorted({min(b, len(sequences)) for b in HF_BATCHES})
        for b in wanted:
            padded = largest_padded_batch(sequences, b)
            if hf_batch or b == wanted[0] or padded <= HF_MAX_PADDED:
                sizes.append(b)
                runners[f"hf batch {b}"] = lambda b=b: run_hf_score(hf_model, sequences, b, starts)
            else:
                left_out[b] = padded
        with torch.inference_mode():
            hf_logprobs(hf_model, [rows[0][:16]])  # warm-up: the first forward pays for lazy initialisation
    if "vllm" in systems and "vllm" not in skipped:
        # each request also draws one token (max_tokens=1, vLLM's least), which its max_model_len must hold
        llm = load_vllm(engine, model_path, max(map(len, sequences)) + 1, vllm_dtype)
        runners["vllm"] = lambda: run_vllm_score(llm, engine, sequences, starts)
    engine.score([rows[0][:16]], use_tqdm=False)  # warm-up
    if "vllm" in runners:
        # vLLM's init compiles and commits GiBs of RAM (compare.run_bench): an untimed round of every system first.
        for run in runners.values():
            run()
    names = list(runners)
    runs, results = interleaved_rounds(names, repeats, lambda name: _counted(runners[name](), expected, tokens))
    base = results.get("engine")
    report_rows = []
    for name in names:
        row = results[name].row()
        row |= {"round_walls": [r.wall for r in runs[name]], "scored_tokens": tokens}
        row["scored_tokens_per_s"] = tokens / row["wall"]
        row["engine_ratio"] = row["wall"] / base.wall if base else None  # the engine's tokens/s over this system's
        report_rows.append(row)
    hf_names = [f"hf batch {b}" for b in sizes]
    hf_best = min(hf_names, key=lambda s: results[s].wall) if hf_names else None
    peers = {"hf": hf_best, "vllm": "vllm" if "vllm" in results else None}
    decoder_tokens = sum(map(len, rows)) + (len(rows) * sum(map(len, labels)) if labels is not None else 0)
    floor = scoring_floor(engine, decoder_tokens, tokens) if base else None
    if floor:
        floor["engine_over_floor"] = base.wall / floor["seconds"]
    return {
        "workload": workload,
        "floor": floor,
        "cpu": cpu_kind(),
        "systems": report_rows,
        "skipped": skipped,
        "repeats": repeats,
        "rows": len(rows),
        "prompt_tokens": sum(map(len, rows)),
        "labels": len(labels) if labels is not None else None,
        "scored_tokens": tokens,
        "hf_batches": {"tried": sizes, "left_out": left_out, "max_padded": HF_MAX_PADDED, "best": hf_best},
        "engine_ratio": {p: results[s].wall / base.wall for p, s in peers.items() if s and base},
        "exactness": {
            s: logprob_difference(base.logprobs, r.logprobs) for s, r in results.items() if base and s != "engine"
        },
        "threads": torch.get_num_threads(),
        "engine_config": engine.config.model_dump(),
    }
