"""The reports of `batchjob bench` and `batchjob selftest` as text: one table renderer for all of them."""

from __future__ import annotations

from io import StringIO

from rich.console import Console
from rich.table import Table

from batchjob.model.cpu_features import describe_cpu

PROSE = {"how it ran", "check", "figures", "case", "shape", "kernel"}  # left-aligned columns


def render(columns: list[str], rows: list[list[str]], title: str | None = None, notes: list[str] = ()) -> str:
    """A table (numbers right-aligned, its first and prose columns left-aligned), then one line per note."""
    buf = StringIO()
    console = Console(file=buf, width=160)
    table = Table(title=title)
    for k, col in enumerate(columns):
        table.add_column(col, justify="left" if k == 0 or col in PROSE else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False, highlight=False)
    return buf.getvalue().rstrip("\n")


def format_sweep(report: dict) -> str:
    columns = ["setting", "budget used", "wall s", "total tok/s", "vs best fixed", "CPU s", "vs best (CPU)"]
    columns += ["mean batch", "KV use", "preempt"]
    rows = [
        [
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
        ]
        for r in report["systems"]
    ]
    notes = [
        f"auto reached {100 * report['auto_ratio']:.1f}% of the best fixed budget by wall time "
        f"({report['best_fixed']}) and {100 * report['auto_cpu_ratio']:.1f}% by CPU time "
        f"({report['best_fixed_cpu']}); medians of {report['repeats']} run(s); tuner cap {report['budget_cap']}"
    ]
    for k, t in enumerate(report["auto_tuner"]):
        rates = ", ".join(f"{b}: {v:,.0f}" for b, v in t["tokens_per_s_by_budget"].items())
        notes.append(
            f"auto run {k + 1}: ended at {t['budget']} ({'settled' if t['settled'] else 'still probing'}, "
            f"{t['moves']} moves); tokens/s by budget {rates}"
        )
    notes.append(f"host CPU: {describe_cpu(report['cpu'])}")
    return render(columns, rows, f"token budget sweep: {report['workload']}", notes)


def format_report(report: dict) -> str:
    columns = ["system", "req/s", "total tok/s", "out tok/s", "ratio", "mean batch", "max batch", "KV use"]
    columns += ["preempt", "prefix hit", "peak RSS", "how it ran"]
    rows = [
        [
            r["system"],
            f"{r['requests_per_s']:.2f}",
            f"{r['total_tokens_per_s']:.1f}",
            f"{r['output_tokens_per_s']:.1f}",
            "" if r["ratio_to_engine"] is None else f"{r['ratio_to_engine']:.2f}x",
            f"{r['mean_batch']:.1f}",
            str(r["max_batch"]),
            f"{100 * r['mean_kv_usage']:.1f}%",
            str(r["preemptions"]),
            f"{100 * r['prefix_hit_rate']:.1f}%",
            "" if r.get("peak_rss") is None else f"{r['peak_rss'] / 2**30:.2f} GiB",
            r["note"],
        ]
        for r in report["systems"]
    ]
    notes = []
    if c := report.get("constrained"):
        notes.append(
            f"constrained decoding ({c['requests']}/{c['total']} requests constrained): the engine runs at "
            f"{c['ratio']:.2f}x the throughput of the same requests unconstrained ({c['cpu_ratio']:.2f}x by CPU "
            f"time; rounds {', '.join(f'{r:.2f}x' for r in c['round_ratios'])}), same prompts and output lengths; "
            f"{100 * c['constraint_share']:.1f}% of its wall time went to the grammar (masks and matchers)"
        )
    if report["repeats"] > 1:
        walls = "; ".join(f"{r['system']} {', '.join(f'{w:.1f}' for w in r['round_walls'])}" for r in report["systems"])
        notes.append(f"wall time of each round (s): {walls}")
    for phase, v in report.get("roofline", {}).items():
        kv = (
            f"; with its KV reads ({v['kv_gb_per_step']:.2f} GB a step at the host's sequential read rate, "
            f"{v['read_gb_per_s']:.1f} GB/s), {100 * v['bound_fraction']:.0f}% of the two bounds' time"
            if "bound_fraction" in v
            else ""
        )
        notes.append(
            f"roofline {phase}: engine {v['achieved_gflops']:.1f} GFLOP/s = {100 * v['fraction']:.0f}% of "
            f"measured {v.get('dtype', 'fp32')} matmul {v['matmul_gflops']:.1f} GFLOP/s at {v['rows']} rows{kv}"
        )
    for name, a in report.get("agreement", {}).items():
        where = (
            f"; the others first differ at output tokens {a['first_difference_at']}" if a["equal"] < a["total"] else ""
        )
        notes.append(f"greedy outputs of {name} equal to the engine's: {a['equal']}/{a['total']}{where}")
    for name, why in report["skipped"].items():
        notes.append(f"skipped {name}: {why}")
    notes.append(f"host CPU: {describe_cpu(report['cpu'])}")
    return render(columns, rows, report["workload"], notes)


def format_embed(report: dict) -> str:
    """`bench --task embed`: each system's input tokens/s and ratio to the Embedder; the Embedder's speed-up over
    each peer, each round's wall time and the embeddings' cosine agreement as notes."""
    columns = ["system", "texts/s", "input tok/s", "ratio", "wall s", "how it ran"]
    rows = [
        [
            r["system"],
            f"{r['requests_per_s']:.1f}",
            f"{r['total_tokens_per_s']:,.0f}",
            "" if r["ratio_to_embedder"] is None else f"{r['ratio_to_embedder']:.2f}x",
            f"{r['wall']:.2f}",
            r["note"],
        ]
        for r in report["systems"]
    ]
    peers = [r for r in report["systems"] if r["system"] != "embedder" and r["ratio_to_embedder"]]
    notes = []
    if peers:
        notes.append(
            "embedder's tokens/s: " + ", ".join(f"{1 / r['ratio_to_embedder']:.2f}x {r['system']}'s" for r in peers)
        )
    walls = "; ".join(f"{r['system']} {', '.join(f'{w:.2f}' for w in r['round_walls'])}" for r in report["systems"])
    notes.append(f"wall time of each round (s), {report['repeats']} round(s), {report['threads']} threads: {walls}")
    for name, c in report["cosine"].items():
        notes.append(
            f"cosine of the embedder's embeddings to {name}'s: min {c['min']:.5f} (text {c['row']}), "
            f"mean {c['mean']:.5f}"
        )
    for name, why in report["skipped"].items():
        notes.append(f"skipped {name}: {why}")
    notes.append(f"host CPU: {describe_cpu(report['cpu'])}")
    return render(columns, rows, report["workload"], notes)


def format_selftest(rows: list[dict]) -> str:
    """The kernels' self-test rows, then each error and a pass count."""
    cols = [("kernel", "kernel"), ("case", "case"), ("dtype", "dtype"), ("shape", "shape")]
    cols += [("max_abs_err", "max err"), ("tol", "tol"), ("passed", "ok"), ("triton_ms", "triton ms")]
    cols += [("torch_ms", "torch ms"), ("speedup", "speedup"), ("kv_read_tb_per_s", "KV read TB/s")]
    formats = {
        "passed": lambda v: "PASS" if v else "FAIL",
        "max_abs_err": lambda v: f"{v:.2e}",
        "triton_ms": lambda v: f"{v:.3f}",
        "torch_ms": lambda v: f"{v:.3f}",
        "speedup": lambda v: f"{v:.2f}x",
        "kv_read_tb_per_s": lambda v: f"{v:.3g}",
    }
    table = [["-" if r.get(k) is None else formats.get(k, str)(r[k]) for k, _ in cols] for r in rows]
    notes = [f"error in {r.get('kernel')} / {r.get('case')}: {r['error']}" for r in rows if r.get("error")]
    notes.append(f"{sum(1 for r in rows if r.get('passed'))}/{len(rows)} passed")
    return render([title for _, title in cols], table, notes=notes)


def format_check(report: dict) -> str:
    """The device check: part, check, ok and the row's figures; each part's status; the verdict."""
    dev = report["device"]
    rows = [
        [
            r["part"],
            r["check"],
            "SKIP" if r.get("skipped") else {True: "PASS", False: "FAIL", None: ""}[r["ok"]],
            "  ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if k not in ("part", "check", "ok", "trace", "error") and v is not None
            ),
        ]
        for r in report["rows"]
    ]
    notes = [f"error in {r['part']} / {r['check']}: {r['error']}" for r in report["rows"] if r.get("error")]
    notes += [f"part {part}: {p['status']} in {p['seconds']:.1f} s" for part, p in report["parts"].items()]
    notes.append("ALL PASSED" if report.get("passed") else "NOT ALL PASSED")
    title = f"device: {dev.get('name', dev['device'])}  torch {dev['torch']}  triton {dev.get('triton')}"
    return render(["part", "check", "ok", "figures"], rows, title, notes)


def format_quality(report: dict) -> str:
    """`bench --quality`: the NLL comparison with its verdict, then each pair's greedy agreement and where the others
    first part; the dtypes, transformers' batch and each phase's time as notes."""
    nll = report["nll"]
    rel = report["nll_relative_difference"]
    verdict = "PASS" if report["nll_passed"] else "FAIL"
    rows = [
        [f"mean NLL per token, {d} engine", f"{v['mean_nll']:.5f} over {v['tokens']:,} tokens"] for d, v in nll.items()
    ]
    bound = f"{100 * rel:+.3f}% (bound {100 * report['nll_bound']:g}%): {verdict}"
    rows.append([f"{report['label']} vs fp32 NLL", bound])
    for pair, a in report["divergence"].items():
        where = ""
        if a["equal"] < a["total"]:
            q = ", ".join(f"{v:g}" for v in a["quartiles"])
            hist = ", ".join(f"{k}: {n}" for k, n in a["histogram"].items())
            where = f"; the others first differ at output token (quartiles) {q}; by token {hist}"
        rows.append([f"greedy {pair}", f"{a['equal']}/{a['total']} equal throughout{where}"])
    notes = [
        "NLL: the fp32 engine's greedy continuations, teacher-forced after their prompts in one forward each",
        *(f"{d} engine: " + ", ".join(f"{k} {v}" for k, v in n.items()) for d, n in report["dtypes"].items()),
        f"transformers: left-padded batches of {report['hf_batch_size']} prompts of similar length",
        "wall time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report["seconds"].items()),
        *(f"skipped {name}: {why}" for name, why in report["skipped"].items()),
    ]
    return render(["check", "figures"], rows, f"quality: {report['workload']}", notes)


def format_score(report: dict) -> str:
    """`bench --task score`: each system's scored tokens/s, the engine's tokens/s over it and its logprobs' largest
    difference from the engine's; what was scored, transformers' batch sizes, the engine's ratio to each peer, each
    round's wall time and where the logprobs differ most as notes."""
    columns = ["system", "scored tok/s", "engine / it", "wall s", "max |Δ logprob|", "how it ran"]
    exact = report["exactness"]
    rows = [
        [
            r["system"],
            f"{r['scored_tokens_per_s']:,.0f}",
            "" if r["engine_ratio"] is None else f"{r['engine_ratio']:.2f}x",
            f"{r['wall']:.2f}",
            f"{exact[r['system']]['max_abs']:.2e}" if r["system"] in exact else "",
            r["note"],
        ]
        for r in report["systems"]
    ]
    hf = report["hf_batches"]
    what = "each row's tokens after its first" if report.get("labels") is None else f"{report['labels']} labels a row"
    notes = [
        f"{report['scored_tokens']:,} scored tokens ({what}) in {report['rows']} rows of {report['prompt_tokens']:,} "
        "tokens; every system is credited with these"
    ]
    if hf["tried"]:
        left = "".join(
            f"; batch {b} not tried: its largest padded batch holds {n:,} tokens (over {hf['max_padded']:,})"
            for b, n in hf["left_out"].items()
        )
        notes.append(
            f"transformers' batch sizes tried: {', '.join(map(str, hf['tried']))} (rows sorted by length, each batch "
            f"padded to its longest); the best: {hf['best']}{left}"
        )
    if ratios := report["engine_ratio"]:
        peers = {"hf": f"transformers' at its best batch ({hf['best']})", "vllm": "vLLM's"}
        notes.append("engine's scored tokens/s: " + ", ".join(f"{v:.2f}x {peers[p]}" for p, v in ratios.items()))
    if floor := report.get("floor"):
        notes.append(
            f"floor: {floor['flops'] / 1e12:.2f} TFLOP of matmuls (the decoder's for every prompt token, the LM head's "
            f"for every scored one) at this run's {floor['matmul_gflops']:.0f} GFLOP/s (the model's matmuls at "
            f"{floor['rows']} rows) = {floor['seconds']:.2f} s; the engine took {floor['engine_over_floor']:.2f}x it"
        )
    walls = "; ".join(f"{r['system']} {', '.join(f'{w:.2f}' for w in r['round_walls'])}" for r in report["systems"])
    notes.append(f"wall time of each round (s), {report['repeats']} round(s), {report['threads']} threads: {walls}")
    for name, d in exact.items():
        notes.append(
            f"logprobs of {name} against the engine's over {d['rows']} rows: max |difference| {d['max_abs']:.2e} "
            f"(row {d['row']}, token {d['token']}), mean {d['mean_abs']:.2e}"
        )
    for name, why in report["skipped"].items():
        notes.append(f"skipped {name}: {why}")
    notes.append(f"host CPU: {describe_cpu(report['cpu'])}")
    return render(columns, rows, report["workload"], notes)


def format_image(report: dict) -> str:
    """`bench --task image`: each system's output tokens/s, the engine's tokens/s over it and its greedy outputs'
    agreement with the engine's; transformers' batch sizes, the engine's ratio to each peer and each round's wall
    time as notes."""
    columns = ["system", "out tok/s", "rows/s", "engine / it", "wall s", "greedy equal", "how it ran"]
    agree = report["agreement"]
    rows = [
        [
            r["system"],
            f"{r['output_tokens_per_s']:,.1f}",
            f"{r['requests_per_s']:.2f}",
            "" if r["engine_ratio"] is None else f"{r['engine_ratio']:.2f}x",
            f"{r['wall']:.2f}",
            f"{agree[r['system']]['equal']}/{agree[r['system']]['total']}" if r["system"] in agree else "",
            r["note"],
        ]
        for r in report["systems"]
    ]
    prompt_tokens = {r["system"]: r["prompt_tokens"] for r in report["systems"]}
    notes = [
        f"{report['output_tokens']:,} output tokens in {report['rows']} rows, every system credited with these; "
        "prompt tokens (the processor's, image tokens included): "
        + ", ".join(f"{s} {n:,}" for s, n in prompt_tokens.items())
    ]
    hf = report["hf_batches"]
    if hf["tried"]:
        notes.append(f"transformers' batch sizes tried: {', '.join(map(str, hf['tried']))}; the best: {hf['best']}")
    if ratios := report["engine_ratio"]:
        peers = {"hf": f"transformers' at its best batch ({hf['best']})", "vllm": "vLLM's"}
        notes.append("engine's output tokens/s: " + ", ".join(f"{v:.2f}x {peers[p]}" for p, v in ratios.items()))
    walls = "; ".join(f"{r['system']} {', '.join(f'{w:.2f}' for w in r['round_walls'])}" for r in report["systems"])
    notes.append(f"wall time of each round (s), {report['repeats']} round(s), {report['threads']} threads: {walls}")
    for name, a in agree.items():
        if a["equal"] < a["total"]:
            notes.append(
                f"greedy outputs of {name} first differ from the engine's at tokens {a['first_difference_at']}"
            )
    for name, why in report["skipped"].items():
        notes.append(f"skipped {name}: {why}")
    notes.append(f"host CPU: {describe_cpu(report['cpu'])}")
    return render(columns, rows, report["workload"], notes)
