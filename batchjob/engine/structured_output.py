"""Constrained decoding with xgrammar, as vLLM integrates it: a grammar per distinct constraint, compiled once
against the tokenizer and cached; a matcher per sequence; each step a token bitmask filled only for the rows that
are constrained (by xgrammar's thread pool when there are several) and applied to the logits on the CPU.

JSON is generated compact (no free whitespace): small models otherwise tend to spend their tokens on blank lines."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

    from batchjob.engine.sampling_params import SamplingParams
    from batchjob.engine.sequence import Sequence

GrammarKey = tuple[str, str]  # (kind, canonical text): one compiled grammar per key
_FIELDS = {
    "json_schema": "response_format.json_schema.schema",
    "json_object": "response_format",
    "regex": "regex",
    "choice": "choice",
}


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """What the request's output is constrained to, canonically; None when it is free."""
    rf = params.response_format
    if rf is not None and rf.type == "json_schema":
        return "json_schema", json.dumps(rf.json_schema.schema_)  # property order steers generation
    if rf is not None and rf.type == "json_object":
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice, ensure_ascii=False)
    return None


def check_grammar(params: SamplingParams) -> None:
    """ValueError naming the field when the constraint cannot be compiled (no tokenizer needed)."""
    key = grammar_key(params)
    if key is not None:
        _checked(key)


@functools.lru_cache(maxsize=1024)
def _checked(key: GrammarKey) -> None:
    try:
        _grammar(key)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError/ValueError
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{_FIELDS[key[0]]}: cannot be compiled to a grammar: {message}") from None


def _grammar(key: GrammarKey) -> xgr.Grammar:
    import xgrammar as xgr

    kind, text = key
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":  # OpenAI's json_object is an object (xgrammar's built-in JSON grammar takes any value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    # JSON string literals are valid EBNF string literals (same escapes).
    choices = json.loads(text)
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


class StructuredOutput:
    """Compiles grammars against one tokenizer and masks the logits of constrained rows."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.grammars: dict[GrammarKey, xgr.CompiledGrammar] = {}
        self._compiler: xgr.GrammarCompiler | None = None  # built at the first constrained request
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None

    @property
    def num_compiled(self) -> int:
        return len(self.grammars)

    def matcher(self, params: SamplingParams) -> xgr.GrammarMatcher | None:
        """A fresh matcher for a request's constraint, compiling its grammar on first use; None when free."""
        key = grammar_key(params)
        if key is None:
            return None
        import xgrammar as xgr

        compiled = self.grammars.get(key)
        if compiled is None:
            compiled = self.grammars[key] = self._get_compiler().compile_grammar(_grammar(key))
        return xgr.GrammarMatcher(compiled)

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

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask in place the logits of the constrained rows (row i is seqs[i]) to the tokens their grammar allows."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return
        import xgrammar as xgr

        n = len(seqs)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
        bitmask = self._bitmask[:n]
        matchers = [seqs[i].matcher for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    @staticmethod
    def accept(seq: Sequence, token: int) -> None:
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"request {seq.request_id}: the grammar rejected token {token} that its mask allowed")
