"""The ``tensorflow`` backend: a TensorFlow cluster across the barrier tasks.

TensorFlow's distributed runtime cannot be shut down and started again inside one process, and
Spark reuses its Python workers, so each barrier task trains in a child process of its own:

1. every task opens a free port and shares ``host:port`` through ``BarrierTaskContext.allGather``;
2. the list becomes ``TF_CONFIG``, with the jobs the Keras strategy gives the tasks
   (``KerasStrategy.roles``; MultiWorkerMirroredStrategy: ``{"cluster": {"worker": [...]},
   "task": {"type": "worker", "index": rank}}``);
3. the strategy runs the task (``KerasStrategy.run_task``, by default :meth:`TFTask.train`): the
   child (``python -m sparktrain.loop.keras_loop DIR``) trains and writes its result (or
   its traceback) into ``DIR`` (files: :mod:`.tf_protocol`); its output lines are relayed to the
   driver, progress events among them;
4. the child dies with its task (``PR_SET_PDEATHSIG``), and is killed if the task fails.

Example (executor side)::

    result = run_tf_worker(ctx, spec, payload_bytes, use_gpu=False, strategy=MultiWorkerMirrored)
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field, replace
from typing import IO, Any, Callable, Deque, Dict, List, Optional, Tuple, Union

from sparktrain.faults import killed_text, mark_user_error
from sparktrain.launch import zygote
from sparktrain.launch.engine import KerasEngine
from sparktrain.launch.gpus import gpu_environment, worker_gpus
from sparktrain.launch.rank_context import RankContext
from sparktrain.launch.tf_protocol import (
    ERROR_FILE,
    PROGRESS_PREFIX,
    RESULT_FILE,
    USER_ERROR_FILE,
    WORKER_MODULE,
    write_inputs,
)
from sparktrain.options.spec import KerasTrainSpec

# What the template imports: TensorFlow and Keras are ~9 CPU-s of a fresh worker's start.
TEMPLATE_PRELOAD = ("tensorflow", "keras", WORKER_MODULE)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tf_config(workers: list, rank: int) -> str:
    """``TF_CONFIG`` of worker ``rank`` in a cluster of ``workers`` only."""
    return cluster_config(workers, [("worker", i) for i in range(len(workers))], rank)


def cluster_config(addresses: List[str], roles: List[Tuple[str, int]], rank: int) -> str:
    """``TF_CONFIG`` of task ``rank``: each task's ``host:port`` (rank order) in the job its
    role names, at its index."""
    cluster: Dict[str, List[str]] = {}
    for address, (job, _index) in sorted(zip(addresses, roles, strict=True), key=lambda p: p[1]):
        cluster.setdefault(job, []).append(address)
    kind, index = roles[rank]
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def _noise(line: str, gpu: Any) -> bool:
    """TensorFlow start-up lines that say nothing to a user (and, on CPU ranks, CUDA probes)."""
    return line.startswith(("WARNING: All log messages before absl", "I0000 ")) or \
        (gpu is None and "cuInit" in line)


def child_environment(config: str, gpu: Optional[str]) -> Dict[str, str]:
    """The environment of a TensorFlow child process: ``TF_CONFIG``, this task's GPU (or
    none), sparktrain importable as in this process."""
    env = dict(os.environ, TF_CONFIG=config, KERAS_BACKEND="tensorflow",
               TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.update(gpu_environment(gpu))
    return env


def start_tf_child(workdir: str, config: str, gpu: Optional[str],
                   stdout: Union[int, IO[Any]]) -> Any:
    """Start :mod:`sparktrain.loop.keras_loop` on ``workdir`` with ``TF_CONFIG=config``, its
    output to ``stdout`` (``subprocess.PIPE``: text lines in ``child.stdout``). CPU ranks fork
    from a template that has TensorFlow imported (:mod:`.zygote`); GPU ranks, or where
    templates are off or fail to start, a fresh ``python -m``. Returns a ``Popen`` (or its
    template twin)."""
    env = child_environment(config, gpu)
    if gpu is None and zygote.enabled():
        try:
            return zygote.start_python(WORKER_MODULE, [workdir], env, TEMPLATE_PRELOAD, stdout)
        except OSError as exc:
            print(f"sparktrain: no TensorFlow fork template ({exc}); starting a fresh process",
                  file=sys.stderr, flush=True)
    return subprocess.Popen(
        [sys.executable, "-m", WORKER_MODULE, workdir], env=zygote.dying_with_me(env),
        stdout=stdout, stderr=subprocess.STDOUT, text=True, bufsize=1)


@dataclass
class TFTask:
    """One barrier task's place in the TensorFlow cluster, handed to ``KerasStrategy.run_task``."""

    ctx: RankContext
    role: Tuple[str, int]  # (TF job, index)
    config: str  # its TF_CONFIG
    spec: KerasTrainSpec
    payload: bytes = field(repr=False)
    use_gpu: bool = False

    def gpu(self) -> Optional[str]:
        """The GPUs Spark gave this task (when ``use_gpu``; ``"0,1"``: the worker uses them
        all), else ``None``."""
        return worker_gpus(self.ctx.resources, self.use_gpu)

    def train(self, rank: Optional[int] = None, world_size: Optional[int] = None,
              gpu: Any = "task", **spec_changes: Any) -> Any:
        """Run the training loop in a child process (as ``rank`` of ``world_size``, by default
        the task's); return its result. ``spec_changes``: fields of the spec to replace."""
        return spawn_keras_worker(self.ctx.rank if rank is None else rank,
                                  self.ctx.world_size if world_size is None else world_size,
                                  self.config, replace(self.spec, **spec_changes), self.payload,
                                  self.gpu() if gpu == "task" else gpu, self.ctx.progress)


def run_tf_worker(ctx: RankContext, spec: KerasTrainSpec, payload: bytes, use_gpu: bool,
                  strategy: type) -> Any:
    """Run this barrier task's part of the cluster the Keras ``strategy`` (a class) forms;
    return what it returned."""
    spec = replace(spec, attempt=ctx.attempt)
    # rows this task took (input_mode="stream"): kept for the child to read
    spooled, spec = (None, spec) if ctx.task_input is None else \
        ctx.task_input.for_child(spec, ctx.world_size, ctx.all_gather)
    chosen = strategy(spec)
    host = ctx.hosts[ctx.rank]
    addresses = ctx.all_gather(f"{host}:{_free_port(host)}")
    roles = chosen.roles(ctx.world_size)
    task = TFTask(ctx, roles[ctx.rank], cluster_config(addresses, roles, ctx.rank), spec,
                  payload, use_gpu)
    try:
        return chosen.run_task(task)
    finally:
        del spooled  # the spooled files go with it


def spawn_keras_worker(rank: int, world_size: int, config: str, spec: KerasTrainSpec,
                       payload: bytes, gpu: Optional[str],
                       progress: Callable[..., None]) -> Any:
    """Train in ``python -m sparktrain.loop.keras_loop`` with ``TF_CONFIG=config``;
    relay its output (progress events to ``progress``), raise with its traceback on failure."""
    workdir = tempfile.mkdtemp(prefix=f"sparktrain-tf-rank{rank}-")
    try:
        write_inputs(workdir, replace(spec, rank=rank, world_size=world_size), payload)
        child = start_tf_child(workdir, config, gpu, subprocess.PIPE)
        last: Deque[str] = deque(maxlen=20)  # its last lines, for the error if it is killed
        try:
            for line in child.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    progress(**json.loads(line[len(PROGRESS_PREFIX):]))
                elif not _noise(line, gpu):
                    sys.stdout.write(line)
                    last.append(line.rstrip("\n"))
            code = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        error = os.path.join(workdir, ERROR_FILE)
        if code < 0:  # a signal, e.g. the out-of-memory killer's SIGKILL: no traceback
            lines = "\n".join(f"  {line}" for line in last) or "  (none)"
            raise RuntimeError(f"its last lines:\n{lines}\n" + killed_text(
                f"the TensorFlow worker process of rank {rank}", -code))
        if code != 0:
            detail = open(error).read() if os.path.exists(error) else f"exit code {code}"
            failure = RuntimeError(f"the TensorFlow worker process of rank {rank} failed:\n"
                                   f"{detail}")
            user_error = os.path.join(workdir, USER_ERROR_FILE)
            if os.path.exists(user_error):
                raise mark_user_error(failure, open(user_error).read())
            raise failure
        with open(os.path.join(workdir, RESULT_FILE), "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class TensorFlowMultiWorker(KerasEngine):
    """The registry's entry for ``backend="tensorflow"``: every barrier task runs
    ``run(ctx, spec, payload, use_gpu, strategy)`` (:func:`run_tf_worker`), in the TensorFlow
    job the strategy gives it; streamed rows, elastic generations and Spark Connect work."""

    run = staticmethod(run_tf_worker)
