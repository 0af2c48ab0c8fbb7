"""`batchjob run` as a user sees it when something named goes wrong: one line, a documented exit code, no traceback;
and for anything else (a bug) the internal-error code with the traceback in a log file."""

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchjob import cli
from batchjob.job.exit_codes import EXIT_INTERNAL, EXIT_IO, EXIT_OK, EXIT_USAGE
from tests.helpers import REPO, documents, write_jsonl

ENGINE = {"max_num_seqs": 4, "kv_cache_memory_gb": 0.1, "max_model_len": 256}


def job_file(tmp_path, out, **sections):
    data = write_jsonl(tmp_path / "in.jsonl", documents(6))
    spec = {"input": {"path": str(data)}, "sampling": {"max_tokens": 4}, "engine": ENGINE, "output": {"path": str(out)}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**spec, **sections}))
    return str(path)


def run(*args: str, preexec_fn=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchjob.cli", "run", *args, "--log-interval", "60"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=preexec_fn,
        env=env,
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_a_missing_model_exits_2_in_one_line(tmp_path):
    result = run(job_file(tmp_path, tmp_path / "out", model=str(tmp_path / "no-model")))
    assert result.returncode == EXIT_USAGE and "not found" in one_line(result)


def test_a_device_setting_the_host_cannot_meet_exits_2_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a host without a CUDA device")
    result = run(job_file(tmp_path, tmp_path / "out", engine={**ENGINE, "device": "cuda"}))
    assert result.returncode == EXIT_USAGE and "torch sees no CUDA device" in one_line(result)


def test_settings_that_fail_once_the_model_is_loaded_exit_2_in_one_line(tmp_path):
    """Each was exit 70, "internal error", after the model had loaded."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it, not the tests
    if torch.cuda.is_available():
        cases = [(["--set", f"engine.num_kv_blocks={2**31 - 1}"], "the KV cache of 2,147,483,647 blocks")]
    else:
        cases = [
            (["--set", "engine.kv_cache_memory_gb=1e30"], "the KV cache of "),
            (["--set", "engine.ops_backend=triton"], "ops_backend: triton runs on a CPU only in Triton's"),
        ]
    for args, says in cases:
        result = run(job_file(tmp_path, tmp_path / "out"), *args, env=env)
        assert result.returncode == EXIT_USAGE and says in one_line(result), result.stderr


@pytest.mark.parametrize(
    "setting",
    [
        "sampling.stop=[a, b",
        "sampling.stop=@x",
        "sampling.stop=*ref",
        "sampling.stop=!!python/object:os.system echo",
        "input.passthrough=[text, text]",
        "engine.seed=99999999999999999999999999",
        "engine.num_threads=99999999999999999999",
        "engine=5",
        "engine.no_such_key.x=1",
        "x",
    ],
)
def test_a_bad_set_exits_2_naming_it(tmp_path, setting):
    """The first four were a YAML traceback and exit 1; the next three exit 70 once the model had loaded."""
    result = CliRunner().invoke(cli.main, ["run", job_file(tmp_path, tmp_path / "out"), "--set", setting])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Traceback" not in result.output and result.output.startswith("error: ")
    assert f"--set {setting!r}" in result.output or "[set on the command line]" in result.output
    assert not (tmp_path / "out").exists()


def test_no_home_folder_and_no_batchjob_cache_exits_2_saying_what_to_set(tmp_path, monkeypatch):
    """Path.home() raises where HOME is unset and the user id has no passwd entry (a container's --user)."""

    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    job = job_file(tmp_path, tmp_path / "out")
    monkeypatch.delenv("BATCHJOB_CACHE", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    result = CliRunner().invoke(cli.main, ["run", job])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output == "error: cannot find a cache folder: set BATCHJOB_CACHE (or HOME)\n"


def test_an_output_folder_that_cannot_be_created_exits_74_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = run(job_file(tmp_path, tmp_path / "a-file" / "out"))
    assert result.returncode == EXIT_IO and "cannot read or write a file" in one_line(result)


def test_a_full_disk_exits_74_and_a_rerun_completes_the_job(tmp_path):
    def small_files():  # files may not grow past 3 KB: writing a part fails as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))

    job = job_file(tmp_path, tmp_path / "out")
    result = run(job, preexec_fn=small_files)
    assert result.returncode == EXIT_IO and "File too large" in one_line(result)
    assert run(job).returncode == EXIT_OK
    assert sorted(pq.read_table(tmp_path / "out" / "data").column("id").to_pylist()) == [d["id"] for d in documents(6)]


def test_an_unexpected_exception_exits_70_naming_a_log_with_the_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something nobody planned for")

    monkeypatch.setattr(cli, "run_job", broken)
    result = CliRunner().invoke(cli.main, ["run", job_file(tmp_path, tmp_path / "out")])
    assert result.exit_code == EXIT_INTERNAL
    line = result.output.strip()
    assert line.startswith("error: internal error: RuntimeError: something nobody planned for (the traceback is in ")
    log = Path(line.rsplit(" ", 1)[-1].rstrip(")")).read_text()
    assert "Traceback" in log and "something nobody planned for" in log


def test_the_cli_starts_without_importing_torch():
    """`batchjob status` or a bad job file answers in a moment: torch (seconds to import) loads with the model only."""
    code = "import sys, batchjob.cli; print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi", "--model", "/no/such/model.gguf"],
        ["bench", "--model", "/no/such/model.gguf"],
        ["bench", "--job", "/no/such/job.yaml"],
        ["bench", "--quality", "--dtype", "float32"],  # --quality runs both dtypes itself
        ["report", str(REPO / "jobs")],  # a folder, but no job's output
        ["plan", "/no/such/job.yaml"],
    ],
)
def test_every_command_maps_a_users_mistake_to_exit_2_in_one_line(args):
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output


def test_every_command_is_registered_on_the_group():
    assert set(cli.main.commands) == {"run", "plan", "status", "generate", "bench", "report", "selftest"}


@pytest.mark.parametrize("restart", [True, False])
def test_a_folder_of_the_users_own_files_is_refused_with_exit_2_and_left_untouched(tmp_path, restart):
    """Seen: in a folder without _job.json, --restart deleted the user's output.jsonl and overwrote the rest; a plain
    run overwrote metrics.prom."""
    out = tmp_path / "out"
    out.mkdir()
    mine = {name: f"the user's {name}\n" for name in ("output.jsonl", "metrics.prom", "_summary.json")}
    mine["_timeline.parquet"] = "not batchjob's timeline\n"
    for name, text in mine.items():
        (out / name).write_text(text)
    result = run(job_file(tmp_path, out), *(["--restart"] if restart else []))
    assert result.returncode == EXIT_USAGE and "_job.json) do not name as its own" in one_line(result)
    assert "metrics.prom" in one_line(result)
    assert {name: (out / name).read_text() for name in mine} == mine
    assert not (out / "_job.json").exists() and not list(out.glob("data/*"))
