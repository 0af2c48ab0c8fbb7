"""Constrained decoding with xgrammar, as vLLM integrates it: a grammar per distinct constraint, compiled once
against the tokenizer and cached; a matcher per sequence; each step a token bitmask filled only for the rows that
are constrained (by xgrammar's thread pool when there are several) while the device runs the step's forward pass, then
applied to the logits on their device.

JSON is generated compact (no free whitespace): small models otherwise tend to spend their tokens on blank lines."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from batchjob.engine.grammar import GrammarKey, build_grammar
from batchjob.engine.sampler import LogitsMask
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.sequence import Sequence

if TYPE_CHECKING:
    import xgrammar as xgr


class StructuredOutput:
    """Compiles grammars against one tokenizer and masks the logits of constrained rows."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.grammars: dict[GrammarKey, xgr.CompiledGrammar] = {}
        self._compiler: xgr.GrammarCompiler | None = None  # built at the first constrained request
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None
        # Time spent on constraints (compiling, filling and applying masks, advancing matchers): what they cost,
        # measured directly (bench reports it beside the throughput ratio, which host noise blurs).
        self.seconds = 0.0

    @property
    def num_compiled(self) -> int:
        return len(self.grammars)

    def matcher(self, params: SamplingParams) -> xgr.GrammarMatcher | None:
        """A fresh matcher for a request's constraint, compiling its grammar on first use; None when free."""
        key = params.grammar_key
        if key is None:
            return None
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiled = self.grammars.get(key)
        if compiled is None:
            compiled = self.grammars[key] = self._get_compiler().compile_grammar(build_grammar(key))
        matcher = xgr.GrammarMatcher(compiled)
        self.seconds += time.perf_counter() - t0
        return matcher

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer
            vocab = [""] * self.vocab_size
            for token, i in tok.get_vocab().items():
                if i < self.vocab_size:
                    vocab[i] = token
            info = xgr.TokenizerInfo(
                vocab,
                xgr.VocabType[tok.vocab_kind.upper()],
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
                add_prefix_space=tok.add_prefix_space,
            )
            # Our own dict caches the compiled grammars (and counts them), so xgrammar's cache is off.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            self._batch = xgr.BatchGrammarMatcher()
        return self._compiler

    def fill(self, seqs: list[Sequence], device: torch.device) -> LogitsMask | None:
        """The bitmask of the tokens each constrained row's grammar allows next (row i is seqs[i]), filled on the host
        now (while a GPU still runs the step: call it before anything waits for the step), as the mask that the
        sampler applies in place to the step's logits on `device`. None when no row is constrained."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        import xgrammar as xgr

        t0 = time.perf_counter()
        n = len(seqs)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
            if device.type == "cuda":  # copied without blocking; the step's read ends the copy before a refill
                self._bitmask = self._bitmask.pin_memory()
        bitmask = self._bitmask[:n]
        matchers = [seqs[i].matcher for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        device_mask = bitmask.to(device, non_blocking=True)  # xgrammar's kernel applies it on a GPU
        self.seconds += time.perf_counter() - t0

        def apply(logits: torch.Tensor) -> None:
            t0 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=self.vocab_size, indices=rows)
            self.seconds += time.perf_counter() - t0

        return apply

    def accept(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Advance the constrained rows' matchers by their sampled tokens."""
        t0 = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                raise RuntimeError(f"request {seq.request_id}: the grammar rejected token {token} its mask allowed")
        self.seconds += time.perf_counter() - t0
