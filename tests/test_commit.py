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
    assert [lease.owner for lease in live_leases(fs, directory)] == [first.owner, second.owner]
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
                                            r"'nightly' on host .*, pid \d+.* lock lapses in "
                                            r"\d+ s; spark.sparktrain.leaseSeconds=30\)"):
        with run_lock(store, "nightly", ttl=30):
            pass
    leave.set()
    holder.join()
    with run_lock(store, "nightly", ttl=30):  # free again: a later fit resumes the run
        pass


def _delay_first_lease_write(monkeypatch, thread_name):
    """Hold up ``thread_name``'s first lease write (after its Lease took its creation time and
    name, before the file can be seen) until the returned ``go`` is set; ``blocked`` is set
    while it waits."""
    import sparktrain.data.lease as lease_module

    real_put, done = lease_module.put_file, set()
    blocked, go = threading.Event(), threading.Event()

    def put_file(fs, path, data):
        if threading.current_thread().name == thread_name and not done:
            done.add(path)
            blocked.set()
            assert go.wait(10)
        return real_put(fs, path, data)

    monkeypatch.setattr(lease_module, "put_file", put_file)
    return blocked, go


def test_a_lease_written_late_under_an_earlier_name_does_not_come_first_too(fs_base, monkeypatch):
    # a loaded machine: "late" names its lease, then stalls before the file lands; "early"
    # takes its lease meanwhile, finds itself first and starts writing the dataset
    fs, base = fs_base
    directory = f"{base}/_leases"
    blocked, go = _delay_first_lease_write(monkeypatch, "late")
    taken = {}
    late_thread = threading.Thread(
        target=lambda: taken.setdefault("late", Lease.acquire(fs, directory, ttl=30)),
        name="late")
    late_thread.start()
    assert blocked.wait(10)
    early = Lease.acquire(fs, directory, ttl=30)
    try:
        assert early.first()
        go.set()
        late_thread.join(10)
        late = taken["late"]
        try:
            assert late.path < early.path  # its name sorts first: it was created first
            # ... yet the holder that already went ahead stays the only first one
            assert not late.first() and early.first()
            assert [lease.owner for lease in late.others()] == [early.owner]
        finally:
            late.release()
    finally:
        go.set()
        early.release()


def test_two_threads_materializing_one_key_commit_once(tmp_path, monkeypatch):
    # materialize()'s own lease/commit loop, with the Spark parts faked: thread A stalls inside
    # its first lease write while B takes its lease and writes; A must wait and reuse B's commit
    import sparktrain.data.materialize as materialize_module

    store = Store.create(str(tmp_path / "store"))
    blocked, go = _delay_first_lease_write(monkeypatch, "A")
    writers = []

    def fake_write(df, store, columns, validation, seed, variable_length, key, directory,
                   lease, start):
        writers.append(threading.current_thread().name)
        directory.fs.makedirs(f"{directory.attempt_path(lease.owner)}/split=train",
                              exist_ok=True)
        go.set()  # A's lease lands while B writes
        time.sleep(0.3)
        directory.commit(lease.owner, {"columns": [], "rows": {"train": 1, "val": 0}})
        return materialize_module.MaterializedDataset("root", [], {"train": 1}, key)

    monkeypatch.setattr(materialize_module, "plan_key", lambda *args, **kwargs: "k")
    monkeypatch.setattr(materialize_module, "lease_seconds", lambda spark: 30.0)
    monkeypatch.setattr(materialize_module, "_write", fake_write)
    monkeypatch.setattr(materialize_module, "_WAIT_POLL_SECONDS", 0.01)
    results, errors = {}, []

    def fit():
        try:
            frame = type("FakeFrame", (), {"sparkSession": None})()
            results[threading.current_thread().name] = materialize_module.materialize(
                frame, store, [])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    a = threading.Thread(target=fit, name="A")
    a.start()
    assert blocked.wait(10)
    b = threading.Thread(target=fit, name="B")
    b.start()
    for thread in (a, b):
        thread.join(20)
    go.set()
    assert not errors, errors
    assert writers == ["B"] and results["A"].reused and not results["B"].reused
    commits = store.fs.ls(f"{store.dataset_path('k')}/_commits", detail=False)
    assert len([c for c in commits if c.endswith(".json")]) == 1, commits


def test_removing_dead_leases_keeps_a_lease_taken_meanwhile(fs_base, monkeypatch):
    import sparktrain.data.lease as lease_module

    fs, base = fs_base
    directory = DatasetDirectory(fs, base)
    dead = f"{directory.leases}/00000000000000001-dead.json"
    put_file(fs, dead, json.dumps({"owner": "dead", "host": "elsewhere", "pid": 1,
                                   "created": 1.0, "expires": 2.0}).encode())
    real_read, taken = lease_module.read_json, []

    def read_json(fs_, path):  # another writer takes its lease while the dead one is read
        if not taken:
            taken.append(None)
            taken[0] = Lease.acquire(fs, directory.leases, ttl=30)
        return real_read(fs_, path)

    monkeypatch.setattr(lease_module, "read_json", read_json)
    directory._remove_dead_leases()
    monkeypatch.undo()
    try:
        assert not fs.exists(dead) and fs.exists(taken[0].path)
        assert [lease.owner for lease in live_leases(fs, directory.leases)] == [taken[0].owner]
    finally:
        taken[0].release()
