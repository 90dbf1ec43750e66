"""The driver dies (SIGKILL) mid-fit on a standalone cluster on loopback (executors in their
own Workers): every rank stops, no orphan keeps training, and a new driver fitting the same
run_id takes the run at once (the dead driver's lock lapses: same host, process gone) and
resumes from the last checkpoint.

Full tier: its one test, test_a_killed_driver_leaves_no_rank_and_its_run_resumes. Only it kills
a driver (its process and JVM) while ranks train on executors in other processes, so only it
catches ranks that train on without their driver or a run a new driver process cannot take.
The quick tier's lock test (test_commit.py) writes a dead pid into a lease, and its resumes
start after a driver that ended cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _driver(master: str, workdir, run_id: str, epochs: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    return subprocess.Popen([sys.executable, os.path.join(HERE, "support", "dying_driver.py"),
                             master, str(workdir), run_id, str(epochs)], cwd=os.path.dirname(HERE),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _quiet_for(path, seconds: float, limit: float) -> float:
    """Wait until ``path`` has not changed for ``seconds``; returns when it last changed."""
    deadline = time.time() + limit
    while time.time() < deadline:
        last = os.path.getmtime(path)
        if time.time() - last > seconds:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{path} still changes after {limit}s: a rank is still training")


@pytest.mark.full
def test_a_killed_driver_leaves_no_rank_and_its_run_resumes(standalone_cluster, tmp_path):
    """On the worker's shared cluster (two Workers, tests/support/servers.py)."""
    from sparktrain.data.store import Store
    from sparktrain.loop.checkpoint import Checkpoints

    checkpoints = Checkpoints(Store.create(str(tmp_path / "store")).run_path("orphaned"))
    cluster = standalone_cluster
    first = _driver(cluster.url, tmp_path, "orphaned", 40)
    deadline = time.time() + 240
    while (checkpoints.latest() is None or checkpoints.latest().epochs_done < 2) \
            and time.time() < deadline:
        assert first.poll() is None, first.stdout.read()[-3000:]
        time.sleep(0.3)
    os.killpg(first.pid, signal.SIGKILL)  # the driver, its JVM: the whole process group
    killed_at = time.time()
    first.wait()
    last_beat = _quiet_for(tmp_path / "beats", 5.0, limit=90.0)
    assert last_beat - killed_at < 60, "a rank trained on for a minute without its driver"
    done = checkpoints.latest().epochs_done
    started = time.time()
    second = _driver(cluster.url, tmp_path, "orphaned", done + 1)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-4000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert len(result["history"]) == done + 1
    attempts = checkpoints.latest().meta["attempts"]
    assert attempts[-1]["start_epoch"] == done  # resumed, not started over
    assert time.time() - started < 240
    print({"ranks_stopped_after_s": round(max(0.0, last_beat - killed_at), 1),
           "checkpoint_epochs": done})
