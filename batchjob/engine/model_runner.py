"""Owns the model and its paged KV cache; turns a scheduled step into one forward pass and the logits of the
rows that need a token."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os

import numpy as np
import torch

from batchjob import env
from batchjob.engine.config import EmbedderConfig, EngineConfig
from batchjob.engine.decode_graphs import DecodeGraphs
from batchjob.engine.errors import DeviceSettingError
from batchjob.engine.host_memory import (
    KEPT_BLOCK_BYTES,
    StepBlocks,
    available_memory,
    lazy_zeros,
    peak_rss,
    reset_peak_rss,
    resident_bytes,
)
from batchjob.engine.host_sync import forbid_host_sync
from batchjob.engine.lora.manager import LoraManager
from batchjob.engine.memory_profile import MemoryProfile, reserved_peak
from batchjob.engine.prompt_logprobs import PromptLogprobRows
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence
from batchjob.engine.step_inputs import build_step_inputs
from batchjob.env import configure_threads
from batchjob.model.arithmetic import arithmetic_label, arithmetic_path
from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.backend import OpsBackend
from batchjob.model.cpu_features import has_native_bf16
from batchjob.model.cpu_native import native_ops_for
from batchjob.model.fp8 import FP8_DTYPE
from batchjob.model.gemma import decoder_class
from batchjob.model.loader import LoadedModel
from batchjob.model.matmul.gguf_linear import GGML_TYPES, QuantizedWeight, computable
from batchjob.model.matmul.weight_only import BLOCK_TYPES, quantize_dense_weights
from batchjob.model.smoothing import CALIBRATION_TEXT
from batchjob.model.vision.idefics3 import ImageEncoder

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A CPU pool that no setting sizes: 2 GiB, or this share of the memory available once the model is loaded where
# that is less, so that a small host keeps room for the steps' activations. A job shrinks it further to what its
# requests need (Engine.fit_kv_pool).
DEFAULT_CPU_KV_GB = 2.0
DEFAULT_CPU_KV_SHARE = 0.5


def pick_device(config: EngineConfig | EmbedderConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise DeviceSettingError("device: cuda was asked for, but torch sees no CUDA device")
    return torch.device(config.device)


def pick_ops_backend(config: EngineConfig | EmbedderConfig, device: torch.device) -> str:
    """Triton kernels on a CUDA device (or when asked for, e.g. under TRITON_INTERPRET=1); torch otherwise."""
    if config.ops_backend == "triton":
        if not importlib.util.find_spec("triton"):
            raise DeviceSettingError("ops_backend: triton was asked for, but Triton is not installed")
        if device.type == "cpu" and env.get("TRITON_INTERPRET") != "1":
            raise DeviceSettingError(
                "ops_backend: triton runs on a CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests); "
                "use ops_backend torch or auto"
            )
    if config.ops_backend != "auto":
        return config.ops_backend
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def device_numerics(device: torch.device) -> str:
    """The device as the numerics name it: a GPU by its model, whose kernels (and their reduction orders) are tuned
    per model."""
    return f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def load_ops(backend: str) -> OpsBackend:
    """Triton's kernels, or the torch ops with their C++ forms for float32 and bfloat16 on a CPU (model/cpu_ops.py)."""
    return importlib.import_module("batchjob.kernels.ops" if backend == "triton" else "batchjob.model.cpu_ops")


def pick_dtype(config: EngineConfig | EmbedderConfig, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on a GPU and on a CPU that computes bf16 natively (its GEMM runs about twice the fp32 rate);
    fp32 on other CPUs, where bf16 is emulated slower than fp32."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" or has_native_bf16() else torch.float32


# `weights: auto` dequantizes a GGUF's blocks where the dequantized weights take at most this share of the memory
# available at load: there the dequantized matmuls run faster on every host measured (docs/cpu.md#gguf-weights-kept-
# quantized); a model too large for that keeps its blocks, a third to a quarter of the bytes, and runs.
AUTO_DEQUANTIZE_SHARE = 0.5


def keep_gguf_blocks(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF is loaded with its weight matrices in their quantized blocks (matmul/gguf_linear.py): with
    `quantized` (where this CPU's build computes them, else DeviceSettingError), and with `auto` where it computes
    them (pick_weights then dequantizes them where they fit)."""
    computes = device.type == "cpu" and computable(dtype)
    if config.weights == "quantized" and not computes:
        raise DeviceSettingError(
            f"weights: quantized computes GGUF's blocks on a CPU with AVX-512 (bf16 with AVX512_BF16), which this "
            f"{device.type} lacks for {str(dtype).removeprefix('torch.')}; use weights dequantize or auto"
        )
    return config.weights == "quantized" or (config.weights == "auto" and computes)


def pick_weights(config: EngineConfig, device: torch.device, loaded: LoadedModel, dtype: torch.dtype) -> str:
    """`quantized` where the loaded model keeps GGUF blocks: asked for, or with `auto` where its weights dequantized
    to `dtype` would take more than AUTO_DEQUANTIZE_SHARE of the available memory (else they are dequantized here,
    to the values a dequantizing load gives). `w8a8` (W8A8 matmuls, matmul/int8_linear.py), or `int8` / `int4`
    (weight-only, matmul/weight_only.py) where asked for and possible. Otherwise `dequantize`: `auto` never picks
    w8a8, as where it ran faster (AVX-512 VNNI) its NLL bound against fp32 is not established, and without VNNI it is
    slower at decode sizes, on 7-bit weights (docs/cpu.md#w8a8-matmuls has the figures); nor int8 or int4, which
    trade speed for memory (docs/cpu.md#weight-only-int8-and-int4)."""
    blocks = [name for name, w in loaded.weights.items() if isinstance(w, QuantizedWeight)]
    if blocks and config.weights == "auto":
        dequantized = sum(loaded.weights[n].shape.numel() for n in blocks) * dtype.itemsize
        available = available_memory()
        if available is None or dequantized <= AUTO_DEQUANTIZE_SHARE * available:
            for name in blocks:
                loaded.weights[name] = loaded.weights[name].dequantize()
            blocks = []
    if blocks:
        return "quantized"
    if config.weights == "quantized":
        raise DeviceSettingError(
            f"weights: quantized keeps a GGUF file's quantized blocks; {loaded.path} has none that batchjob computes "
            f"(its types: {', '.join(GGML_TYPES.values())}); use weights dequantize or auto"
        )
    if config.weights == "w8a8" and (device.type != "cpu" or not torch.backends.mkldnn.is_available()):
        raise DeviceSettingError(
            "weights: w8a8 runs on a CPU, through oneDNN's int8 GEMM, which torch here lacks or this device is not; "
            "use weights dequantize or auto"
        )
    if config.weights in BLOCK_TYPES and not (device.type == "cpu" and computable(dtype)):
        raise DeviceSettingError(
            f"weights: {config.weights} computes its quantized blocks on a CPU with AVX-512 (bf16 with AVX512_BF16), "
            f"which this {device.type} lacks for {str(dtype).removeprefix('torch.')}; use weights dequantize or auto"
        )
    return "dequantize" if config.weights == "auto" else config.weights


def use_cuda_graphs(config: EngineConfig, device: torch.device, ops: OpsBackend) -> bool:
    """Decode steps through CUDA graphs: on a CUDA device, unless enforce_eager, with ops that never wait on the host
    inside a step (a capture fails on a host synchronisation)."""
    return device.type == "cuda" and not config.enforce_eager and ops.CAPTURABLE


def pool_sizing(config: EngineConfig, device: torch.device) -> str:
    """What sizes the KV pool: a setting's name, "gpu_memory" (kv_cache_memory_fraction of the GPU's, less the
    model's and the largest step's), or on a CPU "default" (DEFAULT_CPU_KV_GB, DEFAULT_CPU_KV_SHARE), which a job
    turns into "job" (Engine.fit_kv_pool)."""
    if config.num_kv_blocks:
        return "num_kv_blocks"
    if device.type == "cuda":
        return "gpu_memory"
    return "kv_cache_memory_gb" if config.kv_cache_memory_gb else "default"


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int):
        self.config, self.max_model_len = config, max_model_len
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        self.step_blocks: StepBlocks | None = None  # which freed blocks malloc keeps through a CPU step
        if self.device.type == "cpu":
            configure_threads(config.num_threads or os.cpu_count() or 1)
            self.step_blocks = StepBlocks(loaded.config.hidden_size * self.dtype.itemsize)
        self.ops_backend = pick_ops_backend(config, self.device)
        self.weights = pick_weights(config, self.device, loaded, self.dtype)
        if self.weights in BLOCK_TYPES:
            quantize_dense_weights(loaded.weights, self.weights)
        self.model = decoder_class(loaded.config)(
            loaded.config,
            # Taken out of `loaded`: weights drawn on the GPU (load_format dummy) would otherwise stay there unfused
            # beside the fused copies while the KV pool is sized.
            {k: loaded.weights.pop(k).to(self.dtype) for k in list(loaded.weights)},
            load_ops(self.ops_backend),
            loaded.rope_freqs,
            self.device,
            max_model_len,  # LongRoPE's long or short factors follow the context the engine allows
            w8a8=self.weights == "w8a8",
            calibration=loaded.tokenizer.encode(CALIBRATION_TEXT) if self.weights == "w8a8" else None,
        )
        self.image_encoder = None  # a vision-language model's: features of the step's new images
        if loaded.vision is not None:
            vision = {k: v.to(self.dtype) for k, v in loaded.vision.weights.items()}
            self.image_encoder = ImageEncoder(loaded.vision.config, vision, self.device)
        # LoRA adapters, checked now: a damaged or mismatched one refuses the engine before any row runs
        self.lora = LoraManager(config.lora, loaded.config, self.device, self.dtype) if config.lora else None
        self.block_size = config.block_size
        c = loaded.config
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        per_slot = c.num_key_value_heads * c.head_dim * self.kv_dtype.itemsize
        if config.kv_cache_dtype == "fp8":
            per_slot += c.num_key_value_heads * 4  # the fp32 scale of each (slot, head)
        self.kv_bytes_per_token = 2 * c.num_hidden_layers * per_slot
        # a sparse MoE layer on per-expert matmuls sizes them on the host: its steps cannot be captured
        graphs = use_cuda_graphs(config, self.device, self.model.ops) and self.model.capturable
        self.memory: MemoryProfile | None = None  # what the pool was sized against, on a GPU
        self.pool_sized_by = pool_sizing(config, self.device)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(graphs)
        self.kv_caches = self._allocate_pool()
        self.decode_graphs: DecodeGraphs | None = self.make_decode_graphs(capture=True) if graphs else None
        # The self-check's: raise at a host synchronisation inside a step (with enforce_eager: a capture waits).
        self.forbid_host_sync = False

    def set_decode_graphs(self, enabled: bool, capture: bool = True) -> None:
        self.decode_graphs = self.make_decode_graphs(capture) if enabled else None

    def make_decode_graphs(
        self, capture: bool, kv_caches: list[tuple[torch.Tensor, ...]] | None = None
    ) -> DecodeGraphs:
        """Padded decode steps over this runner's model and cache (or a scratch one), the cache's last block the
        padding rows' own: captured as CUDA graphs, or without `capture` run eagerly (how a CPU runs the body a graph
        captures)."""
        caches = self.kv_caches if kv_caches is None else kv_caches
        c = self.config
        pad_block = caches[0][0].shape[0] - 1
        return DecodeGraphs(self.model, caches, self.block_size, c.max_num_seqs, self.max_model_len, pad_block, capture)

    @property
    def prompt_logprob_rows(self) -> int:
        """Rows of prompt logprobs computed at once: at most a step's sampled rows (what the memory probe covers),
        and on a CPU few enough that a slice's [rows, vocab] float32 logits stay a block malloc keeps (at 256 x
        49,152 each slice's logits and log-softmax were fresh mappings, faulted in again)."""
        rows = self.config.max_num_seqs
        if self.device.type == "cpu":
            rows = min(rows, KEPT_BLOCK_BYTES // (4 * self.model.config.vocab_size))
        return max(1, rows)

    @property
    def numerics(self) -> dict[str, str]:
        """What decides the numbers beyond the weights, as resolved (dtype `auto` is bfloat16 on a GPU and on a CPU
        with native bf16, else float32; see pick_dtype): results computed under two of these differ in their last
        bits, and so in some greedy tokens."""
        device = device_numerics(self.device)
        ops = self.ops_backend
        if ops == "torch" and native_ops_for(self.device, self.dtype, self.kv_dtype) is not None:
            ops += "+cpp"  # the C++ kernels sum in other orders than torch's
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "device": device,
            "dtype": dtype,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "ops_backend": ops,
            "matmul": self.model.matmul_backend,
            # recorded where not the default, so that results from before the setting keep their numerics
            **({"weights": self.weights} if self.weights != "dequantize" else {}),
            **arithmetic_label(arithmetic_path(dtype, self.weights)),
        }

    def _allocate_pool(self) -> list[tuple[torch.Tensor, ...]]:
        # One block beyond those the block manager hands out: padded decode rows write and read it (decode_graphs.py).
        try:
            return self._make_caches(self.num_blocks + 1)
        except (MemoryError, OverflowError, OSError, torch.OutOfMemoryError) as e:  # OSError: the mmap of lazy_zeros
            gib = (self.num_blocks + 1) * self.block_size * self.kv_bytes_per_token / 2**30
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DeviceSettingError(
                f"the KV cache of {self.num_blocks:,} blocks ({gib:,.1f} GiB) cannot be allocated on "
                f"{self.device.type}: {reason}; lower num_kv_blocks or kv_cache_memory_gb"
            ) from None

    def shrink_pool(self, num_blocks: int) -> None:
        """A CPU pool of the defaults' size, before any step wrote it, remade with fewer blocks (Engine.fit_kv_pool):
        the block manager sweeps its whole pool, so every block it has is a block the run will make resident."""
        self.kv_caches = []  # the larger mapping is given back before the smaller one is made
        self.num_blocks, self.pool_sized_by = num_blocks, "job"
        self.kv_caches = self._allocate_pool()

    def _make_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer: K and V [num_blocks, block_size, KVH, D], plus their scales when stored as fp8."""
        c = self.model.config
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        caches = []
        for _ in range(c.num_hidden_layers):
            layer = [self._zeros(shape, self.kv_dtype) for _ in range(2)]
            if self.kv_dtype == FP8_DTYPE:
                layer += [self._zeros(shape[:3], torch.float32) for _ in range(2)]
            caches.append(tuple(layer))
        return caches

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return lazy_zeros(shape, dtype)

    def _blocks_from_memory(self, graphs: bool) -> int:
        block_bytes = self.kv_bytes_per_token * self.block_size
        if self.device.type == "cuda":
            self.memory = self._measure_cuda_memory(graphs)
            budget = self.memory.kv_budget(self.config.kv_cache_memory_fraction)
        elif self.config.kv_cache_memory_gb:
            budget = self.config.kv_cache_memory_gb * 2**30
        else:
            available = available_memory()
            budget = DEFAULT_CPU_KV_GB * 2**30
            if available is not None:
                budget = min(budget, DEFAULT_CPU_KV_SHARE * available)
        return max(1, int(budget // block_bytes))

    def _measure_cuda_memory(self, graphs: bool) -> MemoryProfile:
        """The largest step, and with `graphs` the padded body of the largest graph batch, run on a scratch cache
        (memory_profile.py says why both)."""
        probe = self.make_scratch_caches()
        probe_bytes = sum(t.nbytes for layer in probe for t in layer)
        _, step_peak = reserved_peak(self.device, lambda: self.probe_step(probe))
        graph_pool = 0
        if graphs:
            # its eager run also takes its temporaries from the pool every step shares
            before, peak = reserved_peak(self.device, lambda: self.make_decode_graphs(False, probe).run_padding())
            graph_pool, step_peak = peak - before, max(step_peak, peak)
        probe.clear()  # the scratch cache's memory back before the pool is allocated
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return MemoryProfile(total, step_peak - probe_bytes, graph_pool)

    def make_scratch_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """A cache for probe_step, plus the block padded decode rows use."""
        return self._make_caches(sum(-(-n // self.block_size) for n in self._probe_lengths()) + 1)

    def _probe_lengths(self) -> list[int]:
        """The largest step's sequences: the token budget in sequences of at most max_model_len tokens, as a real
        step's are (one sequence of a larger budget ran past the model's positions)."""
        n, most = self.config.max_num_batched_tokens, self.max_model_len
        return [min(most, n - start) for start in range(0, n, most)]

    @torch.inference_mode()
    def probe_step(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """The largest step a KV pool sized now must leave room for, on a scratch cache (make_scratch_caches): a
        prefill over the full token budget, in sequences of at most max_model_len tokens, and the logits of as many
        of its rows as a step samples at most (max_num_seqs, as execute computes them)."""
        lengths = self._probe_lengths()
        tables, slots, first, width = [], [], 0, -(-lengths[0] // self.block_size)  # the first is the longest
        for n in lengths:
            blocks = -(-n // self.block_size)
            tables.append(list(range(first, first + blocks)) + [-1] * (width - blocks))
            slots += range(first * self.block_size, first * self.block_size + n)
            first += blocks
        meta = AttentionMetadata.build(lengths, lengths, tables, slots, self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        hidden = self.model.forward(torch.zeros_like(positions), positions, meta, kv_caches)
        return self.model.compute_logits(hidden[: self.config.max_num_seqs])

    def largest_step_host_bytes(self) -> int | None:
        """On a CPU, what the largest step (probe_step) adds to this process's resident memory at its peak, the pages
        of the scratch KV cache it writes not counted; None on another device or where /proc does not say. Starts
        the process's peak RSS afresh (reset_peak_rss)."""
        if self.device.type != "cpu":
            return None
        caches = self.make_scratch_caches()
        tokens = self.config.max_num_batched_tokens
        if self.step_blocks is not None:
            self.step_blocks.before_step(tokens)
        before = resident_bytes()
        reset_peak_rss()
        self.probe_step(caches)
        peak = peak_rss()
        if before is None or peak is None:
            return None
        return max(0, peak - before - tokens * self.kv_bytes_per_token)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        argmax: bool = False,
        rows: list[int] | None = None,
        prompt: PromptLogprobRows | None = None,
    ) -> torch.Tensor:
        """Runs the step; returns the float32 logits of the rows that need a token, in scheduled order, on the device
        (the sampler works there, and the host reads only the tokens it draws), or with `argmax` (every row greedy
        and plain, sampler.takes_argmax) their tokens, taken on the device and read by the host. With `rows`
        (indices into the step's tokens), the logits of those rows on the host instead: what teacher-forced scoring
        reads (StepRunner.score). With `prompt`, the prompt logprobs of its rows are computed into it as well."""
        if self.step_blocks is not None:
            # a step computing prompt logprobs keeps its blocks: its logits slices are sized to be kept
            self.step_blocks.before_step(0 if prompt is not None else out.num_batched_tokens)
        with forbid_host_sync(self.device) if self.forbid_host_sync else contextlib.nullcontext():
            logits = self._forward_step(out, rows, prompt)
            if argmax:
                logits = logits.argmax(-1)
        # the step's one host synchronisation: the tokens (here, or the sampler's), or the logits scoring reads
        return logits.cpu() if argmax or rows is not None else logits

    def _forward_step(
        self, out: SchedulerOutput, rows: list[int] | None = None, prompt: PromptLogprobRows | None = None
    ) -> torch.Tensor:
        """The step on the device, where with the Triton ops the host never waits for it (forbid_host_sync):
        float32 logits of the rows that need a token (or of `rows`), in scheduled order."""
        lora = self.lora.batch([(seq.lora, n) for seq, n in out.scheduled]) if self.lora else None
        images = self._image_embeds(out) if self.image_encoder is not None else None
        graphs = rows is None and prompt is None and lora is None and images is None and self.decode_graphs is not None
        if graphs and self.decode_graphs.fits(out):
            hidden, rows = self.decode_graphs.run(out)
        else:
            step = build_step_inputs(out, self.block_size, self.device)
            extra = {"image_embeds": images} if images is not None else {}  # only a Llama-family decoder takes them
            hidden = self.model.forward(step.input_ids, step.positions, step.meta, self.kv_caches, lora, **extra)
            rows = step.sample_rows if rows is None else torch.tensor(rows, device=self.device)
            if prompt is not None:
                prompt.compute(hidden, self.model, self.prompt_logprob_rows)
        if not rows.shape[0]:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def _image_embeds(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows that are image tokens and their features, in the order of each prompt's image tokens; a
        chunk may start or end inside an image. Images whose features are not yet computed go through the encoder
        together, one batch of tiles of each shape."""
        chunks, offset = [], 0
        for seq, k in out.scheduled:
            start = seq.num_computed_tokens
            if seq.images is not None and start < seq.num_prompt_tokens:
                positions = np.asarray(seq.images.positions)
                lo, hi = np.searchsorted(positions, [start, start + k])
                if hi > lo:
                    chunks.append((seq, offset + positions[lo:hi] - start, lo, hi))
            offset += k
        if not chunks:
            return None
        self._encode([seq for seq, *_ in chunks if seq.image_features is None])
        rows = self._to_device(torch.from_numpy(np.concatenate([r for _, r, _, _ in chunks])))
        return rows, torch.cat([seq.image_features[lo:hi] for seq, _, lo, hi in chunks])

    def _encode(self, seqs: list[Sequence]) -> None:
        """Each sequence's image features, its tiles encoded in one batch with the other sequences' of their shape."""
        groups: dict[tuple[int, ...], list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            for i in range(len(seq.images.pixel_values)):
                groups.setdefault(tuple(seq.images.pixel_values.shape[1:]), []).append((seq, i))
        tiles: dict[tuple[int, int], torch.Tensor] = {}
        n = self.image_encoder.config.tokens_per_tile
        for group in groups.values():
            pixels = self._to_device(torch.stack([seq.images.pixel_values[i] for seq, i in group]))
            masks = self._to_device(torch.stack([seq.images.pixel_attention_mask[i] for seq, i in group]))
            features = self.image_encoder(pixels, masks).view(len(group), n, -1)
            tiles.update({(id(seq), i): f for (seq, i), f in zip(group, features)})
        for seq in seqs:
            seq.image_features = torch.cat([tiles[id(seq), i] for i in range(len(seq.images.pixel_values))])
            # the pixels are not needed again (a recompute after preemption reuses the features): memory back now
            seq.images = dataclasses.replace(seq.images, pixel_values=None, pixel_attention_mask=None)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device; on a GPU through pinned memory, without the host waiting (as step inputs)."""
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t
