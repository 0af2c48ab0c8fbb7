"""Jobs whose rows carry an image (input.image_column) on a tiny random Idefics3 in float32, greedy: each row's output
is Engine.generate's for the same prompt and image; bad images (unreadable, truncated, null, a missing path, a
decompression bomb, too long with their tokens, a file rewritten after planning) fail their own rows while the rest
complete; rows of one text and different images are neither deduplicated nor served each other's results from the
results cache; a kill -9 and resume keeps each row once; a text-only model, and what image jobs do not read yet, refuse
the job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import PIL.Image
import pydantic
import pytest
import yaml

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.input.planner import job_planner, requests
from batchjob.job.input.reader import InputSource
from batchjob.job.output.state import OutputDir
from tests.helpers import make_job, write_parquet
from tests.job.test_e2e import dataset, run_killed
from tests.job.test_score_jobs import batchjob
from tests.vision.tiny_idefics3 import image, png_bytes

pytestmark = pytest.mark.slow

ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "max_model_len": 160, "block_size": 8}
SAMPLING = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
TEMPLATE = "User: what is in <image>? {text} Assistant:"
SIZES = [(40, 24), (20, 36), (9, 13), (30, 30), (24, 40), (13, 9)]


def write_job(path: Path, data: Path, out: Path, **sections) -> Path:
    job = {
        "model": str(sections.pop("model")),
        "input": {"path": str(data), "image_column": "image"},
        "prompt": {"chat_template": False, "template": TEMPLATE},
        "sampling": SAMPLING,
        "engine": ENGINE,
        "output": {"path": str(out), "checkpoint_rows": 2},
    } | sections
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def engine(idefics3) -> Engine:
    return Engine(str(idefics3[0]), **ENGINE)


def expected(engine: Engine, prompts: list[str], images: list) -> list[str]:
    outs = engine.generate(
        [{"prompt": p, "images": [i]} for p, i in zip(prompts, images)], SamplingParams(**SAMPLING), use_tqdm=False
    )
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.text for o in outs]


def test_image_rows_equal_engine_generate_and_bad_images_fail_alone(idefics3, engine, tmp_path):
    images = [image(i, size) for i, size in enumerate(SIZES)]
    good = [(f"g{i}", f"row {i}", png_bytes(img)) for i, img in enumerate(images)]
    # one text, two images of one size (the same placeholder tokens): two requests, each its own output
    same = [("s0", "Same text.", png_bytes(images[0])), ("s1", "Same text.", png_bytes(image(10, SIZES[0])))]
    whole = png_bytes(image(7, (40, 40)))
    bad = [
        ("not-an-image", "x", b"plain text, not an image"),
        ("truncated", "x", whole[: len(whole) // 2]),
        ("null", "x", None),
        # its text fits the context, its image's tokens do not (prompt.on_too_long cuts before they are known)
        ("too-long", "a " * 140, png_bytes(images[0])),
    ]
    rows = [{"id": i, "text": t, "image": b} for i, t, b in good + same + bad]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", model=idefics3[0])
    result = batchjob("run", str(job))
    assert result.exit_code == 0, result.output
    got = dataset(tmp_path / "out")
    assert len(got) == len(rows)
    ok = good + same
    want = expected(engine, [TEMPLATE.format(text=t) for _, t, _ in ok], [b for _, _, b in ok])
    for (row_id, _, _), text in zip(ok, want):
        assert got[row_id]["error"] is None and got[row_id]["output"] == text, row_id
    assert want[-2] != want[-1]  # the two images of one text answer differently: a shared result would show
    assert "unreadable image" in got["not-an-image"]["error"]
    assert "unreadable image" in got["truncated"]["error"]
    assert "missing image: image is missing or null" in got["null"]["error"]
    assert "too long for the model's context of 160" in got["too-long"]["error"]
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert summary["rows_failed"] == len(bad)
    plan = batchjob("plan", str(job), "--no-calibrate", "--json")
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.output)
    assert report["image_rows"] == len(ok) and report["duplicate_rows_computed_once"] == 0
    assert report["image_tokens_total"] > len(ok) * 16
    calibrated = batchjob("plan", str(job))  # the calibration's requests carry their images
    assert calibrated.exit_code == 0 and "rows with images" in calibrated.output, calibrated.output


def paths_input(tmp_path: Path, n: int) -> tuple[Path, list[Path]]:
    """A Parquet of `n` rows of one text, each with its own image file by path, and a row whose path is missing."""
    files = []
    for i in range(n):
        files.append(tmp_path / f"img{i}.png")
        image(20 + i, SIZES[i % len(SIZES)]).save(files[-1])
    rows = [{"id": f"p{i}", "text": "Same text.", "image": str(f)} for i, f in enumerate(files)]
    rows.append({"id": "missing", "text": "Same text.", "image": str(tmp_path / "nowhere.png")})
    return write_parquet(tmp_path / "paths.parquet", rows), files


def killable_job(idefics3, tmp_path: Path, n: int) -> tuple[Path, list[Path], OutputDir]:
    """A job over paths_input's `n` image rows that commits every 2 rows (or 0.2 s): its file, images and output."""
    data, files = paths_input(tmp_path, n)
    job = write_job(
        tmp_path / "job.yaml",
        data,
        tmp_path / "out",
        model=idefics3[0],
        prompt={"chat_template": False},  # no <image> in the template: the image goes before the text
        output={"path": str(tmp_path / "out"), "checkpoint_rows": 2, "checkpoint_seconds": 0.2},
    )
    return job, files, OutputDir(tmp_path / "out")


def test_a_kill_and_resume_keeps_each_image_row_once(idefics3, engine, tmp_path):
    job, files, out = killable_job(idefics3, tmp_path, 8)
    done = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill.log", out, "image kill")
    assert 0 < done < len(files) + 1
    resumed = batchjob("run", str(job))
    assert resumed.exit_code == 0, resumed.output
    got = dataset(tmp_path / "out")
    assert len(got) == len(files) + 1
    want = expected(engine, ["<image>Same text."] * len(files), [str(f) for f in files])
    for i, text in enumerate(want):
        assert got[f"p{i}"]["error"] is None and got[f"p{i}"]["output"] == text, i
    assert "unreadable image" in got["missing"]["error"] and "nowhere.png" in got["missing"]["error"]


def test_a_200_row_captioning_job_killed_twice_keeps_each_row_once(idefics3, engine, tmp_path):
    """200 generated pictures captioned, the run killed with SIGKILL twice (each time stopped right after its second
    commit, so the kill lands mid-run however fast the host), and resumed: every row once, each with its own
    picture's caption."""
    job, files, out = killable_job(idefics3, tmp_path, 200)
    first = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill1.log", out, "first kill")
    second = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill2.log", out, "second kill")
    assert 0 < first < second < len(files) + 1
    resumed = batchjob("run", str(job))
    assert resumed.exit_code == 0, resumed.output
    got = dataset(tmp_path / "out")  # an id written twice fails here
    assert len(got) == len(files) + 1
    want = expected(engine, ["<image>Same text."] * len(files), [str(f) for f in files])
    for i, text in enumerate(want):
        assert got[f"p{i}"]["error"] is None and got[f"p{i}"]["output"] == text, i
    assert "nowhere.png" in got["missing"]["error"]


def test_the_results_cache_keys_a_row_by_its_image(idefics3, engine, tmp_path):
    data, files = paths_input(tmp_path, 2)
    cache = {"path": str(tmp_path / "cache")}
    first = write_job(tmp_path / "a.yaml", data, tmp_path / "a", model=idefics3[0], cache=cache)
    assert batchjob("run", str(first)).exit_code == 0
    # the second image's file now holds the first's picture, the first's a new one: one hit, one miss
    files[1].write_bytes(files[0].read_bytes())
    image(99, SIZES[0]).save(files[0])
    again = write_job(tmp_path / "b.yaml", data, tmp_path / "b", model=idefics3[0], cache=cache)
    assert batchjob("run", str(again)).exit_code == 0
    assert json.loads((tmp_path / "b" / "_summary.json").read_text())["cache"] == {"hits": 1, "misses": 1}
    got = dataset(tmp_path / "b")
    want = expected(engine, [TEMPLATE.format(text="Same text.")] * 2, [str(f) for f in files])
    assert [got["p0"]["output"], got["p1"]["output"]] == want
    assert dataset(tmp_path / "a")["p0"]["output"] == want[1] != want[0]


def test_an_image_column_on_a_text_only_model_refuses_the_job(tmp_path):
    data = write_parquet(tmp_path / "rows.parquet", [{"id": "a", "text": "x", "image": b"\x89PNG"}])
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", model="smollm2-135m-instruct")
    result = batchjob("run", str(job))
    assert result.exit_code == 2, result.output
    assert "input.image_column: model smollm2-135m-instruct takes no images" in result.output


def test_an_image_over_pillows_decompression_bomb_limit_fails_its_row(idefics3, tmp_path, monkeypatch):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 200)  # Pillow refuses twice the limit: 9x13 passes, 40x40 not
    rows = [
        {"id": "small", "text": "x", "image": png_bytes(image(1, (9, 13)))},
        {"id": "bomb", "text": "x", "image": png_bytes(image(2, (40, 40)))},
    ]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", model=idefics3[0])
    assert batchjob("run", str(job)).exit_code == 0
    got = dataset(tmp_path / "out")
    assert got["small"]["error"] is None
    assert "DecompressionBombError" in got["bomb"]["error"]


def test_an_image_file_changed_after_planning_fails_its_row_when_streamed(idefics3, engine, tmp_path):
    data, files = paths_input(tmp_path, 2)
    job = make_job(data, tmp_path / "out", model=str(idefics3[0]), input={"image_column": "image"})
    failed: list[tuple[str, str]] = []
    works = list(
        job_planner(job, engine, lambda row, error: failed.append((row.id, error))).works(InputSource(job).rows())
    )
    assert sorted(w.rows[0].id for w in works) == ["p0", "p1"]
    assert [row_id for row_id, _ in failed] == ["missing"]
    image(50, SIZES[0]).save(files[0])  # another picture of the same size: the same tokens
    in_flight: dict = {}
    streamed = list(requests(works, in_flight, lambda row, error: failed.append((row.id, error))))
    assert [r.request_id for r in streamed] == [w.request_id for w in works if w.rows[0].id == "p1"]
    assert streamed[0].images is not None and streamed[0].images.pixel_values is not None
    assert failed[1][0] == "p0" and "image: it changed since its row was planned" in failed[1][1]


@pytest.mark.parametrize(
    ("sections", "refused"),
    [
        ({"task": "embed", "sampling": None}, "task 'embed'"),
        ({"input": {"messages_column": "messages"}, "prompt": {"template": None}}, "input.messages_column"),
        ({"executor": "ray"}, "executor 'ray'"),
        ({"input": {"image_column": "text"}}, "'text' is the row's text or id column"),
    ],
)
def test_what_an_image_job_does_not_read_yet_is_refused(tmp_path, sections, refused):
    sections = {**sections, "input": {"image_column": "image", **sections.get("input", {})}}
    with pytest.raises(pydantic.ValidationError, match=re.escape(refused)):
        make_job(tmp_path / "rows.parquet", tmp_path / "out", **sections)


def test_the_plan_shares_no_prefix_blocks_between_two_images_behind_one_text(idefics3, tmp_path):
    pair = [png_bytes(image(0, SIZES[0])), png_bytes(image(10, SIZES[0]))]  # one size: the same placeholder tokens
    rows = [{"id": f"r{i}", "text": "Same text.", "image": b} for i, b in enumerate(pair)]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    # no template: the image opens the prompt, so its digest keys the first block and every block after it (the
    # blocks before an image's first image token are shared, as the engine shares them)
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", model=idefics3[0], prompt={"chat_template": False})
    plan = batchjob("plan", str(job), "--no-calibrate", "--json")
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.output)["prefix_sharing_ratio"] == 0.0
