"""Jobs whose rows name LoRA adapters (engine.lora, input.lora_column) on the built-in model in float32, adapters made
by peft: each row's output is Engine.generate's through its adapter, base and unknown rows beside them; a kill and
resume keeps every row once with its own adapter's output; the results cache and the output folder key rows by the
adapter's content; an OpenAI Batch line's body.model picks the adapter; a bad adapter refuses the job in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.exit_codes import EXIT_ROW_ERRORS
from batchjob.job.output.state import OutputDir
from batchjob.job.run.executor import load_engine
from batchjob.job.run.runner import run_job
from batchjob.job.spec import load_job
from tests.helpers import Messages, peft_adapter, write_jsonl, write_parquet
from tests.job.test_e2e import dataset, run_killed
from tests.job.test_score_jobs import batchjob

pytest.importorskip("peft", reason="the LoRA tests build their adapters with peft (the test extra)")
pytestmark = pytest.mark.slow

ENGINE = {"dtype": "float32", "max_num_batched_tokens": 64, "max_model_len": 256, "kv_cache_memory_gb": 0.05}
SAMPLING = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
TEXTS = ["The capital of France is", "Three facts about owls:", "def fibonacci(n):", "Once upon a time"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(loaded, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(["alpha", "beta"]):
        peft_adapter(loaded, root / name, 7 + i, 8.0, r=8, lora_alpha=16, target_modules=TARGETS)
    return {"alpha": str(root / "alpha"), "beta": str(root / "beta")}


@pytest.fixture(scope="module")
def reference(adapters) -> dict[tuple[str, str | None], str]:
    """Each text's output through each adapter and the base model, from Engine.generate."""
    engine = Engine("smollm2-135m-instruct", **ENGINE, lora={"adapters": adapters})
    names = [None, "alpha", "beta"]
    prompts = [t for t in TEXTS for _ in names]
    loras = [n for _ in TEXTS for n in names]
    outs = engine.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False, lora=loras)
    return {(p, n): o.text for p, n, o in zip(prompts, loras, outs)}


def rows() -> list[dict]:
    """Every text through each adapter, the base model (null and empty) and an unknown adapter."""
    out = []
    for i, text in enumerate(TEXTS):
        for lora in ("alpha", "beta", None, "", "gamma"):
            out.append({"id": f"{i}-{lora}", "text": text, "lora": lora})
    return out


def write_job(path, data, out, adapters, **sections):
    job = {
        "input": {"path": str(data)},
        "prompt": {"chat_template": False},
        "sampling": SAMPLING,
        "engine": {**ENGINE, "lora": {"adapters": adapters}},
        "output": {"path": str(out), "checkpoint_rows": 2},
    } | sections
    path.write_text(yaml.safe_dump(job))
    return path


def check(got: dict, reference) -> None:
    for i, text in enumerate(TEXTS):
        for lora in ("alpha", "beta", None, ""):
            row = got[f"{i}-{lora}"]
            assert row["error"] is None, row
            assert row["output"] == reference[(text, lora or None)], (text, lora)
        unknown = got[f"{i}-gamma"]
        assert "unknown LoRA adapter 'gamma'" in unknown["error"] and "'alpha', 'beta'" in unknown["error"]


def status_lora(out) -> dict:
    result = batchjob("status", str(out), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["lora"]


def committed_by_adapter(got: dict) -> dict:
    """rows()' committed rows the model ran, by adapter (an id names its row's adapter; gamma's fail before it)."""
    counts = {}
    for row_id in got:
        lora = row_id.split("-", 1)[1]
        if lora != "gamma":
            name = lora if lora in ("alpha", "beta") else None  # "None" and "": the base model
            counts[name] = counts.get(name, 0) + 1
    adapters = {name: {"rows": counts[name], "failed": 0} for name in sorted(n for n in counts if n is not None)}
    return {"base_model": {"rows": counts.get(None, 0), "failed": 0}, "adapters": adapters}


def test_a_job_of_mixed_adapters_survives_a_kill_and_resumes_with_each_rows_adapter(tmp_path, adapters, reference):
    assert reference[(TEXTS[0], "alpha")] != reference[(TEXTS[0], None)] != reference[(TEXTS[0], "beta")]
    data = write_parquet(tmp_path / "rows.parquet", rows())
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", adapters, output={
        "path": str(tmp_path / "out"), "checkpoint_rows": 2, "checkpoint_seconds": 0.5,
    })  # fmt: skip
    out = OutputDir(tmp_path / "out")
    done = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill.log", out, "lora kill")
    assert 0 < done < len(rows())
    # `status` of the stopped run: the committed rows by adapter, as their ids name it
    assert status_lora(tmp_path / "out") == committed_by_adapter(dataset(tmp_path / "out"))
    resumed = batchjob("run", str(job))
    assert resumed.exit_code == 0, resumed.output
    got = dataset(tmp_path / "out")
    assert len(got) == len(rows())
    check(got, reference)
    # both runs' rows, where this_run.lora counts only the second's
    four = {"rows": 4, "failed": 0}
    whole = {"base_model": {"rows": 8, "failed": 0}, "adapters": {"alpha": four, "beta": four}}
    assert status_lora(tmp_path / "out") == whole == committed_by_adapter(got)
    assert "rows by LoRA adapter: base 8, alpha 4, beta 4" in batchjob("status", str(tmp_path / "out")).output
    meta = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert set(meta["fingerprint"]["lora"]) == {"alpha", "beta"}


def test_the_results_cache_keys_a_row_by_its_adapters_content(tmp_path, adapters, reference, loaded):
    data = write_jsonl(tmp_path / "rows.jsonl", rows()[:5])  # the first text: alpha, beta, base twice, unknown
    cache = {"path": str(tmp_path / "cache")}
    first = write_job(tmp_path / "a.yaml", data, tmp_path / "a", adapters, cache=cache)
    assert batchjob("run", str(first)).exit_code == 0
    # the rows the model ran, by adapter (the unknown name's row failed before it); null and "" are one base row
    one = {"rows": 1, "failed": 0}
    lora = json.loads((tmp_path / "a" / "_summary.json").read_text())["this_run"]["lora"]
    assert lora == {"base_model": {"rows": 2, "failed": 0}, "adapters": {"alpha": one, "beta": one}}
    again = write_job(tmp_path / "b.yaml", data, tmp_path / "b", adapters, cache=cache)
    assert batchjob("run", str(again)).exit_code == 0
    assert json.loads((tmp_path / "b" / "_summary.json").read_text())["cache"]["hits"] == 4
    # alpha's folder now holds other weights under the same name: its row is computed again, the others are hits
    changed = dict(adapters)
    changed["alpha"] = str(tmp_path / "alpha2")
    peft_adapter(loaded, tmp_path / "alpha2", 99, 8.0, r=8, lora_alpha=16, target_modules=TARGETS)
    third = write_job(tmp_path / "c.yaml", data, tmp_path / "c", changed, cache=cache)
    assert batchjob("run", str(third)).exit_code == 0
    assert json.loads((tmp_path / "c" / "_summary.json").read_text())["cache"] == {"hits": 3, "misses": 1}
    assert dataset(tmp_path / "c")["0-alpha"]["output"] != reference[(TEXTS[0], "alpha")]
    # the output folder of the first run refuses the changed adapter: its rows came from the other one
    shutil.copy(third, tmp_path / "d.yaml")
    moved = yaml.safe_load((tmp_path / "d.yaml").read_text())
    moved["output"]["path"] = str(tmp_path / "a")
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(moved))
    refused = batchjob("run", str(tmp_path / "d.yaml"))
    assert refused.exit_code == 2 and "lora changed" in refused.output


def test_an_openai_batch_line_names_its_adapter_in_body_model(tmp_path, adapters, reference):
    def line(i, model):
        body = {"model": model, "prompt": TEXTS[0], "max_tokens": 6, "temperature": 0.0}
        return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}

    data = write_jsonl(tmp_path / "batch.jsonl", [line(0, "alpha"), line(1, "smollm2-135m-instruct"), line(2, "gpt-9")])
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", adapters, input={
        "path": str(data), "format": "openai-batch",
    }, sampling={"ignore_eos": True})  # fmt: skip
    assert batchjob("run", str(job)).exit_code == 0
    got = dataset(tmp_path / "out")
    assert got["c0"]["output"] == reference[(TEXTS[0], "alpha")]
    assert got["c1"]["output"] == reference[(TEXTS[0], None)]
    assert "body.model: unknown LoRA adapter 'gpt-9'" in got["c2"]["error"]


def test_a_bad_adapter_refuses_the_job_in_one_line(tmp_path, adapters):
    data = write_parquet(tmp_path / "rows.parquet", rows()[:2])
    (tmp_path / "empty").mkdir()
    job = write_job(
        tmp_path / "job.yaml", data, tmp_path / "out", {"alpha": adapters["alpha"], "bad": str(tmp_path / "empty")}
    )
    result = batchjob("run", str(job))
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("error: LoRA adapter 'bad': no adapter_config.json")
    assert not (tmp_path / "out" / "data").exists() or not list((tmp_path / "out" / "data").iterdir())


def test_an_adapter_whose_files_change_mid_run_fails_its_remaining_rows_and_the_others_go_on(
    tmp_path, adapters, reference
):
    """max_loras 1, two rows at a time, rows in input order: alpha's first two, then beta's two (taking alpha's
    slot), then alpha's next two, which read alpha from its folder again. alpha's weights are replaced after the
    run's first step: the reload finds other content, and those two rows become error rows naming alpha and the
    change, while beta's rows and the base rows run on; the run finishes every row and exits 3 (fail_on_row_errors)."""
    folders = {name: str(shutil.copytree(adapters[name], tmp_path / name)) for name in ("alpha", "beta")}
    plan = [("alpha", 0), ("alpha", 1), ("beta", 0), ("beta", 1), ("alpha", 2), ("alpha", 3), (None, 0), (None, 1)]
    data = write_parquet(
        tmp_path / "rows.parquet", [{"id": f"{i}", "text": TEXTS[t], "lora": n} for i, (n, t) in enumerate(plan)]
    )
    engine = {**ENGINE, "max_num_seqs": 2, "lora": {"adapters": folders, "max_loras": 1}}
    path = write_job(
        tmp_path / "job.yaml", data, tmp_path / "out", folders,
        engine=engine, schedule={"sort_window": 1}, fail_on_row_errors=True,
    )  # fmt: skip
    swapped = []

    def engine_factory(job):
        engine = load_engine(job)

        def replace_alpha(metrics) -> None:  # a user overwriting the adapter while the job runs
            if not swapped:
                shutil.copyfile(tmp_path / "beta" / "adapter_model.safetensors", tmp_path / "new")
                (tmp_path / "new").replace(tmp_path / "alpha" / "adapter_model.safetensors")
                swapped.append(metrics.step)

        engine.add_step_callback(replace_alpha)
        return engine

    assert run_job(load_job(path), Messages(), engine_factory=engine_factory) == EXIT_ROW_ERRORS
    got = dataset(tmp_path / "out")
    assert len(got) == len(plan) and swapped
    for i, (name, t) in enumerate(plan):
        row = got[str(i)]
        if i in (4, 5):
            assert row["finish_reason"] == "error" and row["error"].startswith("LoRA adapter 'alpha': its files in "), (
                row
            )
            assert "changed during the run" in row["error"]
        else:
            assert row["error"] is None and row["output"] == reference[(TEXTS[t], name)], (i, row)
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert summary["rows_failed"] == 2
    assert summary["this_run"]["lora"] == {
        "base_model": {"rows": 2, "failed": 0},
        "adapters": {"alpha": {"rows": 4, "failed": 2}, "beta": {"rows": 2, "failed": 0}},
    }
    assert summary["lora"] == summary["this_run"]["lora"]  # one run: the whole job's count is this run's
    status = batchjob("status", str(tmp_path / "out")).output
    assert "rows by LoRA adapter: alpha 4 (2 failed), base 2, beta 2" in status


def test_a_mixed_adapter_job_on_ray_gives_each_row_its_adapters_output_and_counts_them(tmp_path, adapters, reference):
    """The Ray executor: each worker's engine holds the job's adapters; the driver sums the shards' rows by adapter
    into _summary.json as a local run counts them."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    data = write_parquet(tmp_path / "rows.parquet", rows())
    sections = {"executor": "ray", "ray": {"num_workers": 2, "shard_rows": 3}}
    job = write_job(tmp_path / "job.yaml", data, tmp_path / "out", adapters, **sections)
    ray.init(num_cpus=2, logging_level="WARNING")
    try:
        result = batchjob("run", str(job))
    finally:
        ray.shutdown()
    assert result.exit_code == 0, result.output
    check(dataset(tmp_path / "out"), reference)
    four = {"rows": 4, "failed": 0}
    whole = {"base_model": {"rows": 8, "failed": 0}, "adapters": {"alpha": four, "beta": four}}
    assert json.loads((tmp_path / "out" / "_summary.json").read_text())["this_run"]["lora"] == whole
    assert status_lora(tmp_path / "out") == whole  # the driver's parts record the workers' rows by adapter
