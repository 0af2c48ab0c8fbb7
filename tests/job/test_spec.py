import pytest
import yaml

from batchjob.engine.config import EmbedderConfig, EngineConfig
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.spec import JobFileError, job_from_mapping, load_job
from tests.helpers import REPO

MINIMAL = "input: {path: docs.parquet}\noutput: {path: out}\n"


def load(tmp_path, text, overrides=()):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_job(path, overrides)


def error_of(tmp_path, text, overrides=()) -> str:
    with pytest.raises(JobFileError) as e:
        load(tmp_path, text, overrides)
    return str(e.value)


def test_the_shipped_job_is_valid():
    job = load_job(REPO / "jobs" / "summarize.yaml")
    assert job.input.path == "sample_data/documents.parquet" and job.input.format == "parquet"
    assert job.sampling.greedy and job.prompt.chat_template and job.prompt.system
    assert job.output.path == "out/summarize"


def test_the_structured_output_examples_are_valid(tmp_path):
    job = load_job(REPO / "jobs" / "structured.yaml")
    assert job.sampling.response_format.type == "json_schema" and job.sampling.grammar_key is not None
    # docs/job-file.md's sampling blocks: the constraint, with its commented-out alternatives, and the samples.
    doc = (REPO / "docs" / "job-file.md").read_text()

    def block(heading: str) -> str:
        section = doc[doc.index(heading) :]
        return section[section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml"))]

    job = load(tmp_path, MINIMAL + block("## Structured output"))
    assert job.sampling.response_format.json_schema and job.sampling.grammar_key[0] == "json_schema"
    for constraint in ("regex", "choice"):  # the commented-out alternatives, each in place of response_format
        line = next(x for x in block("## Structured output").splitlines() if x.lstrip().startswith(f"# {constraint}:"))
        sampling = job.sampling.model_dump(exclude={"response_format"}) | yaml.safe_load(line.lstrip()[2:])
        assert SamplingParams.model_validate(sampling).grammar_key[0] == constraint
    job = load(tmp_path, MINIMAL + block("## Several samples and logprobs"))
    assert job.sampling.n == 4 and job.sampling.top_logprobs == 3 and job.sampling.logprobs


def test_defaults_and_format_inference(tmp_path):
    job = load(tmp_path, MINIMAL)
    assert job.input.format == "parquet" and job.input.id_column == "id" and job.input.text_column == "text"
    assert job.engine.profile == "throughput" and job.output.order == "completion"
    assert load(tmp_path, "input: {path: a.ndjson}\noutput: {path: out}\n").input.format == "jsonl"


def test_unknown_keys_name_the_file_the_path_and_the_allowed_keys(tmp_path):
    message = error_of(tmp_path, MINIMAL + "engine: {max_num_seqz: 3}\nprompt: {sytem: hi}\n")
    assert str(tmp_path / "job.yaml") in message
    assert "engine.max_num_seqz: unknown key; allowed:" in message and "max_num_seqs" in message
    assert (
        "prompt.sytem: unknown key; allowed: chat_template, chat_template_kwargs, on_too_long, special_tokens_in_data, "
        "system, template" in message
    )


def test_bad_values_say_what_is_allowed(tmp_path):
    message = error_of(
        tmp_path, MINIMAL + "prompt: {on_too_long: cut}\nengine: {profile: fast}\nsampling: {temperature: -1}\n"
    )
    assert "prompt.on_too_long: Input should be 'error', 'truncate_left' or 'truncate_right' (got 'cut')" in message
    assert "engine.profile: Input should be 'throughput' or 'latency' (got 'fast')" in message
    assert "sampling.temperature: Input should be greater than or equal to 0 (got -1)" in message


def test_a_count_written_as_true_or_false_is_refused(tmp_path):
    """pydantic reads true as 1 and false as 0: `prompt_logprobs: true` was one alternative a token, and
    `max_tokens: false` a scoring request, without a word (an OpenAI Batch line's prompt_logprobs: true fails)."""
    message = error_of(tmp_path, MINIMAL + "sampling: {prompt_logprobs: true, max_tokens: false, n: true}\n")
    for key, value in (("prompt_logprobs", "true"), ("max_tokens", "false"), ("n", "true")):
        assert f"sampling.{key}: an integer, not {value}" in message
    # any number: `temperature: true` was temperature 1.0
    message = error_of(tmp_path, MINIMAL + "sampling: {temperature: true, top_p: false, logit_bias: {5: true}}\n")
    for key, value in (("temperature", "true"), ("top_p", "false"), ("logit_bias", "true")):
        assert f"sampling.{key}: a number, not {value}" in message
    assert "sampling.stop_token_ids: an integer, not true" in error_of(
        tmp_path, MINIMAL + "sampling: {stop_token_ids: [2, true]}\n"
    )
    message = error_of(tmp_path, MINIMAL + "task: score\nsampling: {}\nscore: {prompt_logprobs: true}\n")
    assert "score.prompt_logprobs: an integer, not true" in message
    assert load(tmp_path, MINIMAL + "sampling: {prompt_logprobs: 1, seed: 0}\n").sampling.prompt_logprobs == 1


def test_prompt_logprobs_are_a_job_setting_and_max_tokens_0_needs_them(tmp_path):
    """A generate job's rows get a prompt_logprobs column with them; max_tokens 0 (no token drawn) is scoring only."""
    assert load(tmp_path, MINIMAL + "sampling: {prompt_logprobs: 2, max_tokens: 0}\n").sampling.prompt_logprobs == 2
    assert "max_tokens: 0 (no token drawn) is for scoring" in error_of(
        tmp_path, MINIMAL + "sampling: {max_tokens: 0}\n"
    )
    assert "would clash with result columns" in error_of(tmp_path, MINIMAL.replace("}", ", passthrough: [echo]}", 1))


def test_missing_sections_and_unclear_formats(tmp_path):
    assert "output: required" in error_of(tmp_path, "input: {path: a.parquet}\n")
    assert "cannot tell the format of 'a.csv'" in error_of(tmp_path, "input: {path: a.csv}\noutput: {path: o}\n")
    assert "not valid YAML" in error_of(tmp_path, "input: [\n")
    assert "must be a mapping" in error_of(tmp_path, "- a\n")
    assert "output.path: String should have at least 1 character" in error_of(
        tmp_path, "input: {path: a.parquet}\noutput: {path: ''}\n"
    )


def test_template_must_use_the_text_column_and_fit_the_input_kind(tmp_path):
    assert "must contain {text}" in error_of(tmp_path, MINIMAL + "prompt: {template: 'Say {title}'}\n")
    assert "{text:d}: format specs and conversions are not allowed" in error_of(
        tmp_path, MINIMAL + "prompt: {template: 'Say {text:d}'}\n"
    )
    both = MINIMAL.replace("docs.parquet}", "docs.parquet, messages_column: chat}")
    assert "not used with input.messages_column" in error_of(tmp_path, both + "prompt: {template: '{text}'}\n")
    openai = "input: {path: b.jsonl, format: openai-batch, text_column: body}\noutput: {path: o}\n"
    assert "text_column: not used with format 'openai-batch'" in error_of(tmp_path, openai)
    assert "needs input.format 'openai-batch'" in error_of(
        tmp_path, MINIMAL.replace("out}", "out, format: openai-batch}")
    )


def test_passthrough_columns_must_not_shadow_result_columns(tmp_path):
    text = MINIMAL.replace("docs.parquet}", "docs.parquet, passthrough: [title, error]}")
    assert "input: passthrough: error would clash with result columns" in error_of(tmp_path, text)


def test_set_overrides_are_parsed_as_yaml_and_validated(tmp_path):
    job = load(tmp_path, MINIMAL, ["engine.max_num_seqs=32", "sampling.stop=[END, STOP]", "prompt.system=Be brief"])
    assert job.engine.max_num_seqs == 32 and job.sampling.stop == ["END", "STOP"]
    assert job.prompt.system == "Be brief"
    message = error_of(tmp_path, MINIMAL, ["engine.block_size=big"])
    assert "engine.block_size:" in message and "[set on the command line]" in message
    assert "expected KEY=VALUE" in error_of(tmp_path, MINIMAL, ["engine.block_size"])
    assert "input.path is not a section" in error_of(tmp_path, MINIMAL, ["input.path.x=1"])


@pytest.mark.parametrize(
    "value,says",
    [
        ("[a, b", "not valid YAML: while parsing a flow sequence; expected ',' or ']', but got '<stream end>'"),
        ("@x", "not valid YAML: while scanning for the next token; found character '@' that cannot start any token"),
        ("*ref", "not valid YAML: found undefined alias 'ref'"),
        ("!!python/object:os.system x", "not valid YAML: could not determine a constructor for the tag"),
        ("{a: 1, a: 2}", "not valid YAML: duplicate key 'a'"),
        ("&a [*a]", "not usable YAML: an alias (*name) stands for a value that holds the alias itself"),
    ],
)
def test_a_set_value_that_is_not_yaml_is_a_job_file_error_in_one_line(tmp_path, value, says):
    """Each was a YAML traceback and exit 1."""
    message = error_of(tmp_path, MINIMAL, [f"sampling.stop={value}"])
    assert message.startswith(f"--set 'sampling.stop={value}': {says}") and "\n" not in message


# "Billion laughs": each line holds the one before nine times, so eight lines stand for 9**8 strings.
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 9)}]\n" for p, k in zip("abcdefg", "bcdefgh")
)


@pytest.mark.parametrize(
    "text,says",
    [
        (b"- a\n- b\n", "the job file must be a mapping of sections"),
        (b"hello\n", "the job file must be a mapping of sections"),
        (b"", "the job file must be a mapping of sections"),
        (b"# nothing but a comment\n", "the job file must be a mapping of sections"),
        (MINIMAL.encode() + b"model: \xff\xfe\n", f"not UTF-8 text (invalid start byte at byte {len(MINIMAL) + 7})"),
        (MINIMAL.encode() + b"model: " + b"[" * 5000 + b"]" * 5000 + b"\n", "not usable YAML: nested too deeply"),
        (MINIMAL.encode() + b"input: {path: other.parquet}\n", "not valid YAML: duplicate key 'input' (line 3"),
        (b"input: &i {path: docs.parquet, storage_options: {x: *i}}\noutput: {path: out}\n", "holds the alias"),
        ((LAUGHS + MINIMAL).encode(), "not usable YAML: its aliases (*name) expand it to more than 1,000,000 values"),
        (b"#" * (16 << 20) + b"\n", "larger than 16 MiB; not a job file"),
    ],
)
def test_a_job_file_that_is_not_a_usable_mapping_says_so_in_one_line(tmp_path, text, says):
    """Deep nesting was a RecursionError traceback; aliases that expand to billions of values, or hold themselves,
    went on into json.dumps (memory, or "Circular reference detected"); a second section replaced the first without
    a word; /dev/zero was read forever."""
    path = tmp_path / "job.yaml"
    path.write_bytes(text)
    with pytest.raises(JobFileError) as e:
        load_job(path)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value) and "\n" not in str(e.value)


def test_yaml_anchors_and_merge_keys_are_still_yaml(tmp_path):
    text = MINIMAL + "prompt: {system: &sys Be brief.}\n"
    text += "sampling: {<<: {max_tokens: 8, n: 2}, max_tokens: 9, stop: [*sys]}\n"
    job = load(tmp_path, text)  # a merged key may be written over: that is what a merge means
    assert (job.sampling.max_tokens, job.sampling.n, job.sampling.stop) == (9, 2, ["Be brief."])


def test_values_that_would_fail_after_the_model_loads_fail_at_load(tmp_path):
    """Each was exit 70 once the model had loaded: a KeyError, "Overflow when unpacking long long"."""
    text = MINIMAL.replace("docs.parquet}", "docs.parquet, passthrough: [title, text, title]}")
    assert "input: passthrough: title named more than once" in error_of(tmp_path, text)
    settings = [("seed", 10**26), ("num_threads", 10**20), ("max_num_seqs", 10**30), ("num_kv_blocks", 2**31)]
    for key, value in [(f"engine.{name}", value) for name, value in settings]:
        message = error_of(tmp_path, MINIMAL, [f"{key}={value}"])
        assert f"{key}: Input should be less than" in message and "[set on the command line]" in message
    assert load(tmp_path, MINIMAL, ["engine.seed=18446744073709551615"]).engine.seed == 2**64 - 1
    assert "model: String should have at least 1 character" in error_of(tmp_path, MINIMAL, ["model="])


@pytest.mark.parametrize(
    "text, where",
    [
        (MINIMAL + 'task: score\nscore: {labels: [" a", "\\ud800"]}\n', "score.labels.1"),
        (MINIMAL + 'prompt: {system: "Be brief.\\udfff"}\n', "prompt.system"),
        (MINIMAL + 'sampling: {stop: ["\\ud83d"]}\n', "sampling.stop.0"),
        (
            'input: {path: docs.parquet, storage_options: {"\\ud800": 1}}\noutput: {path: out}\n',
            "input.storage_options",
        ),
    ],
)
def test_a_lone_surrogate_in_a_job_file_is_a_job_file_error(tmp_path, text, where):
    """A YAML \\uD800-\\uDFFF escape alone is no text that a tokenizer or a writer takes: a label, a system text or a
    stop string holding one was exit 70 ("TextInputSequence must be str") once the model had loaded."""
    message = error_of(tmp_path, text)
    assert f": {where}: holds a lone surrogate" in message and "\n" not in message
    with pytest.raises(JobFileError, match="prompt.system: holds a lone surrogate"):  # the Python API's mapping too
        job_from_mapping({**yaml.safe_load(MINIMAL), "prompt": {"system": "\ud800"}})


def test_a_job_dumped_whole_loads_again_as_the_same_job(tmp_path):
    """A dump writes every section with its defaults (a generate job's `score` too): no key of it is a setting the
    job refuses."""
    for name in ("summarize.yaml", "structured.yaml", "score.yaml", "embed.yaml"):
        job = load_job(REPO / "jobs" / name)
        dumped = tmp_path / f"{name}.json"  # JSON is YAML
        dumped.write_text(job.model_dump_json())
        again = load_job(dumped)
        assert again == job, name
        # and its engine the same settings: an embedding job's Embedder its own budget, not the generate profile's
        config = EmbedderConfig if job.task == "embed" else EngineConfig
        assert config(**again.engine_settings()) == config(**job.engine_settings()), name
