"""Progress output that cannot be written never stops a job: `batchjob run ... | head -1`, a closed stream."""

import io
import json
import subprocess
import sys

import pyarrow.parquet as pq

from batchjob.job.telemetry.progress import LogProgress
from tests.helpers import REPO, documents
from tests.test_cli import job_file


class BrokenPipe(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")


def test_a_write_that_fails_is_swallowed_once_and_later_lines_are_dropped():
    for stream in (BrokenPipe(), io.StringIO()):
        if not isinstance(stream, BrokenPipe):
            stream.close()  # ValueError: I/O operation on closed file
        progress = LogProgress(stream, interval=0)
        progress.message("first")
        progress.start(10, 0)
        progress.rows(3)
        progress.message("done")
        progress.close()
        assert progress.lost and getattr(stream, "writes", 1) == 1


def test_run_piped_into_head_commits_every_row_and_exits_0(tmp_path):
    """Seen: `batchjob run ... | head -1` stopped with exit 74 "Broken pipe" after 32 of 120 rows."""
    out = tmp_path / "out"
    # --restart says so before the model loads, so the reader is gone before any progress line: by construction
    args = ["run", job_file(tmp_path, out), "--restart", "--log-interval", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchjob.cli", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr  # not -13: nothing turned Python's ignored SIGPIPE back on
    assert b"--restart" in first and stderr == ""
    assert sorted(pq.read_table(out / "data").column("id").to_pylist()) == [d["id"] for d in documents(6)]
    assert (out / "_SUCCESS").exists()


def test_the_progress_line_and_its_json_show_the_rows_by_lora_adapter():
    """engine.lora: the base model's and the busiest adapters' rows, the rest counted; JSON lines carry them all."""
    adapters = {f"a{i}": {"rows": i, "failed": 0} for i in range(1, 7)}
    counts = {"base_model": {"rows": 5, "failed": 1}, "adapters": adapters}
    text, lines = io.StringIO(), io.StringIO()
    for stream, json_lines in ((text, False), (lines, True)):
        progress = LogProgress(stream, interval=0, json_lines=json_lines)
        progress.start(40, 0)
        progress.lora(counts)
        progress.rows(26)
    assert "| lora a6 6, base 5, a5 5, a4 4 (+3 more) |" in text.getvalue()
    assert json.loads(lines.getvalue().splitlines()[-1])["lora"] == counts
    plain = LogProgress(io.StringIO(), interval=0)
    plain.start(1, 0)
    plain.rows(1)
    assert "lora" not in plain.stream.getvalue()
