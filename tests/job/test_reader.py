import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.job.reader import InputError, InputSource
from tests.helpers import SAMPLE_DATA, documents, make_job, write_jsonl, write_parquet


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
    ]
    source = source_for(write_jsonl(tmp_path / "b.jsonl", lines), tmp_path, format="openai-batch")
    source.scan()
    rows = list(source.rows())
    assert rows[0].values == {"messages": [{"role": "user", "content": "hi"}]}
    assert rows[0].overrides == {"max_tokens": 5, "temperature": 0.5, "stop": ["END"]}
    assert rows[0].passthrough == {"url": "/v1/chat/completions"}
    assert rows[1].values == {"prompt": "once upon"} and rows[1].overrides == {}
    assert "method must be POST" in rows[2].error and "url must be" in rows[3].error
    assert "custom_id is missing" in rows[4].error and rows[4].id.endswith("b.jsonl:5")
