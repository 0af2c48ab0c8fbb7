import json
import os
import random
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.job.output.lease import LeaseLost
from batchjob.job.output.lock import LockHeld, OutputLock
from batchjob.job.output.schema import result_schema
from batchjob.job.output.state import JOB_FILE, LOCK, STAGED, OutputDir, StateError
from batchjob.job.output.storage import TMP_PREFIX, write_atomic
from batchjob.job.output.writer import PartWriter, sort_parts

PASSTHROUGH = pa.schema([("title", pa.string())])
SCHEMA = result_schema(PASSTHROUGH)


def record(i: int, error: str | None = None) -> dict:
    return {
        "id": f"r{i}",
        "output": f"out {i}",
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "output_tokens": 2,
        "cached_tokens": 0,
        "error": error,
        "row_index": i,
        "title": f"t{i}",
    }


def writer(folder, rows=3, seconds=3600.0, next_part=0) -> PartWriter:
    return PartWriter(folder, SCHEMA, checkpoint_rows=rows, checkpoint_seconds=seconds, next_part=next_part)


def test_parts_commit_every_n_rows_and_on_flush(tmp_path):
    w = writer(tmp_path)
    for i in range(7):
        w.add(record(i))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000000.parquet", "part-000001.parquet"]
    w.flush()
    table = pq.read_table(tmp_path)
    assert table.num_rows == 7 and table.schema.names[-1] == "title" and table.column("output")[6].as_py() == "out 6"
    assert not list(tmp_path.glob(".*"))


def test_parts_commit_after_checkpoint_seconds(tmp_path):
    w = writer(tmp_path, rows=1000, seconds=0.05)
    w.add(record(0))
    assert not list(tmp_path.iterdir())
    time.sleep(0.06)
    w.flush_if_due()
    assert [p.name for p in tmp_path.iterdir()] == ["part-000000.parquet"]


def committed_dir(tmp_path, records: list[dict], rows: int) -> OutputDir:
    """An output folder whose parts, of `rows` records each, hold `records`."""
    out = OutputDir(tmp_path)
    out.recover()
    w = writer(out.data, rows=rows)
    for r in records:
        w.add(r)
    w.flush()
    return out


def test_a_part_is_fsynced_whole_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """The order that makes a part whole or absent after a power cut: without the file's fsync first, the rename can
    reach the disk before the data (a part of the right name, empty or short); without the folder's after, the rename
    itself can be lost. Files are told apart by inode, as the temporary name differs from the part's."""
    real_fsync, real_replace, calls = os.fsync, os.replace, []

    def fsync(fd):
        st = os.fstat(fd)
        calls.append(("fsync", (st.st_dev, st.st_ino), st.st_size if stat.S_ISREG(st.st_mode) else None))
        real_fsync(fd)

    def replace(src, dst):
        st = os.stat(src)
        calls.append(("replace", (st.st_dev, st.st_ino), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    w = writer(tmp_path, rows=2)
    w.add(record(0))
    w.add(record(1))
    part = tmp_path / "part-000000.parquet"
    file, folder = ((s.st_dev, s.st_ino) for s in (part.stat(), tmp_path.stat()))
    # The file's fsync comes after all of its bytes were written (its size then is its final size).
    assert calls == [("fsync", file, part.stat().st_size), ("replace", file, part), ("fsync", folder, None)]


def test_a_failing_before_commit_writes_no_part(tmp_path):
    """The check before each commit (the lease still held, the input unchanged) stops the commit it refuses: no part,
    not even a temporary file, and the rows stay uncommitted."""
    refuse = []

    def before_commit():
        if refuse:
            raise LeaseLost("another run took over this run's lease")

    w = PartWriter(
        tmp_path, SCHEMA, checkpoint_rows=2, checkpoint_seconds=3600, next_part=0, before_commit=before_commit
    )
    w.add(record(0))
    w.add(record(1))
    refuse.append(True)
    w.add(record(2))
    with pytest.raises(LeaseLost):
        w.add(record(3))
    with pytest.raises(LeaseLost):
        w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000000.parquet"] and w.next_part == 1
    assert pq.read_table(tmp_path).column("id").to_pylist() == ["r0", "r1"]


def test_a_crash_while_writing_leaves_no_part_and_recover_cleans_up(tmp_path, monkeypatch):
    out = OutputDir(tmp_path)
    out.recover()
    w = writer(out.data, rows=2)

    def crash(src, dst):
        raise KeyboardInterrupt  # the process dies between fsync and rename

    monkeypatch.setattr(os, "replace", crash)
    w.add(record(0))
    with pytest.raises(KeyboardInterrupt):
        w.add(record(1))
    monkeypatch.undo()
    assert out.parts() == [] and not list(out.data.glob(".*.tmp"))  # the failed write cleaned up after itself
    # A kill leaves its temporary file: recover removes it, and not a user's file that merely looks alike.
    (out.data / f"{TMP_PREFIX}part-000000.parquet.1a2b.tmp").write_bytes(b"half")
    (tmp_path / ".notes.tmp").write_text("mine")
    out.recover()
    assert not list(out.data.glob(".*.tmp")) and out.committed().rows == 0
    assert (tmp_path / ".notes.tmp").read_text() == "mine"


def test_write_atomic_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "result.json").symlink_to(victim)
    write_atomic(tmp_path / "result.json", lambda f: f.write(b"new"))
    assert victim.read_text() == "precious" and not (tmp_path / "result.json").is_symlink()
    assert (tmp_path / "result.json").read_text() == "new"


def test_the_lock_is_never_opened_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    (out.path / LOCK).symlink_to(victim)
    with pytest.raises(StateError, match="not a regular file"):
        out.lock()
    with pytest.raises(OSError), OutputLock(out.path / LOCK):  # and the lock itself refuses, whatever the caller
        pass
    assert victim.read_text() == "precious"


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), rows_per_file=st.integers(1, 30), part_size=st.integers(1, 20), seed=st.integers())
def test_sorting_parts_gives_every_row_once_in_input_order(tmp_path_factory, n, rows_per_file, part_size, seed):
    tmp = tmp_path_factory.mktemp("sort")
    (tmp / "data").mkdir()
    (tmp / "staging").mkdir()
    order = list(range(n))
    random.Random(seed).shuffle(order)
    w = writer(tmp / "data", rows=part_size)
    for i in order:
        w.add(record(i))
    w.flush()
    sort_parts(sorted((tmp / "data").glob("*.parquet")), tmp / "staging", rows_per_file)
    files = sorted((tmp / "staging").glob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    assert all(t.num_rows <= rows_per_file for t in tables)
    assert [i for t in tables for i in t.column("row_index").to_pylist()] == list(range(n))


def test_staged_sorted_files_replace_the_parts_once_complete(tmp_path):
    out = OutputDir(tmp_path)
    out.recover()
    w = writer(out.data, rows=2)
    for i in (3, 1, 2, 0):
        w.add(record(i))
    out.staging.mkdir()
    sort_parts(out.parts(), out.staging, 10)
    out.recover()  # not marked complete: a killed finish, so the staging is dropped and the parts stay
    assert not out.staging.exists() and [p.name for p in out.parts()] == ["part-000000.parquet", "part-000001.parquet"]
    out.staging.mkdir()
    sort_parts(out.parts(), out.staging, 10)
    write_atomic(out.staging / STAGED, lambda f: None)
    out.recover()  # complete: the swap finishes, as it would after a kill in the middle of it
    assert [p.name for p in out.parts()] == ["sorted-000000.parquet"]
    assert pq.read_table(out.data).column("id").to_pylist() == ["r0", "r1", "r2", "r3"]


def test_parts_written_before_the_prompt_columns_sort_with_those_after(tmp_path):
    """An OpenAI Batch folder resumed by a batchjob with the prompt columns: its older parts lack them."""
    out = OutputDir(tmp_path)
    out.recover()
    writer(out.data, rows=1).add(record(1))
    w = PartWriter(
        out.data, result_schema(PASSTHROUGH, prompt=True), checkpoint_rows=1, checkpoint_seconds=3600, next_part=1
    )
    w.add({**record(0), "echo": "hi"})
    w.flush()
    out.staging.mkdir()
    sort_parts(out.parts(), out.staging, 10)
    table = pq.read_table(out.staging)
    assert table.column("id").to_pylist() == ["r0", "r1"] and table.column("echo").to_pylist() == ["hi", None]


def test_committed_rows_come_from_the_parts(tmp_path):
    out = committed_dir(tmp_path, [record(i, error="bad" if i == 4 else None) for i in range(5)], rows=2)
    done = out.committed()
    assert sorted(done.ids.to_pylist()) == [f"r{i}" for i in range(5)] and (done.rows, done.failed) == (5, 1)
    # Which input positions are done, by id (the input's ids are large_string, the parts' string).
    ids = pa.chunked_array([["r3", "new", "r0"], ["r9"]], pa.large_string())
    assert done.done_at(ids).tolist() == [True, False, True, False]
    assert (done.prompt_tokens, done.output_tokens) == (15, 10) and out.next_part_number() == 3


def test_a_second_holder_is_refused_and_named(tmp_path):
    out = OutputDir(tmp_path)
    with out.lock():
        with pytest.raises(LockHeld) as e, out.lock():
            pass
        assert e.value.holder["pid"] == os.getpid()
        assert f"pid {os.getpid()}" in str(e.value) and "started" in str(e.value)
        assert out.status()["state"] == "running"
    with out.lock():  # released on exit
        pass


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / LOCK).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "earlier"}))
    out = OutputDir(tmp_path)
    out.write_job({"fingerprint": {}, "rows_total": 3})
    assert out.status()["state"] == "stopped (killed; resumable)"
    with out.lock() as lock:
        assert lock.stale["pid"] == pid


def test_a_lock_file_discarded_between_open_and_flock_is_not_taken(tmp_path, monkeypatch):
    """A run that opened the lock file just before its holder discarded it must lock the file now at the path, or
    it and a run that made the new file would both hold the lock."""
    import fcntl

    import batchjob.job.output.lock as lock_module

    path = tmp_path / LOCK
    path.write_text("")
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:  # the holder discards the file and another run makes a new one in between
            path.unlink()
            path.write_text("")
        calls.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", flock)
    with OutputLock(path) as lock:
        assert os.path.samestat(os.fstat(lock.fd), os.stat(path)) and len(calls) == 2


def test_a_run_that_fails_before_its_first_record_leaves_no_folder_it_made(tmp_path):
    from batchjob.job.run.runner import run_job
    from tests.helpers import Messages, documents, make_job, write_parquet

    def no_model(job):
        raise StateError("the model does not load")

    data = write_parquet(tmp_path / "in.parquet", documents(3))
    for out in (tmp_path / "new" / "out", tmp_path / "mine"):
        if out.name == "mine":
            out.mkdir()
            (out / "notes.txt").write_text("the user's")
        with pytest.raises(StateError, match="does not load"):
            run_job(make_job(data, out), Messages(), engine_factory=no_model)
    assert not (tmp_path / "new").exists()  # nor the parent it made for it
    assert {p.name for p in (tmp_path / "mine").iterdir()} == {"notes.txt", "data", LOCK}  # a folder it found stays
    with OutputDir(tmp_path / "mine").lock():  # and its lock still works
        pass


def test_fingerprint_changes_are_refused_naming_what_changed(tmp_path):
    out = OutputDir(tmp_path)
    out.recover()
    fp = {"model": "m", "prompt": {"template": "a"}, "sampling": {"max_tokens": 8}}
    out.check_fingerprint(fp, keys=list(fp))  # a new folder: nothing to compare
    out.write_job({"fingerprint": fp, "created": "yesterday"})
    out.check_fingerprint(fp, keys=list(fp))
    changed = {**fp, "prompt": {"template": "b"}}
    with pytest.raises(StateError, match="different job \\(started yesterday\\): prompt changed.*--restart"):
        out.check_fingerprint(changed, keys=list(fp))
    (tmp_path / JOB_FILE).unlink()
    writer(out.data, rows=1).add(record(0))
    with pytest.raises(StateError, match="has result parts but no _job.json.*will not delete them"):
        out.check_fingerprint(fp, keys=list(fp))
    with pytest.raises(StateError, match="did not record them"):
        out.reset()
    assert out.parts()


def test_restart_deletes_only_what_batchjob_wrote_and_refuses_a_foreign_data_folder(tmp_path):
    out = OutputDir(tmp_path)
    out.recover()
    out.write_job({"fingerprint": {}, "created": "yesterday"})
    writer(out.data, rows=1).add(record(0))
    (out.data / "README").write_text("mine")
    pq.write_table(pa.table({"x": [1]}), out.data / "input.parquet")
    with pytest.raises(StateError, match="files batchjob did not write \\(README, input.parquet\\); nothing was"):
        out.reset()
    with pytest.raises(StateError, match="files batchjob did not write"):
        out.check_fingerprint({}, keys=[])
    assert {p.name for p in out.data.iterdir()} == {"README", "input.parquet", "part-000000.parquet"}
    (out.data / "README").unlink()
    (out.data / "input.parquet").unlink()
    (tmp_path / "notes.txt").write_text("mine too")  # beside data/, not in it: left alone
    out.reset()
    assert out.parts() == [] and out.read_job() is None and (tmp_path / "notes.txt").exists()


def test_a_truncated_part_is_quarantined_and_status_still_works(tmp_path):
    out = OutputDir(tmp_path)
    out.recover()
    out.write_job({"fingerprint": {}, "rows_total": 4})
    w = writer(out.data, rows=2)
    for i in range(4):
        w.add(record(i))
    damaged = out.parts()[1]
    damaged.write_bytes(damaged.read_bytes()[:100])  # a disk that lost the end of the file
    status = out.status()
    assert status["rows_done"] == 2 and "1 damaged part" in status["state"]
    moved = out.recover()
    assert [p.parent.name for p in moved] == ["_quarantine"] and moved[0].read_bytes()[:4] == b"PAR1"
    assert set(out.committed().ids.to_pylist()) == {"r0", "r1"} and out.next_part_number() == 1
    out.reset()  # --restart clears the quarantine too
    assert not (tmp_path / "_quarantine").exists()


def test_a_rerun_with_another_rows_per_file_leaves_no_stale_sorted_files(tmp_path):
    """Seen: killed after publishing, before _SUCCESS; rerun with another rows_per_file gave 75 rows, 40 unique."""
    out = committed_dir(tmp_path, [record(i) for i in range(40)], rows=7)
    for rows_per_file in (5, 8):
        out.staging.mkdir()
        sort_parts(out.parts(), out.staging, rows_per_file)
        out.stage_complete()
        out.publish_sorted()
    ids = pq.read_table(out.data).column("id").to_pylist()
    assert len(ids) == 40 and len(set(ids)) == 40 and len(out.parts()) == 5


def test_a_publish_killed_half_way_finishes_on_recover(tmp_path):
    out = committed_dir(tmp_path, [record(i) for i in range(10)], rows=3)
    out.staging.mkdir()
    sort_parts(out.parts(), out.staging, 4)
    out.stage_complete()
    for part in out.data.glob("part-*.parquet"):  # the kill came after the parts went and one file moved
        part.unlink()
    (out.staging / "sorted-000000.parquet").rename(out.data / "sorted-000000.parquet")
    out.recover()
    assert pq.read_table(out.data).column("id").to_pylist() == [f"r{i}" for i in range(10)]


def test_status_asks_the_lock_not_the_recorded_pid(tmp_path):
    out = OutputDir(tmp_path)
    out.write_job({"fingerprint": {}, "rows_total": 3})
    # The record names a live process (this one) but nobody holds the flock: a dead run whose pid was reused.
    (tmp_path / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "x"}))
    assert out.status()["state"] == "stopped (killed; resumable)"
    with out.lock():
        assert out.status()["state"] == "running"


@pytest.mark.parametrize(
    "text", ["", '{"fingerprint": {}', "[]", '"x"', '{"fingerprint": null}', '{"files": 3}', b"\xff\xfe{}"]
)
def test_a_job_json_that_batchjob_did_not_write_is_refused_and_nothing_is_cleaned_on_its_word(tmp_path, text):
    """Seen: [] or a non-object gave exit 70 (AttributeError); {"fingerprint": null} was taken as a job record."""
    out = OutputDir(tmp_path)
    out.recover()
    writer(out.data, rows=1).add(record(0))
    (tmp_path / JOB_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    for act in (out.reset, out.status, lambda: out.check_fingerprint({}, keys=[])):
        with pytest.raises(StateError, match="_job.json.*move it away or choose another output.path"):
            act()
    assert len(out.parts()) == 1


def test_restart_with_data_linked_to_another_disk_keeps_the_link_and_empties_it(tmp_path):
    """Seen: --restart deleted the parts, then failed on rmdir of the link (exit 74), and so on every retry."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "data").symlink_to(disk)
    out = OutputDir(tmp_path / "out")
    out.recover()
    out.write_job({"fingerprint": {}, "rows_total": 1, "files": []})
    writer(out.data, rows=1).add(record(0))
    out.reset()
    assert (tmp_path / "out" / "data").is_symlink() and list(disk.iterdir()) == []


@pytest.mark.parametrize("name", ["data", "_sorted", "_quarantine"])
def test_a_file_where_batchjob_keeps_a_folder_is_refused_and_kept(tmp_path, name):
    (tmp_path / name).write_text("the user's")
    with pytest.raises(StateError, match=f"{name} is not a folder"):
        OutputDir(tmp_path).recover()
    assert (tmp_path / name).read_text() == "the user's"


def test_a_lock_file_that_is_not_batchjobs_is_refused_and_kept(tmp_path):
    (tmp_path / LOCK).write_text("the user's own _lock notes")
    with pytest.raises(StateError, match="is not batchjob's lock file"):
        OutputDir(tmp_path).lock()
    assert (tmp_path / LOCK).read_text() == "the user's own _lock notes"
    (tmp_path / LOCK).write_text("")  # as a run leaves it when it ends
    with OutputDir(tmp_path).lock():
        pass


def test_a_finished_record_without_a_row_count_is_trusted_not_redone_forever(tmp_path):
    out = committed_dir(tmp_path, [record(i) for i in range(3)], rows=3)
    out.write_job({"fingerprint": {}})
    out.write_success({})
    assert out.complete(out.read_job()) and out.status()["state"] == "done"
    out.write_job({"fingerprint": {}, "rows_total": 4})
    assert not out.complete(out.read_job()) and out.status()["state"].startswith("incomplete (1 rows missing")


def test_each_part_counts_its_rows_by_lora_adapter_and_older_parts_count_as_unrecorded(tmp_path):
    """A part of a job with engine.lora records the rows the model ran, by adapter, in its metadata, split exactly
    where the part ends; rows that never reached the model are in no count; a part recording none (written before
    parts did) counts as unrecorded rows, not as the base model's."""
    out = OutputDir(tmp_path)
    out.recover()
    older = writer(out.data, rows=2)
    older.add(record(0), model_ran=True)
    older.add(record(1), model_ran=True)  # committed without a count, as a part of an older batchjob
    w = PartWriter(out.data, SCHEMA, checkpoint_rows=3, checkpoint_seconds=3600, next_part=1, count_lora=True)
    w.add(record(2), model_ran=True, lora="alpha")
    w.add(record(3, error="boom"), model_ran=True, lora="alpha")
    w.add(record(4, error="unknown LoRA adapter 'x'"))  # failed before the model
    w.add(record(5), model_ran=True)
    w.flush()
    committed = out.committed()
    assert committed.lora_unrecorded == 2 and committed.rows == 6
    assert committed.lora.counts() == {
        "base_model": {"rows": 1, "failed": 0},
        "adapters": {"alpha": {"rows": 2, "failed": 1}},
    }


@pytest.mark.parametrize(
    "key, value",
    [
        (b"batchjob.lora", b"[1, 2]"),
        (b"batchjob.lora", b'{"base_model": {"rows": "many"}, "adapters": {}}'),
        (b"batchjob.lora", b'{"adapters": {"a": null}}'),
        (b"batchjob.cache", b"[1]"),
        (b"batchjob.cache", b'{"hits": "x"}'),
    ],
)
def test_a_parts_damaged_counts_are_a_state_error_not_a_crash(tmp_path, key, value):
    """A part's metadata is read back, so untrusted: counts of another shape name the part (StateError, exit 2)."""
    out = OutputDir(tmp_path)
    out.recover()
    w = writer(out.data, rows=1)
    w.add(record(0))
    part = next(out.data.glob("part-*.parquet"))
    table = pq.read_table(part)
    pq.write_table(table.replace_schema_metadata({key: value}), part)
    with pytest.raises(StateError, match="cannot read the committed part"):
        out.committed()
