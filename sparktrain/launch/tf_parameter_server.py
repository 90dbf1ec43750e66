"""The parameter-server strategy's launch on the ``tensorflow`` backend: roles, servers, shutdown.

Of the ``num_proc`` barrier tasks, rank 0 is the coordinator (TF's ``chief``), ranks
``1..num_ps`` are parameter servers and the rest are workers
(:class:`sparktrain.strategies.keras_ps.ParameterServer`, whose ``run_task`` calls
:func:`run_ps_task`). Every task trains (or serves) in a child process, as for
MultiWorkerMirroredStrategy (:mod:`.tf_multiworker`):

1. each task shares a free ``host:port`` (``allGather``); the list becomes ``TF_CONFIG`` with
   ``chief``, ``ps`` and ``worker`` jobs (:class:`~.tf_multiworker.TFTask`);
2. ps and worker tasks start their server child (``keras_loop`` with the spec's ``role``); a
   worker's child first writes its shard of the training data to local files
   (:func:`sparktrain.strategies.keras_ps.write_shard`); the task waits until it is serving;
3. a second ``allGather`` hands the shard files' descriptions to the coordinator, whose child
   runs sparktrain's Keras loop under ``ParameterServerStrategy``;
4. TensorFlow's servers never return from ``join()``, so a third ``allGather`` tells every task
   the coordinator is done, and each task SIGTERMs its own child. A server child that dies
   meanwhile (a lost worker or ps) fails its task, Spark re-runs the stage and the coordinator
   resumes from the last checkpoint. Children also die with their task (``PR_SET_PDEATHSIG``).

Example (executor side, what ``ParameterServer.run_task`` does)::

    result = run_ps_task(task)     # task: the TFTask tf_multiworker.run_tf_worker made
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any, List, Optional

from sparktrain.faults import mark_user_error
from sparktrain.launch.rank_context import RankContext
from sparktrain.launch.tf_multiworker import TFTask, start_tf_child
from sparktrain.launch.tf_protocol import (
    ERROR_FILE,
    READY,
    SHARD_INFO,
    USER_ERROR_FILE,
    write_inputs,
)
from sparktrain.options.spec import KerasTrainSpec

STOP_SECONDS = 10.0  # SIGTERM, then SIGKILL after this long


class _Server:
    """A ps or worker child process, its output in ``workdir/server.log``."""

    def __init__(self, role: str, config: str, spec: KerasTrainSpec, payload: bytes,
                 gpu: Optional[str]) -> None:
        self.role = role
        self.workdir = tempfile.mkdtemp(prefix=f"sparktrain-tf-{role}-")
        write_inputs(self.workdir, replace(spec, role=role), payload)
        self.log = open(os.path.join(self.workdir, "server.log"), "w")
        self.child = start_tf_child(self.workdir, config, gpu, self.log)

    def check(self) -> None:
        """Raise if the child has exited (a server never does on its own)."""
        code = self.child.poll()
        if code is None:
            return
        error = os.path.join(self.workdir, ERROR_FILE)
        if os.path.exists(error):
            failure = RuntimeError(f"the TensorFlow {self.role} process failed:\n"
                                   f"{open(error).read()}")
        else:  # killed: its output, then what happened (the line a summary shows)
            with open(os.path.join(self.workdir, "server.log")) as f:
                output = f.read()[-4000:]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            failure = RuntimeError(f"its output:\n{output}\nthe TensorFlow {self.role} "
                                   f"server process of this task stopped ({how})")
        user_error = os.path.join(self.workdir, USER_ERROR_FILE)
        if os.path.exists(user_error):
            raise mark_user_error(failure, open(user_error).read())
        raise failure

    def wait_ready(self) -> str:
        """Wait until the server is up; return its shard description (workers) or ``""``."""
        while not os.path.exists(os.path.join(self.workdir, READY)):
            self.check()
            time.sleep(0.1)
        info = os.path.join(self.workdir, SHARD_INFO)
        return open(info).read() if os.path.exists(info) else ""

    def stop(self) -> None:
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_for_coordinator(ctx: RankContext, server: _Server) -> None:
    """Join the coordinator's "done" ``allGather`` while watching the server child: if it dies
    first, raise (the stage fails and is retried) instead of waiting forever."""
    done = threading.Event()
    failed: List[BaseException] = []

    def gather() -> None:
        try:
            ctx.all_gather("")
        except BaseException as exc:  # the stage was cancelled (another task failed)
            failed.append(exc)
        done.set()

    threading.Thread(target=gather, daemon=True, name="sparktrain-ps-done").start()
    while not done.wait(0.2):
        server.check()
    if failed:
        raise failed[0]


def run_ps_task(task: TFTask) -> Any:
    """This barrier task's role in the parameter-server cluster; the coordinator's result
    (rank 0) or ``{}``."""
    ctx, (role, _) = task.ctx, task.role
    gpu = None if role == "ps" else task.gpu()
    if role != "chief":
        server = _Server(role, task.config, task.spec, task.payload, gpu)
        try:
            ctx.all_gather(server.wait_ready())
            _wait_for_coordinator(ctx, server)
        finally:
            server.stop()
        return {}
    shards = [json.loads(s) for s in ctx.all_gather("") if s]
    failure: Optional[BaseException] = None
    try:
        result = task.train(rank=0, world_size=1, gpu=gpu, launch_info={"shards": shards})
    except BaseException as exc:  # tell the servers to stop first, then fail
        failure = exc
    ctx.all_gather("done")
    if failure is not None:
        raise failure
    return result
