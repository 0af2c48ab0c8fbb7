import codecs
import hashlib
import json
import os
import resource

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchjob.job.output.digest
from batchjob.job.input.reader import InputError, InputSource
from batchjob.job.run.runner import run_job
from tests.helpers import SAMPLE_DATA, documents, fake_factory, make_job, write_jsonl, write_parquet


def source_for(path, tmp_path, **input_spec) -> InputSource:
    return InputSource(make_job(path, tmp_path / "out", input={"path": str(path), **input_spec}))


def test_parquet_is_read_in_batches_across_row_groups_with_passthrough_types(tmp_path):
    rows = [{**d, "score": i} for i, d in enumerate(documents(25))]
    source = source_for(
        write_parquet(tmp_path / "d.parquet", rows, row_group_size=10),
        tmp_path,
        passthrough=["title", "score"],
        batch_rows=4,
    )
    scan = source.scan()
    assert scan.total == 25 and scan.passthrough_schema.field("score").type == pa.int64()
    out = list(source.rows())
    assert [r.id for r in out] == [d["id"] for d in rows] and [r.index for r in out] == list(range(25))
    assert out[7].values == {"text": rows[7]["text"]} and out[7].passthrough == {"title": "title 7", "score": 7}
    assert all(r.error is None for r in out)


def test_a_glob_reads_every_file_in_name_order(tmp_path):
    write_parquet(tmp_path / "b.parquet", documents(3, start=3))
    write_parquet(tmp_path / "a.parquet", documents(3))
    source = source_for(tmp_path / "*.parquet", tmp_path)
    assert source.scan().total == 6
    assert [r.id for r in source.rows()] == [f"doc-{i:03d}" for i in range(6)]


def test_the_output_folder_is_never_input(tmp_path):
    d = tmp_path / "D"
    (d / "a").mkdir(parents=True)
    (d / "summaries" / "data").mkdir(parents=True)
    mine = write_parquet(d / "a" / "docs.parquet", documents(3))
    # What a run leaves in its output folder, and a user's file put there: none of them is the job's input.
    for path in [d / "summaries" / "_timeline.parquet", d / "summaries" / "data" / "part-0.parquet"]:
        write_parquet(path, documents(2, start=10))
    for out in [d / "summaries", f"{d}/a/../summaries/", f"file://{d}/summaries"]:
        job = make_job(f"{d}/**/*.parquet", out)
        assert InputSource(job).files == [str(mine)]
    # A glob that matches only files in the output folder, or a file named inside it, is refused in one line.
    job = make_job(f"{d}/summaries/*.parquet", d / "summaries")
    with pytest.raises(InputError, match=r"no file matches .*summaries/\*.parquet' outside the output folder"):
        InputSource(job)
    job = make_job(d / "summaries" / "_timeline.parquet", d)
    with pytest.raises(InputError, match=f"{d}/summaries/_timeline.parquet is inside the output folder {d};"):
        InputSource(job)
    # input.path the output folder itself (its parts would be read as input on a rerun), however it is written
    for path in [d / "summaries", f"{d}/a/../summaries/"]:
        with pytest.raises(InputError, match=f"input.path: {path} is inside the output folder {d / 'summaries'};"):
            InputSource(make_job(path, d / "summaries", input={"format": "parquet"}))


def test_inputs_that_cannot_be_used_fail_before_any_work(tmp_path):
    with pytest.raises(InputError, match="cannot read .*broken.parquet as Parquet"):
        source_for(SAMPLE_DATA / "broken.parquet", tmp_path)
    with pytest.raises(InputError, match="no file matches"):
        source_for(tmp_path / "none-*.parquet", tmp_path)
    with pytest.raises(InputError, match="no column 'body'"):
        source_for(write_parquet(tmp_path / "d.parquet", documents(2)), tmp_path, text_column="body")
    with pytest.raises(InputError, match="not a readable file"):
        source_for(tmp_path / "missing.jsonl", tmp_path)


def test_duplicate_ids_are_refused_listing_some(tmp_path):
    rows = documents(4) + documents(2) + documents(1)
    source = source_for(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path)
    with pytest.raises(InputError, match=r"2 duplicate ids .* e.g. 'doc-000', 'doc-001'"):
        source.scan()


def test_bad_jsonl_lines_become_error_rows(tmp_path):
    source = source_for(SAMPLE_DATA / "bad_rows.jsonl", tmp_path, passthrough=["title"])
    assert source.scan().total == 11
    rows = {r.id: r for r in source.rows()}
    malformed = [r for r in rows.values() if r.id.endswith("bad_rows.jsonl:6")]
    assert malformed and malformed[0].error.startswith("malformed JSON on line 6")
    assert "not valid UTF-8" in rows["bad-invalid-utf8"].error
    assert rows["bad-ok-1"].error is None and rows["bad-ok-1"].values["text"]
    assert rows["bad-null-text"].values == {"text": None} and rows["bad-missing-text"].values == {"text": None}


def test_json_passthrough_columns_get_one_type(tmp_path):
    rows = [
        {"id": "a", "text": "x", "n": 1, "f": 1, "tags": ["p"], "s": "one"},
        {"id": "b", "text": "y", "n": 2, "f": 2.5, "tags": None, "s": 2},
    ]
    source = source_for(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path, passthrough=["n", "f", "tags", "s"])
    schema = source.scan().passthrough_schema
    types = [schema.field(c).type for c in ["n", "f", "tags", "s"]]
    assert types == [pa.int64(), pa.float64(), pa.string(), pa.string()]
    out = [r.passthrough for r in source.rows()]
    assert out == [{"n": 1, "f": 1.0, "tags": '["p"]', "s": "one"}, {"n": 2, "f": 2.5, "tags": None, "s": "2"}]


def test_an_unreadable_parquet_page_fails_only_its_rows(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist(documents(30)), path, row_group_size=10, compression="none", use_dictionary=False
    )
    meta = pq.ParquetFile(path).metadata
    text_chunk = meta.row_group(1).column(meta.schema.to_arrow_schema().get_field_index("text"))
    data = bytearray(path.read_bytes())
    data[text_chunk.data_page_offset : text_chunk.data_page_offset + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
    source = source_for(path, tmp_path)
    assert source.scan().total == 30
    rows = list(source.rows())
    assert [r.id for r in rows] == [d["id"] for d in documents(30)]
    assert all(r.error is None for r in rows[:10] + rows[20:])
    assert all(r.error.startswith("unreadable Parquet data") for r in rows[10:20])
    # A range, as a Ray worker reads its shard, gives the same rows (the broken row group included).
    for start, stop in [(0, 30), (8, 12), (12, 15), (19, 21), (25, 26), (3, 3)]:
        assert [(r.index, r.id, r.error) for r in source.rows_between(start, stop)] == [
            (r.index, r.id, r.error) for r in rows[start:stop]
        ]


def test_a_range_of_rows_across_files_row_groups_and_batches(tmp_path):
    write_parquet(tmp_path / "a.parquet", documents(11), row_group_size=4)
    write_parquet(tmp_path / "b.parquet", documents(9, start=11), row_group_size=5)
    source = source_for(tmp_path / "*.parquet", tmp_path, batch_rows=3)
    rows = list(source.rows())
    assert [r.index for r in rows] == list(range(20))
    for start in range(21):
        for stop in range(start, 21):
            got = list(source.rows_between(start, stop))
            assert [(r.index, r.id, r.values) for r in got] == [(r.index, r.id, r.values) for r in rows[start:stop]]


def test_non_utf8_parquet_text_fails_its_row(tmp_path):
    text = pa.array([b"fine", b"\xff\xfe bad"], pa.binary()).view(pa.string())  # a writer that skipped validation
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": text}), path)
    rows = list(source_for(path, tmp_path).rows())
    assert rows[0].values == {"text": "fine"} and rows[0].error is None
    assert rows[1].error == "column 'text' is not valid UTF-8"


def test_openai_batch_lines(tmp_path):
    lines = [
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "temperature": 0.5,
                "stop": "END",
            },
        },
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "once upon"}},
        {"custom_id": "c3", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        {"custom_id": "c4", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        {"custom_id": "c6", "method": "POST", "url": "/v1/responses", "body": {"input": "x"}},
    ]
    source = source_for(write_jsonl(tmp_path / "b.jsonl", lines), tmp_path, format="openai-batch")
    source.scan()
    rows = list(source.rows())
    assert rows[0].values == {"messages": [{"role": "user", "content": "hi"}]}
    assert rows[0].overrides == {"max_tokens": 5, "temperature": 0.5, "stop": ["END"]}
    assert rows[0].passthrough == {"url": "/v1/chat/completions"}
    assert rows[1].values == {"prompt": "once upon"} and rows[1].overrides == {}
    assert "method must be POST" in rows[2].error
    assert "url /v1/embeddings needs task: embed, and this job's task is generate" in rows[3].error
    assert "url must be /v1/chat/completions or /v1/completions, got '/v1/responses'" in rows[5].error
    assert "custom_id is missing" in rows[4].error and rows[4].id.endswith("b.jsonl:5")


def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_not_part_of_the_first_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", documents(2))
    path.write_bytes(codecs.BOM_UTF8 + path.read_bytes())
    source = source_for(path, tmp_path)
    source.scan()
    rows = list(source.rows())
    assert [r.id for r in rows] == ["doc-000", "doc-001"] and all(r.error is None for r in rows)


def test_json_integers_beyond_int64_keep_every_digit_as_text(tmp_path):
    big = 2**63
    rows = [{**d, "n": n, "m": 1} for d, n in zip(documents(2), [1, big], strict=True)]
    source = source_for(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path, passthrough=["n", "m"])
    schema = source.scan().passthrough_schema
    assert schema.field("n").type == pa.string() and schema.field("m").type == pa.int64()
    out = [r.passthrough for r in source.rows()]
    assert out == [{"n": "1", "m": 1}, {"n": str(big), "m": 1}]
    pa.Table.from_pylist(out, schema=schema)  # the part writer's conversion


def test_json_too_deep_or_with_a_huge_integer_fails_its_row_not_the_scan(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        json.dumps({"id": "a", "text": "fine"}),
        '{"id": "deep", "text": "x", "n": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"id": "huge", "text": "x", "n": ' + "9" * 5000 + "}",
        '{"id": NaN, "text": "x"}',
        json.dumps({"id": "b", "text": "fine"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    source = source_for(path, tmp_path, passthrough=["n"])
    assert source.scan().total == 5
    rows = list(source.rows())
    assert [r.error is None for r in rows] == [True, False, False, False, True]
    assert rows[1].id.endswith("d.jsonl:2") and rows[1].error.startswith("unusable JSON on line 2")
    assert rows[2].error.startswith("unusable JSON on line 3") and "digits" in rows[2].error
    assert rows[3].error == "line 4: id is missing, null, NaN or not a scalar"


def test_invalid_utf8_in_a_parquet_id_or_passthrough_column_fails_only_its_row(tmp_path):
    def bad(*values):
        return pa.array(values, pa.binary()).view(pa.string())  # a writer that skipped validation

    path = tmp_path / "d.parquet"
    bad_tags = pa.ListArray.from_arrays([0, 1, 2, 2, 3], bad(b"ok", b"\xff", b"ok"))
    table = pa.table(
        {
            "id": bad(b"a", b"\xc3(", b"c", b"d"),
            "text": ["t"] * 4,
            "title": bad(b"fine", b"fine", b"fine", b"\xfe"),
            "tags": bad_tags,
            "n": [1.0, 2.0, float("nan"), 4.0],
        }
    )
    pq.write_table(table, path, row_group_size=2)
    source = source_for(path, tmp_path, passthrough=["title", "tags"], batch_rows=3)
    assert source.scan().total == 4
    rows = list(source.rows())
    assert rows[0].id == "a" and rows[0].error is None and rows[0].passthrough == {"title": "fine", "tags": ["ok"]}
    assert rows[1].id.endswith("d.parquet#1") and rows[1].error == "column 'id' is not valid UTF-8"
    assert rows[2].error is None and rows[2].passthrough["tags"] == []
    assert rows[1].passthrough["tags"] is None
    assert rows[3].id == "d" and rows[3].error == "column 'title' is not valid UTF-8"


def test_nan_and_null_parquet_ids_fail_their_rows_under_distinct_ids(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [1.0, float("nan"), None, float("nan")], "text": ["t"] * 4}), path)
    source = source_for(path, tmp_path)
    assert source.scan().total == 4  # not refused as duplicates
    rows = list(source.rows())
    assert rows[0].id == "1.0" and rows[0].error is None
    assert [r.error for r in rows[1:]] == ["the id is null or NaN"] * 3 and len({r.id for r in rows}) == 4


def test_a_glob_of_more_parquet_files_than_the_open_file_limit_is_read(tmp_path):
    for i in range(40):
        write_parquet(tmp_path / f"p{i:02d}.parquet", documents(1, start=i))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        source = source_for(tmp_path / "*.parquet", tmp_path)
        assert source.scan().total == 40
        assert [r.id for r in source.rows()] == [f"doc-{i:03d}" for i in range(40)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_parquet_passthrough_types_are_widened_across_files_or_refused(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "text": ["t"], "n": pa.array([1], pa.int32())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "text": ["t"], "n": pa.array([2], pa.int64())}), tmp_path / "b.parquet")
    source = source_for(tmp_path / "*.parquet", tmp_path, passthrough=["n"])
    assert source.scan().passthrough_schema.field("n").type == pa.int64()
    pq.write_table(pa.table({"id": ["c"], "text": ["t"], "n": ["three"]}), tmp_path / "c.parquet")
    source = source_for(tmp_path / "*.parquet", tmp_path, passthrough=["n"])
    with pytest.raises(InputError, match="pass-through columns have types that do not fit together"):
        source.scan()


def test_a_json_lone_surrogate_fails_its_row_and_a_pair_is_text(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        r'{"id": "a", "text": "lone \udc00 here"}',
        r'{"id": "b\ud800", "text": "x"}',
        r'{"id": "c", "text": "pair \ud83d\ude00 and a backslash \\ud800"}',
    ]
    path.write_text("\n".join(lines) + "\n")
    source = source_for(path, tmp_path)
    assert source.scan().total == 3
    rows = list(source.rows())
    assert [r.error for r in rows[:2]] == [f"line {n}: a \\u escape makes a lone surrogate, not text" for n in (1, 2)]
    # the failed row keeps its line's id (an OpenAI Batch line its custom_id), its lone surrogate replaced as a bad
    # UTF-8 byte is: it was the file's name and line
    assert [r.id for r in rows] == ["a", "b\ufffd", "c"]
    assert rows[2].error is None and rows[2].values["text"] == "pair \U0001f600 and a backslash \\ud800"


def test_an_openai_batch_line_with_a_lone_surrogate_fails_under_its_custom_id(tmp_path, progress):
    lines = [
        r'{"custom_id": "s", "url": "/v1/completions", "body": {"prompt": "x \udc00", "max_tokens": 1}}',
        r'{"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}',
    ]
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job = make_job(path, tmp_path / "out", input={"format": "openai-batch"}, output={"format": "openai-batch"})
    assert run_job(job, progress, engine_factory=fake_factory()) == 0
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}
    assert out.keys() == {"s", "ok"} and out["ok"]["error"] is None
    assert out["s"]["error"]["message"] == "line 1: a \\u escape makes a lone surrogate, not text"


def test_the_input_identity_is_the_whole_content_remembered_by_size_mtime_ctime_and_inode(tmp_path, monkeypatch):
    monkeypatch.setattr(batchjob.job.output.digest, "cache_dir", lambda: tmp_path / "cache")
    rows = [{"id": f"r{i}", "text": "x" * 100} for i in range(3000)]  # well over 2 x 64 KiB
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    job = make_job(path, tmp_path / "out", input={"format": "jsonl"})
    source = InputSource(job)
    first = source.identity()[0]["sha256"]
    # Same size, mtime and inode: the remembered digest is used and the file is not read again.
    [memo] = (tmp_path / "cache" / "input-digests").iterdir()
    memo.write_text(memo.read_text().replace(first, "remembered"))
    assert source.identity()[0]["sha256"] == "remembered"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    mtime = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))  # a same-length edit in the middle, a second later
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert InputSource(job).identity()[0]["sha256"] not in (first, "remembered")  # the next run's source
    second = InputSource(job).identity()[0]["sha256"]
    data[len(data) // 3] ^= 1
    path.write_bytes(bytes(data))  # another same-length edit, its mtime put back (cp -p, rsync -a --inplace)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert InputSource(job).identity()[0]["sha256"] not in (first, second, "remembered")


def test_a_cache_folder_that_cannot_hold_the_digest_memo_leaves_the_run_going(tmp_path, monkeypatch, caplog):
    """The memo only saves reading the input again: where it cannot be written (an unwritable BATCHJOB_CACHE; here a
    file where its folder should be, which even root cannot write into), the digest is computed and said once."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "input-digests").write_text("not a folder")
    monkeypatch.setattr(batchjob.job.output.digest, "cache_dir", lambda: tmp_path / "cache")
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "x"}])
    job = make_job(path, tmp_path / "out", input={"format": "jsonl"})
    digest = InputSource(job).identity()[0]["sha256"]
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "cannot remember the input's digest" in caplog.text
