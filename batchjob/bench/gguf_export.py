"""A model's dummy weights (load_format dummy) as a quantized GGUF, so that the engine, llama-server and vLLM run the
very same weights at user sizes: exported as an HF folder, written as a BF16 GGUF by llama.cpp's own
convert_hf_to_gguf.py (from the pinned sdist llama-server is built from), then quantized by its llama-quantize.
Every step is cached under the cache folder by the dummy weights' digest (a 1B model's GGUF takes minutes)."""

from __future__ import annotations

import importlib.util
import multiprocessing
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from batchjob.bench import llama_server
from batchjob.bench.hf_export import write_hf_folder
from batchjob.model.build_lock import build_lock
from batchjob.model.builtin import cache_dir
from batchjob.model.dummy import dummy_spec

CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # the script and what it imports


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its own gguf-py beside it, unpacked once from the pinned sdist."""
    folder = cache_dir() / "llama-cpp" / f"{llama_server.VERSION}-convert"
    script = folder / CONVERTER_FILES[0]
    if script.is_file():
        return script
    folder.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(folder.parent / f"{folder.name}.lock", llama_server.BUILD_WAIT_S, "llama.cpp's converter"):
        if not script.is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
            try:
                src = llama_server.unpacked_sdist(tmp)
                out = tmp / "out"
                out.mkdir()
                for name in CONVERTER_FILES:
                    (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, out / name)
                out.chmod(0o755)
                out.rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return script


def dummy_gguf_apart(model: str, seed: int, quant_type: str) -> Path:
    """dummy_gguf in a child process: drawing the dummy weights would leave this process's resident memory high,
    which the bench reports as the engine's peak RSS."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(dummy_gguf, model, seed, quant_type).result()


def dummy_gguf(model: str, seed: int, quant_type: str) -> Path:
    """`model`'s dummy weights (the draw load_format dummy makes with `seed`) as a GGUF quantized to `quant_type`."""
    if quant_type not in llama_server.QUANT_TYPES:
        raise ValueError(f"{quant_type!r} is not one of {', '.join(llama_server.QUANT_TYPES)}")
    if importlib.util.find_spec("sentencepiece") is None:
        raise RuntimeError("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install 'batchjob[bench]'")
    spec = dummy_spec(model, seed)
    root = cache_dir() / "llama-cpp" / "gguf"
    bf16 = root / f"dummy-{spec.digest[:16]}.BF16.gguf"
    if not bf16.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="batchjob-dummy-", dir=root) as scratch:
            # drawn and written a shard at a time in bf16 (what the converter writes anyway): an 8B model's
            # float32 draw would not fit in memory, and the converter reads the shards lazily
            tensors = spec.tensors(dtype=torch.bfloat16)
            folder = write_hf_folder(spec.config, spec.tokenizer, tensors, Path(scratch) / "hf", torch.bfloat16)
            tmp = Path(scratch) / bf16.name
            cmd = [sys.executable, str(converter()), str(folder), "--outfile", str(tmp), "--outtype", "bf16"]
            llama_server.check_run(cmd, Path(scratch))
            tmp.rename(bf16)
    return bf16 if quant_type == "BF16" else llama_server.requantized(bf16, quant_type)
