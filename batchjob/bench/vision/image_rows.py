"""`batchjob bench --task image`: rows of one generated picture and a short caption prompt through a
vision-language model (an Idefics3 / SmolVLM folder; by default a random-weight one of SmolVLM-256M-Instruct's shape),
greedy to exactly `output_len` new tokens a row (ignore_eos). Systems: this engine (`engine`), transformers'
`generate` at each of a few batch sizes (`hf batch N`: the best is the peer) and vLLM's `LLM.generate` with
multi_modal_data where installed (`vllm`). Each system starts from the same prompt texts and PIL images and runs the
folder's own processor on them inside its timed run, and is credited with the same output tokens; each peer's greedy
tokens are compared with the engine's."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

from batchjob.bench.measure import Result, agreement, interleaved_rounds, synchronize
from batchjob.bench.systems import VLLM_ENV, dtype_name, engine_mode, peer_status, vllm_dtype, vllm_llm
from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.cpu_features import cpu_kind

HF_BATCHES = (1, 4, 16, 64)  # transformers' batch sizes tried unless --batch-size names one
SIZES = ((640, 480), (512, 512), (480, 640), (800, 600))  # (width, height): photos' common shapes
CAPTIONS = (
    "Describe this picture in one sentence.",
    "What shapes and colours are in this image?",
    "Write a short caption for this image.",
    "What is in the picture?",
)


@dataclass
class ImageRow:
    prompt: str  # the chat-templated text, with one <image> where the picture goes
    image: Image.Image


def picture(seed: int) -> Image.Image:
    """A picture drawn from `seed` alone: one of SIZES, a background and a dozen filled rectangles, ellipses and
    lines in random colours (flat areas and edges, as in a photo or a chart, not noise)."""
    rng = random.Random(seed)
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))  # noqa: E731
    size = SIZES[seed % len(SIZES)]
    img = Image.new("RGB", size, colour())
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, x1 = sorted(rng.randrange(size[0]) for _ in range(2))
        y0, y1 = sorted(rng.randrange(size[1]) for _ in range(2))
        kind = rng.randrange(3)
        if kind == 0:
            draw.rectangle((x0, y0, x1, y1), fill=colour())
        elif kind == 1:
            draw.ellipse((x0, y0, x1, y1), fill=colour())
        else:
            draw.line((x0, y0, x1, y1), fill=colour(), width=rng.randrange(2, 12))
    return img


def image_rows(processor, num_rows: int, seed: int = 0) -> list[ImageRow]:
    """`num_rows` rows: picture(seed + i) and a caption prompt (in turn) in a user turn of the folder's chat
    template, the image before the text, as SmolVLM's model card prompts it."""
    rows = []
    for i in range(num_rows):
        content = [{"type": "image"}, {"type": "text", "text": CAPTIONS[i % len(CAPTIONS)]}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        rows.append(ImageRow(text, picture(seed + i)))
    return rows


def run_engine_images(engine: Engine, rows: list[ImageRow], params: SamplingParams) -> Result:
    """Engine.generate on {"prompt", "images"} dicts: its processor call per row is in the timed run."""
    engine.reset_prefix_cache()  # each run starts cold
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate([{"prompt": r.prompt, "images": [r.image]} for r in rows], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if failed := next((o for o in outs if o.error), None):
        raise RuntimeError(f"engine: row {outs.index(failed)} failed: {failed.error}")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = Result("engine", wall, prompt_tokens, sum(len(o.token_ids) for o in outs), len(rows))
    result.cpu_s, result.note = cpu, f"{engine_mode(engine)}, continuous batching, budget {engine.token_budget}"
    result.outputs = {str(i): o.token_ids for i, o in enumerate(outs)}
    return result


def load_hf_vlm(folder, dtype: torch.dtype):
    """transformers' model and processor of the folder; its tokenizer pads on the left, as generate needs."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).eval()
    return model, processor


def hf_generate(model, processor, rows: list[ImageRow], new_tokens: int) -> tuple[int, list[list[int]]]:
    """One left-padded batch through the processor and generate, greedy, `new_tokens` each whatever the tokens
    (an EOS id outside the vocabulary: generate never stops on one, as the engine ignores EOS): the prompt tokens and
    each row's output tokens."""
    inputs = processor(
        text=[r.prompt for r in rows], images=[[r.image] for r in rows], padding=True, return_tensors="pt"
    ).to(model.device)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=model.config.get_text_config().vocab_size,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    n = inputs["input_ids"].shape[1]
    return int(inputs["attention_mask"].sum()), out[:, n:].tolist()


def run_hf_images(model, processor, rows: list[ImageRow], batch_size: int, new_tokens: int) -> Result:
    """transformers over the rows in order, `batch_size` a batch (every row's image is one tile: no batch pads
    images, only the prompts' text, which differs by a few tokens)."""
    import transformers

    outputs, prompt_tokens = {}, 0
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(0, len(rows), batch_size):
        tokens, outs = hf_generate(model, processor, rows[k : k + batch_size], new_tokens)
        prompt_tokens += tokens
        outputs |= {str(k + j): o for j, o in enumerate(outs)}
    synchronize(model.device)
    wall = time.perf_counter() - t0
    result = Result(f"hf batch {batch_size}", wall, prompt_tokens, sum(map(len, outputs.values())), len(rows))
    result.cpu_s, result.outputs, result.max_batch = time.process_time() - c0, outputs, batch_size
    result.note = f"transformers {transformers.__version__} generate, {dtype_name(model.dtype)}, left-padded"
    return result


def load_vllm_vlm(folder, engine: Engine, longest: int, dtype: str | None = None):
    """vLLM's LLM on the folder, set up as the generate bench's (systems.vllm_llm); one image a prompt."""
    # Its start-up would run the vision tower on as many dummy tiles as its encoder budget holds (64 here: minutes
    # on a CPU) to profile memory; on a CPU the KV pool is the RAM share whatever the profile finds, and the bench's
    # untimed round warms the tower up.
    return vllm_llm(folder, engine, longest, dtype, limit_mm_per_prompt={"image": 1}, skip_mm_profiling=True)


def run_vllm_images(llm, rows: list[ImageRow], new_tokens: int) -> Result:
    """LLM.generate on the prompt texts with each row's image as multi_modal_data, greedy, ignore_eos."""
    import vllm  # type: ignore[import-not-found]
    from vllm import SamplingParams as VSP  # type: ignore[import-not-found]

    params = VSP(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.image}} for r in rows]
    # Each run starts cold, as the engine's: no KV blocks, preprocessed images or vision features of the last run's
    # pictures (vLLM keeps the latter two by content across requests; a warm run skipped the vision tower).
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = {str(i): list(o.outputs[0].token_ids) for i, o in enumerate(outs)}
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = Result("vllm", wall, prompt_tokens, sum(map(len, outputs.values())), len(rows))
    result.cpu_s, result.outputs = time.process_time() - c0, outputs
    settings = ", ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
    result.note = f"vllm {vllm.__version__}, {vllm_dtype(llm)}, both cores ({settings})"
    return result


def _counted(result: Result, rows: int, new_tokens: int) -> Result:
    """The result, once it has made exactly `new_tokens` tokens a row: what every system is credited with."""
    got = sorted({len(o) for o in result.outputs.values()})
    if len(result.outputs) != rows or got != [new_tokens]:
        raise RuntimeError(
            f"{result.system} made {got} tokens a row in {len(result.outputs)} rows; the workload is {new_tokens} "
            f"tokens in each of {rows} rows"
        )
    return result


def run_image_bench(
    engine: Engine,
    folder,
    rows: list[ImageRow],
    new_tokens: int,
    systems: list[str],
    hf_batch: int | None,
    repeats: int,
    vllm_dtype: str | None = None,
) -> dict:
    """Every system once a round after an untimed warm-up run of each on two rows, rounds interleaved in rotating
    order, the median round per system reported; transformers at each size of HF_BATCHES up to the rows (or at
    `hf_batch`), one row each."""
    skipped = {k: v for k, v in peer_status().items() if k in systems and v}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    runners = {}
    if "engine" in systems:
        runners["engine"] = lambda: run_engine_images(engine, rows, params)
    sizes: list[int] = []
    if "hf" in systems and "hf" not in skipped:
        # fp32 on a CPU (transformers' CPU default, as the generate bench runs it), the engine's dtype on a GPU
        hf_dtype = engine.dtype if engine.device.type == "cuda" else torch.float32
        model, processor = load_hf_vlm(folder, hf_dtype)
        model.to(engine.device)
        sizes = [hf_batch] if hf_batch else sorted({min(b, len(rows)) for b in HF_BATCHES})
        for b in sizes:
            runners[f"hf batch {b}"] = lambda b=b: run_hf_images(model, processor, rows, b, new_tokens)
        hf_generate(model, processor, rows[:2], 2)  # warm-up: the first call pays for lazy initialisation
    if "vllm" in systems and "vllm" not in skipped:
        try:
            llm = load_vllm_vlm(folder, engine, engine.max_model_len, vllm_dtype)
        except Exception as e:  # a peer that cannot run the folder is reported, not a failed bench
            skipped["vllm"] = f"vLLM could not load the folder: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            runners["vllm"] = lambda: run_vllm_images(llm, rows, new_tokens)
    engine.generate([{"prompt": r.prompt, "images": [r.image]} for r in rows[:2]], params, use_tqdm=False)
    if "vllm" in runners:
        # vLLM's init compiles and commits GiBs of RAM (compare.run_bench): an untimed round of every system first.
        for run in runners.values():
            run()
    names = list(runners)
    runs, results = interleaved_rounds(names, repeats, lambda name: _counted(runners[name](), len(rows), new_tokens))
    base = results.get("engine")
    report_rows = []
    for name in names:
        row = results[name].row()
        row["round_walls"] = [r.wall for r in runs[name]]
        row["engine_ratio"] = row["wall"] / base.wall if base else None  # the engine's tokens/s over this system's
        report_rows.append(row)
    hf_names = [f"hf batch {b}" for b in sizes]
    hf_best = min(hf_names, key=lambda s: results[s].wall) if hf_names else None
    peers = {"hf": hf_best, "vllm": "vllm" if "vllm" in results else None}
    return {
        "workload": f"image: {len(rows)} rows, one generated picture each ({', '.join(f'{w}x{h}' for w, h in SIZES)} "
        f"in turn) and a caption prompt, {new_tokens} new tokens a row, greedy, ignore_eos; model {folder}",
        "cpu": cpu_kind(),
        "systems": report_rows,
        "skipped": skipped,
        "repeats": repeats,
        "rows": len(rows),
        "output_tokens": len(rows) * new_tokens,
        "hf_batches": {"tried": sizes, "best": hf_best},
        "engine_ratio": {p: results[s].wall / base.wall for p, s in peers.items() if s and base},
        "agreement": {s: agreement(base.outputs, r.outputs) for s, r in results.items() if base and s != "engine"},
        "threads": torch.get_num_threads(),
        "engine_config": engine.config.model_dump(),
    }
