"""Several ranks in one Spark task: one process per GPU the task holds.

A barrier task given N GPUs (``spark.task.resource.gpu.amount=N``, or a ``resource_profile``
asking for N) runs N ranks. Each is a fresh Python process (``python -m
sparktrain.launch.local_ranks FILE``) that sees only its own GPU (``CUDA_VISIBLE_DEVICES``:
``cuda:0`` there) and gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``). Ranks are numbered task by task, so a task's ranks are consecutive and
share a host: Horovod's local ranks, NCCL's rings inside a machine. Each runs
:func:`~.rank_run.run_rank` as a one-rank task would: its lines, progress and traceback go to
the client through the store, and it joins the fit's one process group of all the GPUs of all
the tasks.

A fresh process, not a fork of the task's Python worker: CUDA cannot be used in a child forked
after the parent initialised it (CUDA's documentation; torch raises "Cannot re-initialize CUDA
in forked subprocess"), and a reused worker may have done so in an earlier task (prediction).

The task's process waits for its ranks; when one fails, it stops the others at once (they would
wait in a collective until its timeout) and fails the task with that rank's report, so Spark
retries the stage as it does for one-rank tasks. A child dies with the task's process
(``PR_SET_PDEATHSIG``): a cancelled or killed task leaves no rank behind.

The rows the task took (``input_mode="stream"`` without feeding) are dealt to its ranks by
their own source (:meth:`~sparktrain.data.sources.contract.TaskInput.for_local_ranks`).

Example (what the barrier stage's task runs when ``ranks_per_task > 1``)::

    for rank, result in run_local_ranks(task, where, 4):
        ...
"""
from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import cloudpickle

from sparktrain.data.sources.contract import TaskInput
from sparktrain.launch.gpus import gpu_environment, physical_gpus
from sparktrain.launch.rank_context import Place, RankContext
from sparktrain.launch.rank_run import FAILURE_TAG, run_rank
from sparktrain.launch.zygote import die_with_starter, dying_with_me

STOP_SECONDS = 10.0  # a failed rank's peers get this long to exit after SIGTERM


def places(barrier: Any, ranks_per_task: int) -> List[Place]:
    """The places of the ranks of the running barrier task (one per GPU it holds)."""
    infos = barrier.getTaskInfos()
    task_hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    resources = {name: list(info.addresses) for name, info in barrier.resources().items()}
    gpus = physical_gpus(resources.get("gpu", []))  # each rank's, as its process will see it
    if len(gpus) != ranks_per_task:
        raise RuntimeError(f"this task was planned for {ranks_per_task} ranks, one per GPU, "
                           f"but Spark gave it {len(gpus)} GPU(s): {gpus}")
    hosts = [host for host in task_hosts for _ in range(ranks_per_task)]
    first = barrier.partitionId() * ranks_per_task
    cpus = max(1, int(barrier.cpus()) // ranks_per_task)
    return [Place(first + local, len(hosts), hosts, cpus, {**resources, "gpu": [address]},
                  barrier.stageId(), local, ranks_per_task)
            for local, address in enumerate(gpus)]


def rank_environment(place: Place) -> Dict[str, str]:
    """A local rank's environment: its GPU only, and torchrun's variables."""
    return {**os.environ, **gpu_environment(place.resources.get("gpu")),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONUNBUFFERED": "1",
            "RANK": str(place.rank), "WORLD_SIZE": str(place.world_size),
            "LOCAL_RANK": str(place.local_rank), "LOCAL_WORLD_SIZE": str(place.local_size)}


def run_local_ranks(task: Callable[[RankContext], Any], where: Sequence[Any], ranks_per_task: int,
                    task_input: Optional[TaskInput] = None) -> List[Tuple[int, Any]]:
    """Run ``task`` as this barrier task's ``ranks_per_task`` ranks, one process each;
    ``[(rank, result)]``. ``task_input``: the rows the task took, dealt to its ranks.
    Raises the failing rank's tagged error (as :func:`~.rank_run.run_rank` does)."""
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    return run_places(task, where, places(barrier, ranks_per_task), task_input,
                      lambda text: list(barrier.allGather(text)))


def run_places(task: Callable[[RankContext], Any], where: Sequence, ranks: Sequence[Place],
               task_input: Optional[TaskInput] = None,
               all_gather: Optional[Callable[[str], List[str]]] = None
               ) -> List[Tuple[int, Any]]:
    """Run ``task`` in one process per place of ``ranks`` (:func:`run_local_ranks`; without
    Spark: ``bench/gpu_check.py``); ``all_gather``: between the tasks, to agree on the rows
    of ``task_input`` dealt to each rank."""
    with tempfile.TemporaryDirectory(prefix="sparktrain-local-ranks-") as folder:
        if task_input is not None:
            inputs = task_input.for_local_ranks(folder, len(ranks),
                                                all_gather or (lambda text: [text]))
            task = functools.partial(_with_input, task, inputs)
        children = [_start(task, where, place, folder) for place in ranks]
        try:
            failed = _wait(children)
        finally:
            _stop(children)
        if failed is not None:
            raise RuntimeError(_failure_text(failed, folder))
        return [(place.rank, _result(folder, place.rank)) for place in ranks]


def _with_input(task: Callable[[RankContext], Any], inputs: Sequence[TaskInput],
                ctx: RankContext) -> Any:
    ctx.task_input = inputs[ctx.local_rank]
    return task(ctx)


def _start(task: Callable[[RankContext], Any], where: Sequence, place: Place,
           folder: str) -> Tuple[Place, subprocess.Popen]:
    path = os.path.join(folder, f"rank-{place.rank}.task")
    with open(path, "wb") as out:
        cloudpickle.dump((task, tuple(where), place), out)
    child = subprocess.Popen(
        [sys.executable, "-m", "sparktrain.launch.local_ranks", path],
        env=dying_with_me(rank_environment(place)), stdin=subprocess.DEVNULL)
    return place, child


def _wait(children: List[Tuple[Place, subprocess.Popen]]) -> Optional[Tuple[Place, int]]:
    """Wait until every rank exits; the first to fail (its place and exit code), or ``None``."""
    running = list(children)
    while running:
        for place, child in list(running):
            code = child.poll()
            if code is None:
                continue
            running.remove((place, child))
            if code != 0:
                return place, code
        time.sleep(0.05)
    return None


def _stop(children: List[Tuple[Place, subprocess.Popen]]) -> None:
    """SIGTERM the ranks still running, SIGKILL those that outlive ``STOP_SECONDS``."""
    alive = [child for _, child in children if child.poll() is None]
    for child in alive:
        child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for child in alive:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _failure_text(failed: Tuple[Place, int], folder: str) -> str:
    """The failed rank's tagged report (written by :func:`_main`), or what its exit says."""
    place, code = failed
    try:
        with open(os.path.join(folder, f"rank-{place.rank}.error")) as report:
            return report.read()
    except FileNotFoundError:
        from sparktrain.faults import killed_text, lost_rank_text

        text = killed_text(f"rank {place.rank}'s process", -code) if code < 0 else \
            lost_rank_text(place.rank, place.hosts[place.rank])
        return f"{FAILURE_TAG} rank={place.rank}\n{text}\n{FAILURE_TAG} end"


def _result(folder: str, rank: int) -> Any:
    with open(os.path.join(folder, f"rank-{rank}.result"), "rb") as stored:
        return pickle.load(stored)


def _main(path: str) -> int:
    """A local rank's process: run the task in ``path``, write its result (or its tagged
    error) beside it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally blocks, then exit
    with open(path, "rb") as stored:
        task, where, place = pickle.load(stored)
    base = path[:-len(".task")]
    try:
        _, result = run_rank(task, where, place=place)
    except RuntimeError as exc:  # run_rank reported it and tagged it
        if FAILURE_TAG not in str(exc):
            raise
        with open(base + ".error", "w") as report:
            report.write(str(exc))
        return 1
    with open(base + ".result.tmp", "wb") as out:
        cloudpickle.dump(result, out)
    os.replace(base + ".result.tmp", base + ".result")
    return 0


if __name__ == "__main__":
    die_with_starter()
    sys.exit(_main(sys.argv[1]))
