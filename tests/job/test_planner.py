from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.input.lora import RowLora
from batchjob.job.input.planner import Planner, job_planner
from batchjob.job.input.prompt import PromptBuilder
from batchjob.job.input.reader import InputSource, Row
from tests.fakes import FakeEngine, FakeTokenizer
from tests.helpers import make_job, write_jsonl

BLOCK = 16


def planner(tmp_path, errors, *, window=100, dedupe=True, params=None, **sections):
    params = params or SamplingParams(max_tokens=8)
    job = make_job(tmp_path / "in.jsonl", tmp_path / "out", **sections)
    return Planner(
        PromptBuilder(job, FakeTokenizer(), 10_000),
        params,
        sort_window=window,
        dedupe=dedupe,
        block_size=BLOCK,
        on_error=lambda row, error: errors.append((row.id, error)),
        lora=RowLora(job),
    )


def rows(texts) -> list[Row]:
    return [Row(i, f"r{i}", {"text": t}) for i, t in enumerate(texts)]


def test_shared_prefixes_run_together_and_lengths_are_binned(tmp_path):
    head_a, head_b = "A" * 20, "B" * 20  # each longer than a block
    texts = [
        head_a + "x" * 50,
        "short",
        head_b + "y",
        head_a + "z",
        "a much longer unshared text " * 4,
        head_b + "w" * 90,
        head_a + "q" * 5,
    ]
    works = list(planner(tmp_path, [], prompt={"chat_template": False}).works(rows(texts)))
    order = [w.rows[0].id for w in works]
    assert order[:3] == ["r3", "r6", "r0"]  # head A, shortest first
    assert order[3:5] == ["r2", "r5"]  # head B
    assert order[5:] == ["r1", "r4"]  # nothing shared: binned by length


def test_identical_deterministic_requests_are_computed_once(tmp_path):
    texts = ["same", "other", "same", "same"]
    works = list(planner(tmp_path, []).works(rows(texts)))
    by_text = {w.rows[0].values["text"]: [r.id for r in w.rows] for w in works}
    assert by_text == {"same": ["r0", "r2", "r3"], "other": ["r1"]}
    sampled = planner(tmp_path, [], params=SamplingParams(max_tokens=8, temperature=0.7))
    assert len(list(sampled.works(rows(texts)))) == 4
    seeded = planner(tmp_path, [], params=SamplingParams(max_tokens=8, temperature=0.7, seed=1))
    assert len(list(seeded.works(rows(texts)))) == 2
    assert len(list(planner(tmp_path, [], dedupe=False).works(rows(texts)))) == 4


def test_openai_lines_with_one_prompt_and_different_max_tokens_are_never_deduplicated(tmp_path):
    """Each line's own sampling settings are part of what makes two requests the same: identical lines are computed
    once, lines that differ only in max_tokens each get their own request with their own settings."""
    body = {"messages": [{"role": "user", "content": "the same words"}], "temperature": 0}
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "max_tokens": k}}
        for i, k in enumerate((3, 7, 3))
    ]
    job = make_job(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out", input={"format": "openai-batch"})
    errors = []
    plan = job_planner(job, FakeEngine(), lambda row, error: errors.append(error))
    source = InputSource(job)
    source.scan()
    works = list(plan.works(source.rows()))
    assert not errors and len({tuple(w.token_ids) for w in works}) == 1  # one prompt
    assert sorted(([r.id for r in w.rows], w.params.max_tokens) for w in works) == [(["c0", "c2"], 3), (["c1"], 7)]


def test_bad_rows_are_reported_and_skipped(tmp_path):
    errors = []
    input_rows = rows(["fine", None, "ok"])
    input_rows[2].error = "malformed JSON"
    works = list(planner(tmp_path, errors).works(input_rows))
    assert [w.rows[0].id for w in works] == ["r0"]
    assert errors == [("r1", "missing prompt: text is missing or null"), ("r2", "malformed JSON")]


def test_per_row_sampling_overrides_are_validated(tmp_path):
    errors = []
    good, bad = (
        Row(0, "g", {"text": "x"}, overrides={"max_tokens": 3}),
        Row(1, "b", {"text": "x"}, overrides={"temperature": -1}),
    )
    works = list(planner(tmp_path, errors).works([good, bad]))
    assert works[0].params.max_tokens == 3 and works[0].params.temperature == 0.0
    assert errors[0][0] == "b" and errors[0][1].startswith("temperature: Input should be greater than or equal")


def test_a_seed_torch_cannot_take_fails_its_row_up_front(tmp_path):
    errors = []
    seeds = [2**64 - 1, 2**64, -(2**63) - 1]
    input_rows = [Row(i, f"s{i}", {"text": "x"}, overrides={"seed": seed}) for i, seed in enumerate(seeds)]
    works = list(planner(tmp_path, errors).works(input_rows))
    assert [w.params.seed for w in works] == [2**64 - 1]
    assert [e[0] for e in errors] == ["s1", "s2"] and all(e[1].startswith("seed: Input should be") for e in errors)


@settings(max_examples=40, deadline=None)
@given(
    texts=st.lists(st.text(alphabet="ab ", min_size=1, max_size=40).filter(str.strip), max_size=60),
    window=st.integers(1, 12),
)
def test_ordering_stays_inside_its_window_and_loses_nothing(tmp_path_factory, texts, window):
    tmp_path = tmp_path_factory.mktemp("plan")
    works = list(planner(tmp_path, [], window=window).works(rows(texts)))
    emitted = [r.index for w in works for r in w.rows]
    assert sorted(emitted) == list(range(len(texts)))
    # Every row comes out with the rest of its window: windows never mix.
    windows_in_order = [i // window for w in works for i in [w.rows[0].index]]
    assert windows_in_order == sorted(windows_in_order)


def test_each_rows_adapter_is_its_lora_cell_and_a_bad_cell_fails_the_row_alone(tmp_path):
    """engine.lora: a row's `lora` cell names its adapter (null or empty: the base model); a name the job does not
    list, or a cell that is not text, fails that row with an error that says so, and the rows beside it run. Rows
    alike but for their adapter are two requests, not one."""
    errors = []
    lora = {"adapters": {"a": "folder-a", "b": "folder-b"}}
    p = planner(tmp_path, errors, engine={"lora": lora})
    texts = ["same text"] * 7
    cells = ["a", "b", None, "", "c", 7, "x" * 1_000_000]
    works = list(p.works([Row(i, f"r{i}", {"text": t, "lora": c}) for i, (t, c) in enumerate(zip(texts, cells))]))
    assert sorted((w.lora or "", sorted(r.id for r in w.rows)) for w in works) == [
        ("", ["r2", "r3"]),
        ("a", ["r0"]),
        ("b", ["r1"]),
    ]
    assert {w.request.lora for w in works} == {"a", "b", None}
    assert errors == [
        ("r4", "lora: unknown LoRA adapter 'c' (engine.lora.adapters names 'a', 'b')"),
        ("r5", "lora: a LoRA adapter's name is text, not int"),
        # a hostile cell is named in short: its error row does not carry a megabyte
        ("r6", f"lora: unknown LoRA adapter {'x' * 37 + '...'!r} (engine.lora.adapters names 'a', 'b')"),
    ]
