"""Retries only for faults: a bug in the user's code fails the fit on its first attempt; a lost
executor (and the errors it causes on the surviving ranks) is retried from the checkpoint.

Full tier: test_lost_executor_is_retried_and_resumes. Only it loses an executor JVM
(local-cluster, rank 1's executor SIGKILLed mid-epoch), so only it catches the surviving rank's
collective error taken for the user's bug, or a stage not re-run on a replacement executor from
the checkpoint. The quick tier runs in local mode's one JVM, where a kill ends a Python worker
only (test_fault_tolerance.py, test_concurrency.py)."""
from __future__ import annotations

import os
import textwrap
import time

import pytest

from sparktrain import TrainingError
from sparktrain.data.store import Store
from sparktrain.faults import is_fault, is_user_error, user_code
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import linear_estimator, run_reporting_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_user_code_marks_bugs_but_not_faults_seen_through_it():
    def raised(exc):
        try:
            with user_code("the loss"):
                raise exc
        except BaseException as caught:  # noqa: BLE001
            return caught

    assert is_user_error(raised(ValueError("shapes (4, 7) and (64, 32)")))
    assert is_user_error(raised(KeyError("label")))
    # a collective failing because a peer went away surfaces inside DDP's forward/backward
    for fault in (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                               "Connection closed by peer [127.0.0.1]:41234"),
                  ConnectionResetError("Connection reset by peer"),
                  type("DistBackendError", (RuntimeError,), {})("NCCL error in: ..."),
                  type("UnavailableError", (Exception,), {})("Collective ops is aborted by")):
        assert is_fault(fault)
        assert not is_user_error(raised(fault))
    # sparktrain's own code outside user_code: a fault (retried), e.g. a store read failing
    assert not is_user_error(OSError("No such file or directory"))
    # an error raised while handling the user's bug stays the user's
    try:
        try:
            with user_code("a callback"):
                raise ValueError("bug")
        except ValueError:  # no __cause__: found through __context__, as when implicit
            raise RuntimeError("cleanup failed") from None
    except RuntimeError as exc:
        assert is_user_error(exc)


class FailsAtEpoch:
    """A callback whose own bug surfaces at the end of epoch ``epoch`` (1-based)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs):
        if epoch + 1 == self.epoch:
            return logs["no such metric"]  # KeyError: a bug in the callback


def test_callback_error_fails_on_first_attempt(spark, regression_df, store):
    est = linear_estimator(store, run_id="callback-bug", epochs=4, batch_size=100,
                           callbacks=[FailsAtEpoch(2)], verbose=1)
    started = time.perf_counter()
    with pytest.raises(TrainingError, match="KeyError: 'no such metric'") as info:
        est.fit(regression_df.select("features", "label"))
    seconds = time.perf_counter() - started
    assert info.value.attempts == 1
    assert "callback FailsAtEpoch.on_epoch_end (user code): not retried" in str(info.value)
    assert 'return logs["no such metric"]' in info.value.remote_traceback
    # epoch 1's checkpoint is kept; no second attempt trained from it
    latest = Checkpoints(Store.create(store).run_path("callback-bug")).latest()
    assert latest.epochs_done == 1 and len(latest.meta["attempts"]) == 1
    print(f"the callback's error failed the fit in {seconds:.1f}s")  # 4 attempts, 30 s before
    spark.range(3).count()  # the session still works


KILL_EXECUTOR_SCRIPT = textwrap.dedent('''
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import psutil
    from support.helpers import linear_estimator
    from sparktrain import local_spark

    MARKER = {marker!r}

    def kill_my_executor(batch):
        """At rank 1's 15th batch (in epoch 2), SIGKILL its executor's JVM, once. From then on
        every batch takes 0.2 s: the whole fit trains in under a second otherwise, and the
        orphaned Python worker of the killed executor could finish it before the loss is seen."""
        import time
        from pyspark import BarrierTaskContext
        kill_my_executor.seen = getattr(kill_my_executor, "seen", 0) + 1
        if BarrierTaskContext.get().partitionId() == 1 and kill_my_executor.seen == 15 \\
                and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            for process in psutil.Process().parents():  # the executor's JVM, by its main class
                if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in process.cmdline():
                    process.kill()
                    break
        if os.path.exists(MARKER):
            time.sleep(0.2)
        return batch

    spark = local_spark("local-cluster[2,1,1024]", conf={{
        "spark.sparktrain.slotWaitSeconds": "60", "spark.stage.maxConsecutiveAttempts": "4",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "2s"}})
    import numpy as np
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y)],
                               ["features", "label"])
    est = linear_estimator({store!r}, run_id="lost-executor", epochs=3, batch_size=100,
                           transformation_fn=kill_my_executor, verbose=1)
    model = est.fit(df)
    from sparktrain.loop.checkpoint import Checkpoints
    from sparktrain.data.store import Store
    latest = Checkpoints(Store.create({store!r}).run_path("lost-executor")).latest()
    print("RESULT " + json.dumps({{"killed": os.path.exists(MARKER),
                                   "loss": model.getHistory()["loss"],
                                   "attempts": latest.meta["attempts"]}}))
    spark.stop()
''')


@pytest.mark.full
def test_lost_executor_is_retried_and_resumes(tmp_path):
    """local-cluster: rank 1's executor JVM is killed mid-epoch. Rank 0's collective then fails
    ("Connection closed by peer"): a fault, not the user's bug, so the stage is re-run on a
    replacement executor and resumes from the last checkpoint."""
    code = KILL_EXECUTOR_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                                       marker=str(tmp_path / "killed"),
                                       store=str(tmp_path / "store"))
    report, stderr = run_reporting_script(code, timeout=400)
    assert report["killed"], "the executor was not killed"
    assert len(report["loss"]) == 3 and report["loss"][-1] < report["loss"][0]
    attempts = [(a["attempt"], a["start_epoch"]) for a in report["attempts"]]
    # the killed JVM's Python worker may finish the epoch it is in before it notices
    assert attempts[0] == (0, 0) and len(attempts) >= 2 and attempts[-1][1] in (1, 2), attempts
    assert "not retried" not in stderr
