"""The job file: a pydantic model of the YAML, validated whole before any work starts.

Every section forbids unknown keys, and an error names the file, the field path and what is allowed there, because a
typo in a job that runs overnight should fail in the first second, not in the morning."""

from __future__ import annotations

import copy
import posixpath
import string
import typing
import urllib.parse
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from batchjob.engine.config import EmbedderConfig, EngineConfig
from batchjob.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, not_a_bool
from batchjob.job.output.schema import (
    EMBEDDING_COLUMNS,
    PROMPT_COLUMNS,
    REASONING_COLUMNS,
    RESULT_COLUMNS,
    SCORE_COLUMNS,
)
from batchjob.job.output.state import DATA, JOB_FILE, LOCK, QUARANTINE, STAGING, WRITTEN
from batchjob.job.output.storage import is_url
from batchjob.model.builtin import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from batchjob.model.tokenizer import RENDERER_VARIABLES

# What batchjob writes in an output folder, by name: nothing else may live there (the results cache, say).
OUTPUT_NAMES = frozenset({DATA, STAGING, QUARANTINE, JOB_FILE, LOCK, *WRITTEN})

FORMAT_BY_SUFFIX = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class JobFileError(Exception):
    """A job file (or a --set override) that cannot be used."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Section):
    path: str = Field(
        min_length=1,
        description="a file or a glob, local or an fsspec URL (s3://, gs://, hf://); relative paths are taken from "
        "the current directory",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for a URL (endpoint, profile, ...); default: the environment"
    )
    format: Literal["parquet", "jsonl", "openai-batch"] | None = Field(
        None, description="default: from the extension (.parquet/.pq, .jsonl/.ndjson)"
    )
    id_column: str = "id"
    text_column: str = "text"
    messages_column: str | None = Field(None, description="a column of chat messages, instead of a text column")
    passthrough: list[str] = Field(default_factory=list, description="input columns copied to the output")
    image_column: str | None = Field(
        None,
        description="a vision-language model's images for each row: a column of encoded image bytes, local paths or "
        "URLs (data:, file://; http(s):// with allow_urls), or a list of them; each takes the template's next <image> "
        "(all before the text where the template has none)",
    )
    allow_urls: bool = Field(
        False,
        description="true: images given by http(s) URL (an image column's, a message's image_url part) are fetched; "
        "default: such a row fails",
    )
    lora_column: str = Field(
        "lora",
        min_length=1,
        description="with engine.lora: the column naming each row's adapter (null or empty: the base model); an "
        "OpenAI Batch line names it in body.model",
    )
    batch_rows: int = Field(1024, ge=1, description="rows per Parquet read batch")

    @model_validator(mode="after")
    def _check(self) -> InputSpec:
        if self.format is None:
            suffix = Path(self.path).suffix.lower()
            if suffix not in FORMAT_BY_SUFFIX:
                raise ValueError(
                    f"cannot tell the format of {self.path!r} from its extension; "
                    "set input.format to one of 'parquet', 'jsonl', 'openai-batch'"
                )
            object.__setattr__(self, "format", FORMAT_BY_SUFFIX[suffix])
        twice = sorted({c for c in self.passthrough if self.passthrough.count(c) > 1})
        if twice:
            raise ValueError(f"passthrough: {', '.join(twice)} named more than once")
        ours = RESULT_COLUMNS | EMBEDDING_COLUMNS | REASONING_COLUMNS | PROMPT_COLUMNS | SCORE_COLUMNS
        clashes = sorted(ours & set(self.passthrough))
        if clashes:
            raise ValueError(
                f"passthrough: {', '.join(clashes)} would clash with result columns of that name "
                f"({', '.join(sorted(ours))})"
            )
        if self.format == "openai-batch":
            named = {"id_column", "text_column", "messages_column"} & self.model_fields_set
            if named:
                raise ValueError(
                    f"{', '.join(sorted(named))}: not used with format 'openai-batch' "
                    "(ids come from custom_id, prompts from body.messages or body.prompt)"
                )
        return self


class PromptSpec(_Section):
    system: str | None = None
    template: str | None = Field(None, description="str.format template over input columns; default: the text")
    chat_template: bool = True
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="the chat template's own switches, e.g. {enable_thinking: false} (Qwen3)"
    )
    on_too_long: Literal["error", "truncate_left", "truncate_right"] = "error"

    special_tokens_in_data: bool = Field(
        False,
        description="true: special-token strings in row data (<|im_end|>, ...) are read as those tokens; default: "
        "row data is text, and only the chat template writes special tokens (generate only)",
    )

    @property
    def fields(self) -> list[str]:
        """The template's placeholders (column names)."""
        return [name for _, name, _, _ in string.Formatter().parse(self.template or "") if name is not None]

    @field_validator("template")
    @classmethod
    def _plain_placeholders(cls, template: str | None) -> str | None:
        for _, name, format_spec, conversion in string.Formatter().parse(template or ""):
            if format_spec or conversion:
                # A width is memory to allocate ({text:>999999999999} exhausts it) and a conversion (!r) quotes the
                # text: neither is a prompt's business.
                spec = f"!{conversion}" * bool(conversion) + f":{format_spec}" * bool(format_spec)
                raise ValueError(
                    f"{{{name}{spec}}}: format specs and conversions are not allowed; write the column as {{{name}}}"
                )
        return template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_renderer_variables(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if clash := sorted(RENDERER_VARIABLES & set(kwargs)):
            raise ValueError(f"{', '.join(clash)}: set by the chat template's renderer itself, not by a job file")
        return kwargs


class ScheduleSpec(_Section):
    sort_window: int = Field(4096, ge=1, description="rows reordered together; bounds the memory of ordering")
    dedupe: bool = Field(True, description="compute identical deterministic requests once")


class OutputSpec(_Section):
    path: str = Field(min_length=1, description="a folder, local or an fsspec URL (s3://bucket/prefix, gs://...)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for a URL")
    lease_seconds: float = Field(
        60.0, gt=0, description="on an object store: how long a killed run's lock lasts (a live run renews it)"
    )
    format: Literal["parquet", "openai-batch"] = "parquet"
    order: Literal["completion", "input"] = "completion"
    checkpoint_rows: int = Field(1000, ge=1)
    checkpoint_seconds: float = Field(60.0, gt=0)
    rows_per_file: int = Field(100_000, ge=1, description="rows per final file when order is 'input'")
    split_reasoning: bool = Field(
        False, description="a <think>...</think> block at an output's start goes to `reasoning`, the rest to `output`"
    )


class RaySpec(_Section):
    """Where and how wide a run with `executor: ray` goes."""

    address: str | None = Field(
        None,
        description="a running cluster ('auto', 'ray://host:10001'); default: "
        "$RAY_ADDRESS if set, else a local instance on this machine",
    )
    num_workers: int = Field(1, ge=1, description="actors, each loading the model once and holding one engine")
    num_cpus_per_worker: float = Field(1.0, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    shard_rows: int = Field(
        256,
        ge=1,
        description="rows a worker takes at a time: the planner orders within a "
        "shard, and a shard's results are committed when it is done",
    )


class ScoreSpec(_Section):
    """What a scoring job (task: score) scores in each row, teacher-forced (Engine.score): by default the prompt's
    own tokens after its first."""

    continuation_column: str | None = Field(
        None, min_length=1, description="a column whose text is scored as the continuation of the row's prompt"
    )
    labels: list[str] | None = Field(
        None,
        min_length=2,
        description="classification: each label scored as the prompt's continuation; the likeliest is `label`",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="vLLM's: a token_logprobs column, each scored token's logprob with its k likeliest alternatives; "
        "default: no such column",
    )

    _count = field_validator("prompt_logprobs", mode="before")(not_a_bool)

    @model_validator(mode="after")
    def _check(self) -> ScoreSpec:
        if self.labels is not None:
            if self.continuation_column is not None:
                raise ValueError("labels: not with continuation_column (each label is the continuation)")
            if self.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: not used with labels (label_logprobs holds each label's)")
            if any(not label for label in self.labels):
                raise ValueError("labels: an empty label has nothing to score")
            if len(set(self.labels)) < len(self.labels):
                raise ValueError("labels: each label once (a label twice would split its probability)")
        return self


class CacheSpec(_Section):
    """A results cache shared by jobs (results_cache.py): rows whose result is stored there are not computed again."""

    path: str = Field(min_length=1, description="a folder, local or an fsspec URL (s3://bucket/prefix, gs://...)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for a URL")
    max_size: ByteSize = Field(
        ByteSize(10 << 30), gt=0, description="bytes ('500MB', '10GiB'); past it, the entries used longest ago go"
    )


class JobSpec(_Section):
    model: str = Field(
        DEFAULT_MODEL,
        min_length=1,
        description=f"default: {DEFAULT_MODEL}, or {DEFAULT_EMBEDDING_MODEL} for task 'embed'",
    )
    task: Literal["generate", "embed", "score"] = Field(
        "generate",
        description="'embed': one embedding a row (a sentence-transformers model) instead of a completion; 'score': "
        "logprobs, perplexity or a label a row, teacher-forced (the score section)",
    )
    executor: Literal["local", "ray"] = Field("local", description="'ray': scale out over Ray Data actors")
    input: InputSpec
    prompt: PromptSpec = Field(default_factory=PromptSpec)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    score: ScoreSpec = Field(default_factory=ScoreSpec, description="with task 'score': what each row's score is of")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    output: OutputSpec
    ray: RaySpec = Field(default_factory=RaySpec)
    cache: CacheSpec | None = Field(None, description="a results cache: rows computed before are taken from it")
    fail_on_row_errors: bool = False

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        inp, prompt = self.input, self.prompt
        if self.task == "embed":
            self._check_embed()
        if self.task == "score":
            self._check_score()
        elif self.score != ScoreSpec():  # its defaults, as a dumped job writes them, are no setting to refuse
            raise ValueError("score: used with task 'score' only")
        if inp.messages_column is not None:
            if prompt.template is not None:
                raise ValueError("prompt.template: not used with input.messages_column (the messages are the prompt)")
            if not prompt.chat_template:
                raise ValueError("prompt.chat_template: must be true with input.messages_column")
        elif inp.format != "openai-batch" and prompt.template is not None:
            for name in prompt.fields:
                if not name.isidentifier():
                    raise ValueError(f"prompt.template: placeholder {{{name}}} is not a column name")
            if inp.text_column not in prompt.fields:
                raise ValueError(
                    f"prompt.template: must contain {{{inp.text_column}}} (input.text_column), "
                    f"the text that is checked and truncated; it has {prompt.fields}"
                )
        if inp.image_column is not None:
            self._check_images()
        if self.cache is not None and self.executor == "ray":
            raise ValueError("cache: not yet used with executor 'ray' (its workers do not look rows up)")
        if self.cache is not None:
            self._check_cache_path()
        if self.output.format == "openai-batch" and inp.format != "openai-batch":
            raise ValueError("output.format: 'openai-batch' needs input.format 'openai-batch' (custom_id per line)")
        return self

    def _check_images(self) -> None:
        """What an image job does not read yet is refused rather than run without its images."""
        inp, unused = self.input, []
        unused += [f"task {self.task!r}"] if self.task != "generate" else []
        unused += ["executor 'ray'"] if self.executor == "ray" else []
        if unused:
            raise ValueError(f"input.image_column: not yet read with {', '.join(unused)}")
        chats = [f"input.format {inp.format!r}"] if inp.format == "openai-batch" else []
        chats += ["input.messages_column"] if inp.messages_column is not None else []
        if chats:
            raise ValueError(
                f"input.image_column: not used with {', '.join(chats)} (a message's image_url parts are its images)"
            )
        if inp.image_column in (inp.text_column, inp.id_column):
            raise ValueError(f"input.image_column: {inp.image_column!r} is the row's text or id column")

    def _check_cache_path(self) -> None:
        """The results cache may share the output folder, never one of the names batchjob writes there: its entries
        in data/ would be read as results (pyarrow's read of the folder failed on them, and the next run refused the
        folder as holding files batchjob did not write), and under a file's name they would stop that file."""
        below = _below(self.output.path, self.cache.path)
        if below and below[0] in OUTPUT_NAMES:
            raise ValueError(
                f"cache.path: {self.cache.path} is in the output folder's {below[0]}, which batchjob keeps for the "
                "job's own files; give the cache a folder of its own (the output folder itself, or another in it, will "
                "do)"
            )

    def _check_score(self) -> None:
        """A scoring job draws no token, so nothing of sampling applies; it reads a row's text as written (no chat
        template) unless the job file asks for the template, and then only a continuation or labels are scored, not
        the template's own markup."""
        prompt, score, inp = self.prompt, self.score, self.input
        unused = ["sampling"] if self.sampling != SamplingParams() else []  # its defaults, as a dump writes them
        unused += ["output.split_reasoning"] if self.output.split_reasoning else []
        if unused:
            raise ValueError(f"{', '.join(unused)}: not used with task 'score'")
        if inp.format == "openai-batch":
            raise ValueError("input.format: 'openai-batch' is not read by task 'score' (use parquet or jsonl)")
        if "chat_template" not in prompt.model_fields_set and inp.messages_column is None:
            object.__setattr__(prompt, "chat_template", False)
        if prompt.chat_template and score.continuation_column is None and score.labels is None:
            raise ValueError(
                "prompt.chat_template: with task 'score' it needs score.continuation_column or score.labels "
                "(scored after the template's assistant turn); a text's own tokens are scored without it"
            )
        if score.continuation_column is not None and score.continuation_column in (
            inp.text_column,
            inp.messages_column,
        ):
            raise ValueError(
                f"score.continuation_column: {score.continuation_column!r} is the prompt's own column; "
                "name the column of the text that follows the prompt"
            )

    def _check_embed(self) -> None:
        """What an embedding job cannot use fails here rather than being ignored: there is nothing to sample, no chat
        to template, and the engine is an Embedder with settings of its own."""
        # A section or key at its defaults (a dumped job writes them all) is no setting to refuse.
        unused = ["sampling"] if self.sampling != SamplingParams() else []
        defaults = PromptSpec()
        unused += [
            f"prompt.{name}"
            for name in ("system", "chat_template", "chat_template_kwargs")
            if getattr(self.prompt, name) != getattr(defaults, name)
        ]
        # Special-token strings in an embedding's data are read as tokens (below; a dump writes true): only asking
        # for text asks what the job does not do.
        if "special_tokens_in_data" in self.prompt.model_fields_set and not self.prompt.special_tokens_in_data:
            unused.append("prompt.special_tokens_in_data")
        unused += ["output.split_reasoning"] if self.output.split_reasoning else []
        unused += ["input.messages_column"] if self.input.messages_column is not None else []
        if unused:
            raise ValueError(f"{', '.join(unused)}: not used with task 'embed'")
        engine = EngineConfig()
        other = sorted(
            k
            for k in self.engine.model_fields_set - set(EmbedderConfig.model_fields)
            if getattr(self.engine, k) != getattr(engine, k)
        )
        if other:
            raise ValueError(
                f"engine.{', engine.'.join(other)}: not used with task 'embed' "
                f"(its engine keys: {', '.join(EmbedderConfig.model_fields)})"
            )
        if "model" not in self.model_fields_set:
            object.__setattr__(self, "model", DEFAULT_EMBEDDING_MODEL)
        # An embedding model's text is tokenized as sentence-transformers tokenizes it ([SEP] in a text is the
        # token): it has no turns to forge, and its vectors stay those of the reference. The fingerprint says so.
        object.__setattr__(self.prompt, "special_tokens_in_data", True)
        if "on_too_long" not in self.prompt.model_fields_set:
            # An embedding model reads a text's start, as sentence-transformers cuts it; `truncated` says so.
            object.__setattr__(self.prompt, "on_too_long", "truncate_right")
        try:
            config = EmbedderConfig(**self.engine_settings())
        except pydantic.ValidationError as e:
            raise ValueError("; ".join(f"engine.{_describe(err, [])}" for err in e.errors())) from None
        # The Embedder's own budget, not the generate profile's: what a dump of this job writes and its reload uses.
        object.__setattr__(self.engine, "max_num_batched_tokens", config.max_num_batched_tokens)

    def engine_settings(self) -> dict[str, Any]:
        """The engine keys that the job file sets, as its task's engine takes them: an embedding job's Embedder takes
        its own keys only (a dumped job holds every key, the others at the generate engine's defaults)."""
        settings = self.engine.model_dump(exclude_unset=True)
        if self.task == "embed":
            return {k: v for k, v in settings.items() if k in EmbedderConfig.model_fields}
        return settings


# A job file is a few hundred values; past these it is not one (/dev/zero, a log named by mistake, or aliases that
# make billions of values out of a few lines), and reading on would only exhaust memory.
MAX_JOB_FILE_BYTES = 16 << 20
MAX_JOB_VALUES = 1_000_000


def load_job(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobSpec:
    """Read, override and validate a job file; JobFileError says what is wrong and where."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as e:
        raise JobFileError(f"{path}: cannot read the job file: {e.strerror or e}") from None
    if len(data) > MAX_JOB_FILE_BYTES:
        raise JobFileError(f"{path}: larger than {MAX_JOB_FILE_BYTES >> 20} MiB; not a job file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return job_from_mapping(_parse_yaml(text, str(path)), path, overrides)


def job_from_mapping(raw: Any, source: str | Path = "job", overrides: typing.Sequence[str] = ()) -> JobSpec:
    """A job from its sections as the YAML reads (a dict), with --set overrides; JobFileError names `source`."""
    if not isinstance(raw, dict):
        raise JobFileError(f"{source}: the job file must be a mapping of sections (model, input, prompt, ...)")
    raw = copy.deepcopy(raw)  # the overrides write into it
    set_paths = [_apply_override(raw, item, source) for item in overrides]
    if (where := _lone_surrogate(raw, ())) is not None:
        raise JobFileError(
            f"{source}: {'.'.join(where) or 'job'}: holds a lone surrogate (a \\uD800-\\uDFFF escape alone), not text"
        )
    try:
        return JobSpec.model_validate(raw)
    except pydantic.ValidationError as e:
        lines = [_describe(err, set_paths) for err in e.errors()]
        raise JobFileError(f"{source}: invalid job file\n" + "\n".join(f"  {line}" for line in lines)) from None


class _Loader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key written twice in one mapping: YAML keeps the last without a word, so a
    second `sampling:` section would silently replace the first. (A key that a merge `<<: *name` brings may be
    written over, as YAML means it to be.)"""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = None if key_node.tag == "tag:yaml.org,2002:merge" else self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, source: str) -> Any:
    """The YAML value of `text`; JobFileError in one line, naming `source` (the file, or the --set), when it is not
    usable."""
    try:
        value = yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = "; ".join(filter(None, [e.context, e.problem]))
        raise JobFileError(f"{source}: not valid YAML: {problem}{where}") from None
    except yaml.YAMLError as e:
        raise JobFileError(f"{source}: not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise JobFileError(f"{source}: not usable YAML: nested too deeply") from None
    try:
        _count_values(value, {}, set())
    except ValueError as e:
        raise JobFileError(f"{source}: not usable YAML: {e}") from None
    return value


def _lone_surrogate(value: Any, at: tuple[str, ...]) -> tuple[str, ...] | None:
    """Where a text of `value` (a key or a value) holds a lone surrogate: YAML's "\\ud800" and a Python str may, and
    no tokenizer or writer takes it (it would fail the job once the model had loaded)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return at
        return None
    if isinstance(value, dict):
        for key, member in value.items():
            if (where := _lone_surrogate(key, at)) is not None or (
                where := _lone_surrogate(member, (*at, str(key)))
            ) is not None:
                return where
    elif isinstance(value, (list, tuple)):
        for i, member in enumerate(value):
            if (where := _lone_surrogate(member, (*at, str(i)))) is not None:
                return where
    return None


def _count_values(value: Any, counted: dict[int, int], open_: set[int]) -> int:
    """How many values `value` holds with its aliases (&name, *name) expanded, counted without expanding them;
    ValueError past MAX_JOB_VALUES or where an alias holds itself."""
    if not isinstance(value, (dict, list)):
        return 1
    key = id(value)
    if key in counted:
        return counted[key]
    if key in open_:
        raise ValueError("an alias (*name) stands for a value that holds the alias itself")
    open_.add(key)
    members = [*value, *value.values()] if isinstance(value, dict) else value
    n = 1 + sum(_count_values(v, counted, open_) for v in members)
    open_.discard(key)
    if n > MAX_JOB_VALUES:
        raise ValueError(f"its aliases (*name) expand it to more than {MAX_JOB_VALUES:,} values")
    counted[key] = n
    return n


def _apply_override(raw: dict, item: str, path: str | Path) -> tuple[str, ...]:
    if not isinstance(item, str):  # from Python (batchjob.run_job): the CLI's items are strings
        raise JobFileError(f"--set {item!r}: expected a KEY=VALUE string, e.g. engine.max_num_seqs=32")
    key, sep, text = item.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise JobFileError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. engine.max_num_seqs=32")
    node = raw
    for depth, part in enumerate(keys[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise JobFileError(f"{path}: --set {item!r}: {'.'.join(keys[: depth + 1])} is not a section")
    # YAML parsing of the value gives 32 an int, true a bool and [a, b] a list, as in the file itself.
    node[keys[-1]] = _parse_yaml(text, f"--set {item!r}") if text.strip() else ""
    return keys


def _below(folder: str, path: str) -> list[str] | None:
    """The names leading from `folder` down to `path`: [] for the folder itself, None for a path outside it. Local
    paths as a run resolves them (from the working folder, through links and '..'); URLs by scheme, bucket and key."""
    if is_url(folder) != is_url(path):
        return None
    if not is_url(folder):
        top, inner = (Path(p.removeprefix("file://")).resolve() for p in (folder, path))
        return list(inner.relative_to(top).parts) if inner.is_relative_to(top) else None
    (scheme, bucket, top), (other, place, inner) = (_url_parts(p) for p in (folder, path))
    if (scheme, bucket) != (other, place) or inner[: len(top)] != top:
        return None
    return inner[len(top) :]


def _url_parts(url: str) -> tuple[str, str, list[str]]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc, [p for p in posixpath.normpath("/" + parts.path).split("/") if p]


def _describe(err: dict, set_paths: list[tuple[str, ...]]) -> str:
    loc = tuple(str(part) for part in err["loc"])
    where = ".".join(loc) or "job"
    if err["type"] == "extra_forbidden":
        allowed = sorted(_model_at(loc[:-1]).model_fields) if _model_at(loc[:-1]) else []
        message = f"unknown key; allowed: {', '.join(allowed)}"
    elif err["type"] == "missing":
        message = "required"
    else:
        message = err["msg"].removeprefix("Value error, ")
        if "input" in err and not isinstance(err["input"], (dict, list)):
            message += f" (got {err['input']!r})"
    # Under a --set (its key, or inside its value), or above it (a section's own check, an unknown key on its path).
    if any(loc[: len(p)] == p or (loc and p[: len(loc)] == loc) for p in set_paths):
        message += " [set on the command line]"
    return f"{where}: {message}"


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class whose fields are allowed at a location, for listing them in an unknown-key error."""
    model: Any = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None
