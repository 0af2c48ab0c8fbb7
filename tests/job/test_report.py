"""`batchjob report` on a job folder made by the runner with the fake engine: the charts as PNG files and one HTML
page that carries them inline."""

import base64
import re

from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job.exit_codes import EXIT_OK, EXIT_USAGE
from batchjob.job.run.runner import run_job
from tests.helpers import Messages, documents, fake_factory, make_job, write_jsonl

CHARTS = ["batch_size", "kv_cache_usage", "throughput", "latency", "lengths"]


def test_report_draws_a_run_folder_as_pngs_and_a_self_contained_html_page(tmp_path):
    rows = documents(30) + [{"id": "bad", "title": "t", "source": "s", "text": None}]
    out = tmp_path / "out"
    job = make_job(write_jsonl(tmp_path / "docs.jsonl", rows), out)
    assert run_job(job, Messages(), engine_factory=fake_factory(steps_per_output=5)) == EXIT_OK

    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    report = out / "report"
    assert result.output.split() == [str(report / f"{name}.png") for name in CHARTS] + [str(report / "report.html")]
    page = (report / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(i) for i in images] == [(report / f"{name}.png").read_bytes() for name in CHARTS]
    assert all(i.startswith(b"\x89PNG") for i in map(base64.b64decode, images))
    assert "31 of 31 done, 1 failed" in page and "Requests waited in" in page
    assert not re.search(r'(src|href)="(?!data:)|<script|<link', page)  # nothing to fetch: it works offline


def test_report_refuses_a_folder_that_is_not_a_job_output(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == EXIT_USAGE and "not a job's output folder" in result.output
