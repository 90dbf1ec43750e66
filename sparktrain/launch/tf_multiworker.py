"""The ``tensorflow`` backend: ``MultiWorkerMirroredStrategy`` across the barrier tasks.

TensorFlow's distributed runtime cannot be shut down and started again inside one process, and
Spark reuses its Python workers, so each barrier task trains in a child process of its own:

1. every task opens a free port and shares ``host:port`` through ``BarrierTaskContext.allGather``;
2. the list becomes ``TF_CONFIG`` (``{"cluster": {"worker": [...]}, "task": {"index": rank}}``);
3. the child (``python -m sparktrain.estimators.keras_worker DIR``) trains and writes its
   result (or its traceback) into ``DIR``; its output lines are relayed to the driver, progress
   events among them;
4. the child dies with its task (``PR_SET_PDEATHSIG``), and is killed if the task fails.

Example (executor side)::

    result = run_tf_worker(ctx, spec_dict, payload_bytes, use_gpu=False)
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, Optional

from sparktrain.estimators.keras_worker import USER_ERROR_FILE
from sparktrain.launch.barrier import RankContext
from sparktrain.launch.faults import mark_user_error
from sparktrain.launch.gpus import gpu_environment, rank_gpu

PROGRESS_PREFIX = "\x1esparktrain-progress "


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tf_config(workers: list, rank: int) -> str:
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": rank}})


def _noise(line: str, gpu: Any) -> bool:
    """TensorFlow start-up lines that say nothing to a user (and, on CPU ranks, CUDA probes)."""
    return line.startswith(("WARNING: All log messages before absl", "I0000 ")) or \
        (gpu is None and "cuInit" in line)


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_environment(config: str, gpu: Optional[str]) -> Dict[str, str]:
    """The environment of a TensorFlow child process: ``TF_CONFIG``, this task's GPU (or
    none), sparktrain importable as in this process."""
    env = dict(os.environ, TF_CONFIG=config, KERAS_BACKEND="tensorflow",
               TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.update(gpu_environment(gpu))
    return env


def run_tf_worker(ctx: RankContext, spec: Dict[str, Any], payload: bytes, use_gpu: bool) -> Any:
    """Run the Keras training child for this barrier task; return what it returned."""
    if spec.get("strategy") == "parameter_server":  # roles: ps, coordinator, workers
        from sparktrain.launch.tf_parameter_server import run_ps_task

        return run_ps_task(ctx, spec, payload, use_gpu)
    host = ctx.hosts[ctx.rank]
    workers = ctx.all_gather(f"{host}:{_free_port(host)}")
    return spawn_keras_worker(ctx.rank, ctx.world_size, tf_config(workers, ctx.rank),
                              dict(spec, attempt=ctx.attempt), payload,
                              rank_gpu(ctx.resources, use_gpu), ctx.progress)


def spawn_keras_worker(rank: int, world_size: int, config: str, spec: Dict[str, Any],
                       payload: bytes, gpu: Optional[str],
                       progress: Callable[..., None]) -> Any:
    """Train in ``python -m sparktrain.estimators.keras_worker`` with ``TF_CONFIG=config``;
    relay its output (progress events to ``progress``), raise with its traceback on failure."""
    workdir = tempfile.mkdtemp(prefix=f"sparktrain-tf-rank{rank}-")
    try:
        with open(os.path.join(workdir, "spec.json"), "w") as f:
            json.dump(dict(spec, rank=rank, world_size=world_size), f)
        with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
            f.write(payload)
        child = subprocess.Popen(
            [sys.executable, "-m", "sparktrain.estimators.keras_worker", workdir],
            env=child_environment(config, gpu),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        try:
            for line in child.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    progress(**json.loads(line[len(PROGRESS_PREFIX):]))
                elif not _noise(line, gpu):
                    sys.stdout.write(line)
            code = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        error = os.path.join(workdir, "error.txt")
        if code != 0:
            detail = open(error).read() if os.path.exists(error) else f"exit code {code}"
            failure = RuntimeError(f"the TensorFlow worker process of rank {rank} failed:\n"
                                   f"{detail}")
            user_error = os.path.join(workdir, USER_ERROR_FILE)
            if os.path.exists(user_error):
                raise mark_user_error(failure, open(user_error).read())
            raise failure
        with open(os.path.join(workdir, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class TensorFlowMultiWorker:
    """The registry's entry for ``backend="tensorflow"``: ``run(ctx, spec, payload, use_gpu)``."""

    name = "tensorflow"
    run = staticmethod(run_tf_worker)
