"""The input forms of image rows beyond one image a row: a list of images in input.image_column, a messages column
with OpenAI image_url parts, and OpenAI Batch chat lines with them, on a tiny random Idefics3. Each row's greedy fp32
output equals transformers' AutoModelForImageTextToText.generate on the prompt its processor (and chat template)
makes; text-only rows run beside image rows; the keys of dedupe, the results cache and the prefix cache cover every
image in order; bad images, URLs and parts fail their own rows; row text that spells `<image>` stays text."""

from __future__ import annotations

import base64
import json
import re
import socket
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from batchjob.job.cache.results_cache import open_cache
from batchjob.job.input.images import image_source
from batchjob.job.input.planner import job_planner
from batchjob.job.input.reader import InputSource
from batchjob.job.input.row_error import RowError
from batchjob.job.kv_pool import PrefixCacheModel
from batchjob.model.tokenizer import Tokenizer
from tests.helpers import make_job, write_jsonl, write_parquet
from tests.job.test_e2e import dataset
from tests.job.test_score_jobs import batchjob
from tests.vision.test_image_jobs import engine  # noqa: F401 (a fixture)
from tests.vision.tiny_idefics3 import image, png_bytes

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "max_model_len": 320, "block_size": 8}
SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
A, B, C = image(31, (40, 24)), image(32, (40, 24)), image(33, (9, 13))  # A and B: one size, the same tokens


@pytest.fixture(scope="module")
def oracle(idefics3):
    folder, hf = idefics3
    return hf, transformers.AutoProcessor.from_pretrained(folder), Tokenizer.from_folder(folder)


def hf_answer(oracle, prompt: str, images: list) -> tuple[int, str]:
    """(prompt tokens, greedy text) of transformers on `prompt` (its `<image>`s the images') as its processor reads
    it; the text decoded by the model's tokenizer, as a job's output is."""
    hf, processor, tokenizer = oracle
    inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=10**6)
    n = inputs["input_ids"].shape[1]
    return n, tokenizer.decode(out[0, n:].tolist())


def hf_chat(oracle, messages: list[dict]) -> str:
    """The processor's chat template over `messages` (content parts: text, and image for each image)."""
    return oracle[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def write_job(path: Path, data: Path, model: Path, **sections) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(data)},
        "sampling": SAMPLING,
        "engine": ENGINE,
        "output": {"path": str(path.parent / f"{path.stem}-out")},
    }
    for name, section in sections.items():
        job[name] = {**job.get(name, {}), **section} if isinstance(section, dict) else section
    path.write_text(yaml.safe_dump(job))
    return path


def run(job: Path) -> dict:
    result = batchjob("run", str(job))
    assert result.exit_code == 0, result.output
    return dataset(Path(yaml.safe_load(job.read_text())["output"]["path"]))


def assert_answers(got: dict, oracle, want: dict[str, tuple[str, list]]) -> None:
    for row_id, (prompt, images) in want.items():
        assert got[row_id]["error"] is None, (row_id, got[row_id]["error"])
        tokens, text = hf_answer(oracle, prompt, images)
        assert (got[row_id]["prompt_tokens"], got[row_id]["output"]) == (tokens, text), row_id


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def test_an_image_column_of_several_images_a_row_equals_transformers(idefics3, oracle, tmp_path):
    rows = [
        {"id": "one", "text": "One picture.", "image": [png_bytes(A)]},
        {"id": "three", "text": "Three pictures.", "image": [png_bytes(C), png_bytes(A), png_bytes(B)]},
        {"id": "bad-second", "text": "x", "image": [png_bytes(A), b"not an image"]},
        {"id": "empty", "text": "x", "image": []},
    ]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    # no image token in the template: a row's images all go before its text, in order
    plain = write_job(tmp_path / "plain.yaml", data, idefics3[0], input={"image_column": "image"})
    plain.write_text(plain.read_text().replace("engine:", "prompt: {chat_template: false}\nengine:"))
    got = run(plain)
    want = {"one": ("<image>One picture.", [A]), "three": ("<image><image><image>Three pictures.", [C, A, B])}
    assert_answers(got, oracle, want)
    assert "image[1]: unreadable image" in got["bad-second"]["error"]
    assert "missing image: image is an empty list" in got["empty"]["error"]

    # the template places each image, here through the processor's chat template (it reads content parts only); a
    # Parquet list column is of one type: these images are paths and URLs
    path = tmp_path / "c.png"
    C.save(path)
    rows = [
        {"id": "two", "text": "By URL.", "image": [path.as_uri(), str(path)]},
        {"id": "three", "text": "x", "image": [str(path)] * 3},
        {"id": "http", "text": "x", "image": ["https://example.invalid/cat.png", str(path)]},
    ]
    data = write_parquet(tmp_path / "paths.parquet", rows)
    template = "First <image>, then <image>: {text}"
    chat = write_job(
        tmp_path / "chat.yaml", data, idefics3[0], input={"image_column": "image"}, prompt={"template": template}
    )
    got = run(chat)
    parts = [{"type": "text", "text": "First "}, {"type": "image"}, {"type": "text", "text": ", then "}]
    parts += [{"type": "image"}, {"type": "text", "text": ": By URL."}]
    assert_answers(got, oracle, {"two": (hf_chat(oracle, [{"role": "user", "content": parts}]), [C, C])})
    assert "the prompt holds 2 image tokens <image>, not the 3 its images take" in got["three"]["error"]
    assert "image[0]: an https URL is fetched only with input.allow_urls: true" in got["http"]["error"]


def messages_rows(tmp_path: Path) -> tuple[list[dict], dict[str, tuple[list[dict], list]]]:
    """Rows of chat messages with image parts in each form a row may give them, and what transformers reads for the
    rows that run: each row's messages with image parts as its chat template takes them, and its images."""
    path = tmp_path / "a.png"
    A.save(path)

    def img(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    hf_image = {"type": "image"}
    turns = [
        {"role": "user", "content": [img(data_url(A)), text("What is this?")]},
        {"role": "assistant", "content": [text("A picture.")]},
        {"role": "user", "content": [text("And this one"), img(str(path)), text("?")]},
    ]
    rows = {
        "data-url": [{"role": "user", "content": [text("Look:"), img(data_url(A)), text(" What is it?")]}],
        "path": [{"role": "user", "content": [text("Look:"), img(str(path)), text(" What is it?")]}],
        "file-url": [{"role": "user", "content": [text("Look:"), img(path.as_uri()), text(" What is it?")]}],
        "text-only": [{"role": "user", "content": "A plain question."}],
        "two-turns": turns,
        "b-then-c": [{"role": "user", "content": [img(data_url(B)), img(data_url(C)), text("Compare.")]}],
        "image-only": [{"role": "user", "content": [img(data_url(C))]}],
        # row text that spells the image token stays text: one image part, one image
        "literal": [{"role": "user", "content": [text("What is <image> here?"), img(data_url(C))]}],
        "literal-no-image": [{"role": "user", "content": "Just <image> as text."}],
        "http": [{"role": "user", "content": [img("http://example.invalid/cat.png"), text("x")]}],
        "bad-base64": [{"role": "user", "content": [img("data:image/png;base64,!!!"), text("x")]}],
        "not-an-image": [{"role": "user", "content": [img(data_url_of(b"plain text")), text("x")]}],
        "s3": [{"role": "user", "content": [img("s3://bucket/cat.png"), text("x")]}],
    }
    look = [{"role": "user", "content": [text("Look:"), hf_image, text(" What is it?")]}]
    hf_turns = [
        {"role": "user", "content": [hf_image, text("What is this?")]},
        {"role": "assistant", "content": [text("A picture.")]},
        {"role": "user", "content": [text("And this one"), hf_image, text("?")]},
    ]
    want = {
        "data-url": (look, [A]),
        "path": (look, [A]),
        "file-url": (look, [A]),
        "two-turns": (hf_turns, [A, A]),
        "b-then-c": ([{"role": "user", "content": [hf_image, hf_image, text("Compare.")]}], [B, C]),
        "image-only": ([{"role": "user", "content": [hf_image]}], [C]),
        "text-only": ([{"role": "user", "content": [text("A plain question.")]}], []),
    }
    return [{"id": k, "messages": v} for k, v in rows.items()], want


def data_url_of(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def check_message_rows(got: dict, oracle, want: dict) -> None:
    assert_answers(got, oracle, {k: (hf_chat(oracle, m), images) for k, (m, images) in want.items()})
    # one picture by data URL, path or file URL: the same tokens, so no URL text reached the prompt
    assert got["data-url"]["output"] == got["path"]["output"] == got["file-url"]["output"]
    assert got["literal"]["error"] is None and got["literal-no-image"]["error"] is None
    assert "messages[0].content[0]: an http URL is fetched only with input.allow_urls: true" in got["http"]["error"]
    assert "the data URL's base64 does not decode" in got["bad-base64"]["error"]
    assert "messages[0].content[0]: unreadable image" in got["not-an-image"]["error"]
    assert "a s3: URL is not read" in got["s3"]["error"]


def test_a_messages_column_with_image_parts_equals_transformers(idefics3, oracle, tmp_path):
    rows, want = messages_rows(tmp_path)
    # Parquet holds a column of one type: every message's content as a list of parts
    for row in rows:
        for m in row["messages"]:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    job = write_job(tmp_path / "job.yaml", data, idefics3[0], input={"messages_column": "messages"})
    check_message_rows(run(job), oracle, want)
    plan = batchjob("plan", str(job), "--no-calibrate", "--json")
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.output)
    # data-url, path and file-url are one request (one text, one picture); b-then-c and two-turns hold two images
    assert report["duplicate_rows_computed_once"] == 2
    assert report["image_rows"] == 7 and report["images"] == 9


def test_openai_batch_chat_lines_with_image_parts_equal_transformers(idefics3, oracle, tmp_path):
    rows, want = messages_rows(tmp_path)
    lines = [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": row["messages"]},
        }
        for row in rows
    ]
    # a /v1/completions line beside them: a text prompt as it is
    body = {"model": "m", "prompt": "Once upon a time"}
    lines.append({"custom_id": "completion", "method": "POST", "url": "/v1/completions", "body": body})
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = write_job(tmp_path / "job.yaml", data, idefics3[0], input={"format": "openai-batch"})
    got = run(job)
    check_message_rows(got, oracle, want)
    assert_answers(got, oracle, {"completion": ("Once upon a time", [])})


def test_image_parts_under_the_ray_executor_fail_their_rows(idefics3, engine, tmp_path):  # noqa: F811
    """The Ray executor's workers read no images yet: on a vision-language model a row with an image part fails."""
    part = {"type": "image_url", "image_url": {"url": data_url(C)}}
    rows = [{"id": "a", "messages": [{"role": "user", "content": [part]}]}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    job = make_job(data, tmp_path / "out", model=str(idefics3[0]), input={"messages_column": "messages"})
    job = job.model_copy(update={"executor": "ray"})  # the executor's own settings are not what this is about
    failed: list = []
    works = list(job_planner(job, engine, lambda row, e: failed.append(e)).works(InputSource(job).rows()))
    assert works == [] and failed == ["messages[0].content[0] is an image: executor 'ray' reads no images yet"]


def test_image_parts_on_a_text_only_model_fail_their_rows_and_the_job_goes_on(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}]
    rows.append(
        {"id": "b", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]}
    )
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path / "job.yaml", data, "smollm2-135m-instruct", input={"messages_column": "messages"})
    result = batchjob("run", str(job))
    assert result.exit_code == 0, result.output  # rows failed, fail_on_row_errors off
    assert "Traceback" not in result.output
    out = dataset(tmp_path / "job-out")
    assert out["a"]["error"] is None and out["a"]["output"]
    assert out["b"]["output"] is None
    assert out["b"]["error"].startswith("messages[0].content[0] is an image, and model smollm2-135m-instruct takes no")


def test_every_image_keys_a_row_in_order(idefics3, engine, oracle, tmp_path):  # noqa: F811
    """Rows of one text and the same two pictures in two orders: two requests (dedupe), two results-cache keys, and
    prefix-cache blocks shared up to the first image that differs."""
    rows = [
        {"id": "ab", "text": "Same text.", "image": [png_bytes(A), png_bytes(B)]},
        {"id": "ba", "text": "Same text.", "image": [png_bytes(B), png_bytes(A)]},
        {"id": "ab-again", "text": "Same text.", "image": [png_bytes(A), png_bytes(B)]},
        {"id": "aa", "text": "Same text.", "image": [png_bytes(A), png_bytes(A)]},
    ]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    job = make_job(
        data,
        tmp_path / "out",
        model=str(idefics3[0]),
        input={"image_column": "image"},
        prompt={"chat_template": False},
        cache={"path": str(tmp_path / "cache")},
        sampling=SAMPLING,
    )
    failed: list = []
    works = list(job_planner(job, engine, lambda row, e: failed.append(e)).works(InputSource(job).rows()))
    assert not failed
    by_row = {row.id: w for w in works for row in w.rows}
    assert len(works) == 3 and by_row["ab"] is by_row["ab-again"]
    ab, ba, aa = by_row["ab"], by_row["ba"], by_row["aa"]
    assert ab.token_ids == ba.token_ids == aa.token_ids  # placeholders: only the digests tell them apart
    keys = open_cache(job, engine)
    assert len({keys.work_key(w) for w in (ab, ba, aa)}) == 3
    # prefix cache: "aa" after "ab" shares the blocks before B's first token, not the ones from it on
    model = PrefixCacheModel(1000, 8)
    model.hit_tokens(ab.token_ids, list(zip(ab.images.firsts, ab.images.digests)))
    second = ab.images.firsts[1]
    hits = model.hit_tokens(aa.token_ids, list(zip(aa.images.firsts, aa.images.digests)))
    assert second // 8 * 8 == hits
    # the requests the job streams carry the images in their order: each answers as transformers does
    outs = {o.request_id: o for o in engine.stream([ab.request, ba.request])}
    for work, images in ((ab, [A, B]), (ba, [B, A])):
        tokens, text = hf_answer(oracle, "<image><image>Same text.", images)
        assert (len(outs[work.request_id].prompt_token_ids), outs[work.request_id].text) == (tokens, text)
    assert outs[ab.request_id].text != outs[ba.request_id].text
    # the engine's prefix cache: "aa" after "ab" reads from the cache only the blocks before B's first image token
    (again,) = engine.stream([aa.request])
    assert 0 < again.num_cached_tokens <= second
    assert (len(again.prompt_token_ids), again.text) == hf_answer(oracle, "<image><image>Same text.", [A, A])


def test_image_sources_by_form(tmp_path):
    png = png_bytes(C)
    assert image_source(png, "x", False) == png
    assert image_source(data_url(C), "x", False) == png
    assert image_source((tmp_path / "a b.png").as_uri(), "x", False) == str(tmp_path / "a b.png")
    assert image_source("relative/a.png", "x", False) == "relative/a.png"
    assert image_source("a:b.png", "x", False) == "a:b.png"  # a colon, no URL
    # an unreachable URL with allow_urls: a closed port on this host, so no network is needed to fail it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RowError, match=f"^x: cannot fetch http://127.0.0.1:{port}/a.png"):
        image_source(f"http://127.0.0.1:{port}/a.png", "x", True)
    for bad, message in [
        ("https://example.invalid/a.png", "an https URL is fetched only with input.allow_urls: true"),
        ("data:text/plain;base64,AAAA", "a data URL must be data:image/...;base64,"),
        ("file://host/a.png", "a file:// URL names a local file"),
        ("ftp://h/a.png", "a ftp: URL is not read"),
        (3, "must be image bytes, a local path or a URL, got int"),
    ]:
        with pytest.raises(RowError, match=re.escape(message)):
            image_source(bad, "x", False)
