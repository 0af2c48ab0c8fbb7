"""CUDA graphs for decode steps, so that a small model on a GPU is not bound by Python launching its kernels.

A decode step (one token per sequence) is padded up to the next of a few batch sizes (graph_batch_sizes); each size is
captured once, when a step of that size first comes, after an eager run of that step (Triton compiles outside the
capture). All graphs read one static int64 buffer (the step packed as step_inputs.pack_step lays it out, padded:
padding rows write and read a KV block no sequence owns) and write one static hidden-state buffer, so that a step is
one host-to-device copy and one replay. They share one memory pool: it holds only temporaries that each replay writes
before it reads them, and the engine replays one graph at a time.

Contexts longer than max_seq_len_to_capture (vLLM's limit, 8192) decode eagerly: the split-KV decode kernel's grid is
sized by the longest context it may see, and a graph fixes that grid. Without `capture` (on a CPU, in tests and the
CPU self-check) the same padded body runs eagerly; that is also the warm-up before each capture."""

from __future__ import annotations

import bisect
from dataclasses import replace

import torch

from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.step_inputs import PackedStep, Padding, pack_step
from batchjob.model.llama import LlamaModel

MAX_SEQ_LEN_TO_CAPTURE = 8192


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_num_seqs (nano-vllm's and vLLM's spacing)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest size that holds num_seqs rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, ...]],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        pad_block: int,
        capture: bool,
    ):
        self.model, self.kv_caches, self.block_size, self.capture = model, kv_caches, block_size, capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_seq_len = min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE)
        self.pad = Padding(self.sizes[-1], -(-self.max_seq_len // block_size), pad_block)
        device = model.embed.device
        largest = self.sizes[-1]
        # the packed layout's length for the largest size, every row sampling
        self.static = torch.zeros(6 * largest + 1 + largest * self.pad.table_width, dtype=torch.long, device=device)
        self.hidden = torch.zeros(largest, model.config.hidden_size, dtype=model.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def fits(self, out: SchedulerOutput) -> bool:
        """A step of one token per sequence, few enough sequences, no context beyond the captured length."""
        return len(out.scheduled) <= self.sizes[-1] and all(
            n == 1 and seq.num_computed_tokens < self.max_seq_len for seq, n in out.scheduled
        )

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the padded step's rows, and the rows that sample (views of the static buffers: read them
        before the next step)."""
        size = padded_size(self.sizes, len(out.scheduled))
        packed = self._load(out, size)
        if not self.capture:
            self._forward(packed)
        elif size in self.graphs:
            self.graphs[size].replay()
        else:
            self._capture(size, packed)
        return self.hidden[:size], packed.sample_rows(self.static)

    @torch.inference_mode()
    def run_padding(self) -> None:
        """The body of the largest size's graph, every row padding: what its capture allocates (the model runner
        measures it on a scratch cache before sizing the KV pool, memory_profile.py)."""
        self._forward(self._load(SchedulerOutput(), self.sizes[-1]))

    def _load(self, out: SchedulerOutput, size: int) -> PackedStep:
        """The step padded to `size` rows, copied into the static buffer."""
        packed = pack_step(out, self.block_size, replace(self.pad, num_seqs=size), pinned=self.capture)
        self.static[: packed.host.numel()].copy_(packed.host, non_blocking=self.capture)
        return packed

    def _forward(self, packed: PackedStep) -> None:
        """The body a graph captures: static inputs to static hidden states."""
        step = packed.unpack(self.static)
        size = len(packed.seq_lens)
        # The decode kernel sizes its grid by the host lengths: a graph must cover every context up to max_seq_len.
        meta = replace(step.meta, seq_lens_host=[self.max_seq_len] * size, max_seq_len=self.max_seq_len)
        self.hidden[:size] = self.model.forward(step.input_ids, step.positions, meta, self.kv_caches)

    def _capture(self, size: int, packed: PackedStep) -> None:
        # The warm-up computes this step (a capture records kernels without running them) and compiles the Triton
        # kernels outside the capture.
        self._forward(packed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(packed)
        self.pool = graph.pool()
        self.graphs[size] = graph
