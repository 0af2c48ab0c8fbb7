"""`batchjob bench --task image` on the tiny Idefics3 (not timed): the engine and transformers' generate at each batch
size run the same rows, are credited with the same tokens and give the same greedy tokens in fp32; its pictures are
drawn from the seed alone; options that do not apply are refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchjob import cli
from batchjob.bench.measure import Result
from batchjob.bench.vision.image_rows import SIZES, _counted, picture
from batchjob.job.exit_codes import EXIT_OK, EXIT_USAGE


def test_image_bench_credits_the_same_tokens_and_matches_transformers_greedy(idefics3, tmp_path):
    folder, _ = idefics3
    args = ["bench", "--task", "image", "--model", str(folder), "--dtype", "float32", "--rows", "5"]
    args += ["--output-len", "6", "--json", str(tmp_path / "image.json")]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads((tmp_path / "image.json").read_text())
    systems = {r["system"]: r for r in report["systems"]}
    # batch sizes 1, 4 and 16 capped at the 5 rows; a batch of 4 pads both text and images (the rows' pictures differ
    # in size, so in tiles), the last batch of 1 does not
    assert list(systems) == ["engine", "hf batch 1", "hf batch 4", "hf batch 5"]
    assert report["output_tokens"] == 30
    assert all(r["output_tokens"] == 30 and r["num_requests"] == 5 for r in systems.values())
    # the same prompts, image tokens included, through each system's processor call
    assert len({r["prompt_tokens"] for r in systems.values()}) == 1 and systems["engine"]["prompt_tokens"] > 5 * 20
    for name in ("hf batch 1", "hf batch 4", "hf batch 5"):
        assert report["agreement"][name] == {"equal": 5, "total": 5, "first_difference_at": []}, name
    best = report["hf_batches"]["best"]
    assert report["engine_ratio"]["hf"] == pytest.approx(systems[best]["wall"] / systems["engine"]["wall"])
    assert f"engine's output tokens/s: {report['engine_ratio']['hf']:.2f}x transformers' at its best batch" in (
        result.stdout
    )
    assert "30 output tokens in 5 rows, every system credited with these" in result.stdout


def test_pictures_are_drawn_from_the_seed_alone():
    first, again, other = picture(3), picture(3), picture(4)
    assert first.tobytes() == again.tobytes() and first.size == SIZES[3 % len(SIZES)]
    assert other.size == SIZES[0] and len(first.getcolors(1 << 16)) > 2  # shapes on a background, not one colour


def test_a_system_that_makes_other_tokens_than_the_workloads_stops_the_bench():
    result = Result("hf batch 4", 1.0, 10, 7, 2)
    result.outputs = {"0": [1, 2, 3, 4], "1": [1, 2, 3]}
    with pytest.raises(RuntimeError, match=r"hf batch 4 made \[3, 4\] tokens a row in 2 rows; the workload is 4"):
        _counted(result, 2, 4)
    result.outputs["1"].append(4)
    assert _counted(result, 2, 4) is result


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--job", "jobs/summarize.yaml"], "error: bench --task image: --job: not for image rows"),
        (["--input-len", "8", "--labels", "a,b"], "error: bench --task image: --input-len, --labels: not for image"),
        (["--systems", "engine,static"], "error: bench --task image: unknown systems ['static'] (expected engine, "),
    ],
)
def test_bench_task_image_refuses_what_does_not_apply(extra, message):
    result = CliRunner().invoke(cli.main, ["bench", "--task", "image", *extra])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.strip().startswith(message)


def test_bench_task_image_wants_a_vision_language_model():
    result = CliRunner().invoke(cli.main, ["bench", "--task", "image", "--model", "smollm2-135m-instruct"])
    assert result.exit_code == EXIT_USAGE
    assert "bench --task image: " in result.stderr and "is not a vision-language model" in result.stderr
