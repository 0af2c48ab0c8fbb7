"""Tokenizer built with the `tokenizers` library from GGUF metadata or tokenizer.json, and the chat template
rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from batchjob.model.chat_shape import Chat, ChatShape, splits_at_added_tokens, template_inserts_content_verbatim
from batchjob.model.errors import ModelLoadError

# The split llama.cpp applies before byte-level BPE, by `tokenizer.ggml.pre`; absent means GPT-2's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
# Pre-tokenizers that split every digit before GPT-2's regex (llama.cpp's "smollm", "starcoder", ...).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell"}
_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4
_GEMMA_GGUF = {"gemma", "gemma2", "gemma3"}  # architectures whose "llama" (SentencePiece) vocabulary is Gemma's
MAX_CHAT_SHAPES = 4096  # kept between calls; past this many the cache starts over
# Row data is text (Tokenizer.escape): a special-token string in it becomes a mark, private-use characters that no
# tokenizer or template reads as a token and no filter (trim, upper) changes, and encoding writes it back as text.
MARK_OPEN, MARK_CLOSE, MARK_DIGIT_0 = "\ue000", "\ue001", 0xE100
# A mark without digits stands for nothing: at an edge of row data it keeps a special-token string from forming across
# the join with the text beside it (another field, the template's text), and encoding drops it.
JOIN_BREAK = MARK_OPEN + MARK_CLOSE
_MARK = re.compile(f"{MARK_OPEN}([{chr(MARK_DIGIT_0)}-{chr(MARK_DIGIT_0 + 9)}]*){MARK_CLOSE}")


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos_token: bool = False,
    ):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        if add_bos_token and self.bos_token_id is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token} $A",
                pair=f"{bos_token} $A {bos_token} $B",
                special_tokens=[(bos_token, self.bos_token_id)],
            )
        try:
            self._template = _compile(chat_template) if chat_template else None
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"its chat template does not parse: {e.message} (line {e.lineno})") from None
        self._shapes: dict[tuple, ChatShape | None] = {}
        self._template_kwargs: dict = {}  # the chat template's own switches (enable_thinking), as vLLM passes them

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token strings as the model stores them (byte-level or SentencePiece pieces) and their ids."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_kind(self) -> str:
        """How token strings map to bytes, in xgrammar's terms: byte_level (GPT-2's byte alphabet), byte_fallback
        (SentencePiece pieces with <0xNN> byte tokens) or raw."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if "ByteLevel" in kinds:
            return "byte_level"
        return "byte_fallback" if kinds & {"ByteFallback", "Metaspace"} else "raw"

    @property
    def add_prefix_space(self) -> bool:
        """Whether encoding puts a space before the text (SentencePiece's leading ▁)."""
        pieces = self.backend.encode("a", add_special_tokens=False).tokens
        return self.vocab_kind == "byte_fallback" and bool(pieces) and pieces[0].startswith("\u2581")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if _MARK.search(text):
            return self._encode_marked(text, add_special_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        marked = [bool(_MARK.search(t)) for t in texts]
        plain = [i for i, m in enumerate(marked) if not m]
        out = [self._encode_marked(t, add_special_tokens) if m else [] for t, m in zip(texts, marked)]
        encoded = self.backend.encode_batch([texts[i] for i in plain], add_special_tokens=add_special_tokens)
        for i, e in zip(plain, encoded):
            out[i] = e.ids
        return out

    def escape(self, data: str, special_tokens: bool = True) -> str:
        """`data` (a row's text) as text that encode() and encode_chats() read as this text and never as special
        tokens, however a chat template places it and whatever text is joined to it: each special-token string (and
        the mark character) in it becomes a mark, and an edge that could complete a special-token string with the
        text beside it gets a JOIN_BREAK. Text without them comes back as it is, so its token ids are what they
        always were. With special_tokens False (text whose special-token strings are meant as tokens: the job file's,
        or rows under prompt.special_tokens_in_data) only the mark character is escaped, so that it stays itself."""
        pattern = self._escape_pattern if special_tokens else self._mark_pattern
        if pattern.search(data):
            data = pattern.sub(lambda m: self._mark(m.group()), data)
        if not special_tokens or not data:
            return data
        head = JOIN_BREAK if self._may_end_special(data) else ""
        return head + data + (JOIN_BREAK if self._may_start_special(data) else "")

    def escape_messages(self, messages: list[dict], special_tokens: bool = True) -> list[dict]:
        """Each message with escape() applied to every text in it, its role as its content: a chat template writes
        both into the prompt (a role is not markup either)."""
        return [
            {k: self.escape(v, special_tokens) if isinstance(v, str) else v for k, v in m.items()} for m in messages
        ]

    def _mark(self, escaped: str) -> str:
        return MARK_OPEN + "".join(chr(MARK_DIGIT_0 + int(d)) for d in str(self._mark_index[escaped])) + MARK_CLOSE

    @cached_property
    def _escaped(self) -> list[str]:
        """What each mark stands for: the special tokens' strings, longest first (so a regex of them finds the
        longest at a place, as the tokenizer does), and the mark character itself."""
        special = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        return [*sorted(special, key=len, reverse=True), MARK_OPEN]

    @cached_property
    def _mark_index(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self._escaped)}

    @cached_property
    def _escape_pattern(self) -> re.Pattern:
        return re.compile("|".join(map(re.escape, self._escaped)))

    @cached_property
    def _mark_pattern(self) -> re.Pattern:
        return re.compile(re.escape(MARK_OPEN))

    @cached_property
    def _special_parts(self) -> tuple[frozenset[str], frozenset[str], str, int]:
        """The special tokens' proper prefixes and suffixes, their tails (each less its first character) joined, and
        the longest one's length: what the join checks of escape() look up."""
        special = self._escaped[:-1]
        prefixes = frozenset(s[:j] for s in special for j in range(1, len(s)))
        suffixes = frozenset(s[j:] for s in special for j in range(1, len(s)))
        return prefixes, suffixes, "\0".join(s[1:] for s in special), max(map(len, special), default=0)

    def _may_end_special(self, data: str) -> bool:
        """Whether text before `data` could hold a special token's start that `data` completes or continues."""
        _, suffixes, tails, longest = self._special_parts
        return any(data[:k] in suffixes for k in range(1, min(longest, len(data) + 1))) or (
            len(data) < longest and data in tails
        )

    def _may_start_special(self, data: str) -> bool:
        """Whether `data` ends in a special token's start that text after it could complete."""
        prefixes, _, _, longest = self._special_parts
        return any(data[-k:] in prefixes for k in range(1, min(longest, len(data) + 1)))

    @cached_property
    def _special_pattern(self) -> re.Pattern | None:
        special = self._escaped[:-1]
        return re.compile("|".join(map(re.escape, special))) if special else None

    @cached_property
    def _text_backend(self) -> HFTokenizer:
        """The tokenizer reading special-token strings as text (transformers' split_special_tokens)."""
        backend = HFTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def _encode_marked(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of a text holding marks: its own special tokens (the template's and the job's text: all its
        special-token strings, since the row's became marks) are tokens, and the text between them is tokenized with
        the marks written back, as text."""
        unmark = lambda piece: _MARK.sub(  # noqa: E731
            lambda m: self._escaped[int("".join(str(ord(c) - MARK_DIGIT_0) for c in m.group(1)))] if m.group(1) else "",
            piece,
        )
        pieces, at = [], 0
        for m in self._special_pattern.finditer(text) if self._special_pattern else ():
            pieces.append(self._text_backend.encode(unmark(text[at : m.start()]), add_special_tokens=False))
            pieces.append(self.backend.encode(m.group(), add_special_tokens=False))
            at = m.end()
        pieces.append(self._text_backend.encode(unmark(text[at:]), add_special_tokens=False))
        return self.backend.post_process(Encoding.merge(pieces), add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        return self._template.render(
            **self._template_kwargs,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def with_template_kwargs(self, kwargs: dict) -> Tokenizer:
        """This tokenizer, its chat template rendered with `kwargs` too (Qwen3's `enable_thinking`, say), as vLLM's
        chat_template_kwargs; the same tokenizer when there are none."""
        if not kwargs:
            return self
        if clash := sorted(RENDERER_VARIABLES & set(kwargs)):
            raise ValueError(f"chat_template_kwargs: {', '.join(clash)} is set by the renderer itself")
        other = copy.copy(self)
        other._template_kwargs, other._shapes = {**self._template_kwargs, **kwargs}, {}
        return other

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, as transformers' apply_chat_template(tokenize=True) assumes.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def encode_chats(self, chats: list[Chat]) -> list[list[int] | Exception]:
        """encode_chat() of many chats, the same ids, an exception where the template refused one. Chats of one shape
        (equal but for the hole's content) that chat_shape proves safe are rendered once and tokenized around the
        content only; the rest are rendered and tokenized whole."""
        out: list = [None] * len(chats)
        groups: dict[tuple | None, list[int]] = {}
        for i, (messages, hole) in enumerate(chats):
            # A chat holding marks (escape) is rendered and tokenized whole: a shape's head and tail are not.
            marked = any(_MARK.search(m["content"]) for m in messages if isinstance(m.get("content"), str))
            groups.setdefault(self._shape_key(messages, hole) if self._verbatim and not marked else None, []).append(i)
        whole: list[tuple[int, str]] = []
        cut: list[tuple[int, ChatShape, str]] = []
        for key, members in groups.items():
            first = chats[members[0]]
            shape = self._shape(key, first) if key is not None and (len(members) > 1 or key in self._shapes) else None
            for i in members:
                messages, hole = chats[i]
                content = messages[hole]["content"]
                if shape is None or not isinstance(content, str):
                    try:
                        whole.append((i, self.apply_chat_template(messages)))
                    except Exception as e:  # the template is the model's code; the caller reports it per chat
                        out[i] = e
                elif shape.can_cut(content):
                    cut.append((i, shape, content))
                else:
                    whole.append((i, shape.text(content)))
        for (i, _), ids in zip(whole, self.encode_batch([t for _, t in whole], add_special_tokens=False)):
            out[i] = ids
        middles = [shape.middle(content) for _, shape, content in cut]
        for (i, shape, _), ids in zip(cut, self.encode_batch(middles, add_special_tokens=False)):
            out[i] = shape.head_ids + ids + shape.tail_ids
        return out

    @cached_property
    def _verbatim(self) -> bool:
        return self._template is not None and template_inserts_content_verbatim(
            self._template.environment, self.chat_template
        )

    @cached_property
    def _splits_at_added_tokens(self) -> bool:
        return splits_at_added_tokens(self.backend)

    @staticmethod
    def _shape_key(messages: list[dict], hole: int) -> tuple | None:
        try:
            key = tuple(
                (i == hole, tuple((k, v) for k, v in m.items() if i != hole or k != "content"))
                for i, m in enumerate(messages)
            )
            hash(key)
        except TypeError:  # a value that is not text: no shape
            return None
        return key

    def _shape(self, key: tuple, chat: Chat) -> ChatShape | None:
        if key not in self._shapes:
            if len(self._shapes) >= MAX_CHAT_SHAPES:
                self._shapes.clear()
            messages, hole = chat

            def render(content: str) -> str:
                return self.apply_chat_template(
                    [*messages[:hole], {**messages[hole], "content": content}, *messages[hole + 1 :]]
                )

            try:
                self._shapes[key] = ChatShape(render, self.backend, self._splits_at_added_tokens)
            except Exception:  # refused or content-dependent after all: these chats are rendered one by one
                self._shapes[key] = None
        return self._shapes[key]

    def save(self, folder: Path) -> None:
        """As tokenizer.json + tokenizer_config.json, which from_folder (and transformers) read back."""
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    @classmethod
    def from_gguf(cls, reader, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        field = lambda name: reader.fields[name].contents()  # noqa: E731
        types = field("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in reader.fields else []
        tok = lambda key: tokens[meta[key]] if key in meta else None  # noqa: E731
        if kind == "llama" and meta.get("general.architecture") in _GEMMA_GGUF:
            tokens = field("tokenizer.ggml.tokens")
            return cls(
                _gemma_backend(tokens, types, tokens[meta.get("tokenizer.ggml.unknown_token_id", 3)]),
                bos_token=tok("tokenizer.ggml.bos_token_id"),
                eos_token=tok("tokenizer.ggml.eos_token_id"),
                chat_template=meta.get("tokenizer.chat_template"),
                add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            )
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is, and Gemma's "
                "SentencePiece); use the model's Hugging Face folder with tokenizer.json instead"
            )
        tokens, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
        backend = HFTokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=[tuple(m.split(" ", 1)) for m in merges],
                fuse_unk=False,
            )
        )
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
        if pre in _SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_SPLITS[pre]), "isolated"), byte_level]
            )
        elif pre in _DIGIT_SPLIT:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        return cls(
            backend,
            bos_token=tok("tokenizer.ggml.bos_token_id"),
            eos_token=tok("tokenizer.ggml.eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_folder(cls, path: Path) -> Tokenizer:
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        return cls(
            backend,
            bos_token=token(cfg.get("bos_token")),
            eos_token=token(cfg.get("eos_token")),
            chat_template=template,
        )


def _gemma_backend(tokens: list[str], types: list[int], unk: str) -> HFTokenizer:
    """Gemma's SentencePiece vocabulary (BPE with byte fallback) from a GGUF, as transformers' GGUF loader and its
    GemmaTokenizer build it: a GGUF spells a token of several spaces with real spaces (the vocabulary with U+2581) and
    lists no merges, which are rebuilt from the vocabulary, earlier tokens first (the file's order is Gemma's merge
    order; its scores are not). Control tokens are special; user-defined ones (llama.cpp's type 4) are matched
    whole."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: -i for i, t in enumerate(tokens)}
    merges = []  # transformers' generate_merges with these ranks
    for token, score in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(a, b, score) for a, b in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )
    return backend


def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def _environment() -> ImmutableSandboxedEnvironment:
    """As transformers does: sandboxed, trim_blocks + lstrip_blocks, with raise_exception and strftime_now."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# The names a chat template sees that the renderer gives it (apply_chat_template's own arguments, and the globals:
# jinja2's range, namespace, ... and raise_exception, strftime_now): a chat_template_kwargs key of one of these names
# would clash with it (a TypeError at every render) or hide it from the template.
RENDERER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", *_environment().globals})
