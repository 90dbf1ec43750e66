"""The dataset commit protocol and leases, without Spark: on a local disk and on fsspec's
in-memory filesystem (no atomic rename semantics to lean on, like an object store)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import fsspec
import pytest

from sparktrain.data.commit import DatasetDirectory
from sparktrain.data.lease import Lease, live_leases
from sparktrain.data.run_lock import RunInUseError, run_lock
from sparktrain.data.store import Store
from sparktrain.fs import put_file, read_json


@pytest.fixture(params=["local", "memory"])
def fs_base(request, tmp_path):
    if request.param == "local":
        yield fsspec.filesystem("file"), str(tmp_path / "ds")
        return
    fs = fsspec.filesystem("memory")
    base = f"/commit-test-{time.time_ns()}"
    yield fs, base
    if fs.exists(base):
        fs.rm(base, recursive=True)


def _write_attempt(directory: DatasetDirectory, attempt: str, rows: int) -> None:
    split = f"{directory.attempt_path(attempt)}/split=train"
    directory.fs.makedirs(split, exist_ok=True)
    directory.fs.pipe_file(f"{split}/part-0.parquet", b"x" * rows)


def test_uncommitted_attempts_are_never_read_and_are_collected(fs_base):
    fs, base = fs_base
    directory = DatasetDirectory(fs, base)
    _write_attempt(directory, "crashed", 3)  # a writer died before committing
    assert directory.committed() is None
    lease = Lease.acquire(fs, directory.leases, ttl=30)
    _write_attempt(directory, lease.owner, 10)
    assert directory.collect_garbage() == ["crashed"]  # the live writer's attempt stays
    assert fs.exists(directory.attempt_path(lease.owner))
    directory.commit(lease.owner, {"rows": {"train": 10}})
    lease.release()
    found = directory.committed()
    assert found.attempt == lease.owner and found.meta == {"rows": {"train": 10}}
    assert directory.collect_garbage() == []  # committed: kept without a lease


def test_two_commits_readers_agree_on_the_earliest(fs_base):
    fs, base = fs_base
    directory = DatasetDirectory(fs, base)
    for attempt in ("first", "second"):
        _write_attempt(directory, attempt, 5)
        directory.commit(attempt, {"attempt": attempt})
        time.sleep(0.002)
    assert directory.committed().attempt == "first"
    assert directory.collect_garbage() == []  # both committed: a reader may use either
    directory.remove_attempt("first")  # e.g. removed by hand: the next commit is followed
    assert directory.committed().attempt == "second"


def test_half_written_commit_or_lease_files_are_ignored(fs_base):
    fs, base = fs_base
    directory = DatasetDirectory(fs, base)
    _write_attempt(directory, "a", 1)
    fs.makedirs(f"{base}/_commits", exist_ok=True)
    fs.pipe_file(f"{base}/_commits/0001-a.json", b'{"attempt": "a", "me')  # truncated
    fs.pipe_file(f"{base}/_commits/.0002-a.json.tmp", b'{"attempt": "a", "meta": {}}')
    assert directory.committed() is None
    fs.makedirs(directory.leases, exist_ok=True)
    fs.pipe_file(f"{directory.leases}/0001-x.json", b"{")
    assert live_leases(fs, directory.leases) == []


def test_lease_expires_renews_and_knows_dead_local_holders(tmp_path):
    fs = fsspec.filesystem("file")
    directory = str(tmp_path / "leases")
    first = Lease.acquire(fs, directory, ttl=0.4)
    time.sleep(0.2)
    second = Lease.acquire(fs, directory, ttl=0.4)
    assert first.first() and not second.first()
    time.sleep(0.6)  # renewed every ttl/4: both still live
    assert [l.owner for l in live_leases(fs, directory)] == [first.owner, second.owner]
    first._stop.set()  # the holder stops renewing (hung or dead): its lease expires
    first._thread.join()
    time.sleep(0.6)
    assert second.first()
    second.release()
    assert not fs.exists(second.path)
    # a lease of a process on this host that no longer exists is dead at once, whatever ttl
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)
    dead = json.loads(fs.cat_file(first.path))
    dead.update(pid=int(child.stdout), expires=time.time() + 3600)
    put_file(fs, first.path, json.dumps(dead).encode())
    assert read_json(fs, first.path)["pid"] == int(child.stdout)
    assert live_leases(fs, directory) == []


def test_run_lock_refuses_a_second_holder_until_released(tmp_path):
    store = Store.create(str(tmp_path))
    entered = threading.Event()
    leave = threading.Event()

    def hold():
        with run_lock(store, "nightly", ttl=30):
            entered.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(10)
    with pytest.raises(RunInUseError, match=r"run_id='nightly' is in use by a fit of run "
                                            r"'nightly' on host .*, pid \d+"):
        with run_lock(store, "nightly", ttl=30):
            pass
    leave.set()
    holder.join()
    with run_lock(store, "nightly", ttl=30):  # free again: a later fit resumes the run
        pass
