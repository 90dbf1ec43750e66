"""GPUs as Spark schedules them: the training stage's plan on the driver, a rank's device.

Spark gives tasks GPUs (``spark.task.resource.gpu.amount``) out of the executors' GPUs
(``spark.executor.resource.gpu.amount``, found by a discovery script); a task sees its
addresses in ``TaskContext.resources()["gpu"]``. Before any job, :func:`plan_gpus` decides how
the training stage gets its GPUs (docs/clusters-and-gpus.md):

* ``use_gpu=None`` (default): GPUs when the executors or tasks have them, else CPU; ``True``:
  require them; ``False``: CPU even if Spark assigned GPUs.
* **A whole number N >= 1 of GPUs per task** (the application's amount, or the estimator's
  ``resource_profile``): each task runs N ranks, one process per GPU (torch), or one Keras
  worker that uses its N GPUs. ``num_proc`` counts training processes: torch ranks (one per
  GPU, as Horovod's ``num_proc``), Keras workers (one per task).
* **A fractional or unset task amount** (GPUs shared with ETL): the training stage asks for
  one whole GPU per rank itself, through a task resource profile (stage-level scheduling, as
  XGBoost's Spark estimators do, dmlc/xgboost#9519); the application's other stages keep the
  application's amounts. Spark supports this from 3.4 on standalone and local-cluster, from
  3.5.1 on YARN and Kubernetes, with dynamic allocation off; elsewhere a clear error says
  what to set.
* Prediction (``TorchModel``/``KerasModel.transform``) asks each task: :func:`task_gpu`, with
  the model's ``use_gpu``; any task GPU amount works there (fractions share a GPU).

``SPARKTRAIN_FAKE_GPUS`` in a rank's environment (tests: the discovery script announces those
addresses) makes a rank given GPUs train on the CPU, ``CUDA_VISIBLE_DEVICES`` still holding its
addresses.

Example::

    plan = plan_gpus(all_conf(spark), master(spark), spark.version, use_gpu=None)
    plan.ranks_per_task, plan.needs_profile      # (1, True) with gpu.amount=0.25
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

TASK_GPUS = "spark.task.resource.gpu.amount"
EXECUTOR_GPUS = "spark.executor.resource.gpu.amount"
FAKE_GPUS = "SPARKTRAIN_FAKE_GPUS"
DYNAMIC_ALLOCATION = "spark.dynamicAllocation.enabled"


class GpuUnavailableError(RuntimeError):
    """A rank was given a GPU that its framework cannot use (no CUDA build, no driver): the
    executors' environment, which a retry does not change. Not retried."""


@dataclass(frozen=True)
class GpuPlan:
    """How the training stage gets its GPUs (:func:`plan_gpus`).

    ``gpus_per_task``: GPUs each barrier task holds (0: CPU ranks); ``ranks_per_task``: the
    training processes each task runs (torch: one per GPU; Keras: 1, a worker using all its
    GPUs); ``profile_cpus``: when sparktrain builds the stage's task profile (stage-level
    scheduling), the CPUs each task asks for, else ``None``; ``source``: where the amount came
    from, for messages."""

    use_gpu: bool
    gpus_per_task: int = 0
    ranks_per_task: int = 1
    profile_cpus: Optional[int] = None
    source: str = "application"

    @property
    def needs_profile(self) -> bool:
        """Whether sparktrain gives the training stage its own task resource profile."""
        return self.profile_cpus is not None

    def tasks(self, num_proc: int, name: str = "num_proc") -> int:
        """Barrier tasks for ``num_proc`` training processes; ``ValueError`` when they do not
        divide evenly among the tasks' GPUs."""
        if num_proc % self.ranks_per_task:
            lower = num_proc - num_proc % self.ranks_per_task
            choices = f"{lower} or {lower + self.ranks_per_task}" if lower else \
                str(self.ranks_per_task)
            raise ValueError(
                f"{name}={num_proc} counts training processes, one per GPU; each task holds "
                f"{self.gpus_per_task} GPUs ({self.describe()}) and runs "
                f"{self.ranks_per_task} of them, so {name} must be a multiple of "
                f"{self.ranks_per_task}: {choices}")
        return num_proc // self.ranks_per_task

    def build_profile(self) -> Any:
        """The training stage's task resource profile (``None`` when it needs none)."""
        if not self.needs_profile:
            return None
        from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

        assert self.profile_cpus is not None  # needs_profile
        requests = TaskResourceRequests().cpus(self.profile_cpus).resource("gpu", 1)
        return ResourceProfileBuilder().require(requests).build

    def describe(self) -> str:
        return {"application": f"{TASK_GPUS}={self.gpus_per_task}",
                "resource_profile": "the estimator's resource_profile",
                "stage": "a task profile sparktrain gives the training stage"}[self.source]


def profile_gpus(profile: Any) -> Optional[float]:
    """A ``pyspark.resource.ResourceProfile``'s task GPU amount (``None``: it asks none)."""
    gpu = profile.taskResources.get("gpu")
    return None if gpu is None else float(gpu.amount)


def _required_keys(master: str) -> Dict[str, str]:
    """Conf keys a GPU cluster of this kind needs besides the task amount, with what to set."""
    keys = {EXECUTOR_GPUS: "the number of GPUs of each executor"}
    if master.startswith("k8s://"):
        keys["spark.executor.resource.gpu.vendor"] = "the device plugin's vendor, e.g. nvidia.com"
    if master.startswith("local-cluster"):  # its Workers take the application's conf (a real
        # standalone Worker reads its own: the application cannot see it)
        keys["spark.worker.resource.gpu.amount"] = "the GPUs of each worker"
    return keys


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def stage_scheduling_gap(master: str, spark_version: str, conf: Dict[str, str],
                         client_mapinarrow_profile: bool = True) -> Optional[str]:
    """Why this cluster cannot give the training stage a task profile of its own, or ``None``
    when it can (Spark's stage-level scheduling: TaskResourceProfile, SPARK-39853 for
    standalone in 3.4, SPARK-45495 for YARN and Kubernetes in 3.5.1)."""
    version = _version(spark_version)
    needed: Tuple[int, ...]
    if master.startswith(("spark://", "local-cluster")):
        needed, manager = (3, 4), "standalone"
    elif master.startswith(("yarn", "k8s://")):
        needed, manager = (3, 5, 1), "YARN and Kubernetes"
    else:
        return f"master {master or '(unknown)'} has no stage-level scheduling of GPUs"
    if version < needed:
        return (f"Spark {spark_version} cannot give one stage its own task resources on "
                f"{manager} (that needs Spark >= {'.'.join(map(str, needed))})")
    if str(conf.get(DYNAMIC_ALLOCATION, "false")).lower() == "true":
        return (f"with {DYNAMIC_ALLOCATION}=true a stage's own task resources need a whole "
                f"ResourceProfile with executor requests (pass resource_profile=)")
    if not client_mapinarrow_profile:
        return ("this pyspark cannot attach a resource profile to a DataFrame stage "
                "(DataFrame.mapInArrow(..., profile=) needs pyspark >= 4.0)")
    return None


def plan_gpus(conf: Dict[str, str], master: str, spark_version: str,
              use_gpu: Optional[bool], profile: Any = None, ranks_per_gpu: bool = True,
              client_mapinarrow_profile: bool = True) -> GpuPlan:
    """The training stage's :class:`GpuPlan`, or a ``ValueError`` naming the key to set.

    ``profile``: the estimator's ``resource_profile`` (its task GPUs then decide);
    ``ranks_per_gpu``: one rank per GPU (torch) or one worker per task using all its GPUs
    (Keras); ``client_mapinarrow_profile``: whether this pyspark can attach a profile."""
    if use_gpu is False:
        return GpuPlan(False)
    if profile is not None:
        gpus = profile_gpus(profile)
        if not gpus:
            if use_gpu:
                raise ValueError("use_gpu=True but resource_profile asks no GPU for its tasks; "
                                 "add .resource('gpu', 1) to its TaskResourceRequests")
            return GpuPlan(False, source="resource_profile")
        return _whole(gpus, "resource_profile's task GPU amount", ranks_per_gpu,
                      "resource_profile")
    task_amount, executor_amount = conf.get(TASK_GPUS), conf.get(EXECUTOR_GPUS)
    if task_amount is None and executor_amount is None:
        if use_gpu:
            raise ValueError(
                f"use_gpu=True but the executors have no GPUs: set {EXECUTOR_GPUS}=<GPUs per "
                f"executor> with spark.executor.resource.gpu.discoveryScript (see conf/ and "
                f"docs/clusters-and-gpus.md), or use_gpu=False")
        return GpuPlan(False)
    configured = f"{TASK_GPUS}={task_amount}" if task_amount is not None else \
        f"{EXECUTOR_GPUS}={executor_amount}"
    if master.startswith("local") and not master.startswith("local-cluster"):
        if task_amount is None and not use_gpu:
            return GpuPlan(False)  # executors' GPUs that a local master cannot hand out
        raise ValueError(f"{configured} is set but master {master} does not schedule GPUs; "
                         f"use a cluster (or local-cluster[...] with worker GPU resources)")
    for key, meaning in _required_keys(master).items():
        if key not in conf:
            raise ValueError(f"{configured} but {key} is not set; set it to {meaning}")
    amount = None if task_amount is None else float(task_amount)
    if amount is not None and amount >= 1:
        return _whole(amount, TASK_GPUS, ranks_per_gpu, "application")
    gap = stage_scheduling_gap(master, spark_version, conf, client_mapinarrow_profile)
    shared = f"{TASK_GPUS}={task_amount} shares a GPU among {int(1 / amount)} tasks" \
        if amount else f"{TASK_GPUS} is unset"
    if gap is not None:
        raise ValueError(
            f"{shared}, but training needs a whole GPU per rank, which sparktrain asks for in "
            f"the training stage only (stage-level scheduling); here it cannot: {gap}. Set "
            f"{TASK_GPUS}=1 for the application, pass resource_profile= (a ResourceProfile "
            f"with a GPU per task), or use_gpu=False to train on CPUs")
    assert executor_amount is not None  # required by _required_keys, checked above
    executor_gpus = float(executor_amount)
    if executor_gpus < 1:
        raise ValueError(f"{EXECUTOR_GPUS}={executor_amount}: expected the whole number of "
                         f"GPUs each executor has")
    cores = conf.get("spark.executor.cores")
    cpus = int(cores) // int(executor_gpus) if cores else int(conf.get("spark.task.cpus", 1))
    return GpuPlan(True, 1, 1, max(1, cpus), "stage")


def _whole(amount: float, what: str, ranks_per_gpu: bool, source: str) -> GpuPlan:
    if amount < 1 or amount != int(amount):
        raise ValueError(f"{what}={amount:g}: training needs a whole number of GPUs per task "
                         f"(one process per GPU); set it to 1 or more")
    return GpuPlan(True, int(amount), int(amount) if ranks_per_gpu else 1, source=source)


# ---------------------------------------------------------------------------------------------
# On the executors
# ---------------------------------------------------------------------------------------------

def rank_gpu(resources: Dict[str, List[str]], use_gpu: Optional[bool]) -> Optional[str]:
    """The GPU address this task (or local rank) runs on (the first Spark assigned), or
    ``None`` for CPU.

    ``use_gpu``: ``True`` requires a GPU (``RuntimeError`` without one), ``False`` means CPU,
    ``None`` (inference: the task decides) the task's GPU when it has one. Training passes
    the bool :func:`plan_gpus` resolved on the driver; a local rank's ``resources`` hold its
    own GPU only.

    Example: ``rank_gpu({"gpu": ["1"]}, None) == "1"``; ``rank_gpu({}, None) is None``.
    """
    gpus = resources.get("gpu", [])
    if use_gpu is False or (use_gpu is None and not gpus):
        return None
    if not gpus:
        raise RuntimeError(f"use_gpu=True but Spark assigned no GPU to this task; set "
                           f"{TASK_GPUS}=1 and {EXECUTOR_GPUS} (with "
                           f"spark.executor.resource.gpu.discoveryScript), give the stage a "
                           f"ResourceProfile with GPUs, or use_gpu=False for the CPU")
    return gpus[0]


def worker_gpus(resources: Dict[str, List[str]], use_gpu: Optional[bool]) -> Optional[str]:
    """Every GPU address of the task, comma-separated (``CUDA_VISIBLE_DEVICES`` of a worker
    that uses them all: Keras), or ``None`` for CPU (:func:`rank_gpu`'s rules).

    Example: ``worker_gpus({"gpu": ["2", "3"]}, True) == "2,3"``."""
    first = rank_gpu(resources, use_gpu)
    return None if first is None else ",".join(resources["gpu"])


def fake_gpus() -> bool:
    """Whether this process's GPUs are announced by tests (``SPARKTRAIN_FAKE_GPUS``): ranks
    given GPUs then train on the CPU."""
    return bool(os.environ.get(FAKE_GPUS))


def task_gpu(use_gpu: Optional[bool]) -> Optional[str]:
    """The GPU address the running Spark task predicts on (:func:`rank_gpu` of its
    ``TaskContext.resources()``), or ``None``: the CPU, and always outside a Spark task (a
    driver-side probe). Asked per batch: a reused Python worker runs tasks that may hold
    different GPUs."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return None
    resources = {name: list(info.addresses) for name, info in context.resources().items()}
    return rank_gpu(resources, use_gpu)


def cuda_ordinal(address: str, visible: int, framework: str) -> int:
    """Spark's GPU ``address`` as a CUDA device ordinal among ``visible`` GPUs, or a
    ``RuntimeError`` saying why it cannot be one.

    In a process whose ``CUDA_VISIBLE_DEVICES`` lists the address (a local rank sees only its
    own GPU), the ordinal is its position there. Otherwise Spark's discovery script reports
    ``nvidia-smi`` indices (PCI bus order); CUDA numbers devices fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA programming guide, environment variables); on hosts
    with identical GPUs the two orders usually agree, set
    ``spark.executorEnv.CUDA_DEVICE_ORDER=PCI_BUS_ID`` to be sure.
    """
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if address in listed:
        return listed.index(address)
    if not address.isdigit():
        raise RuntimeError(f"Spark assigned GPU {address!r} to this task; sparktrain expects "
                           f"the discovery script to report CUDA device ordinals (0, 1, ...)")
    if int(address) >= visible:
        raise RuntimeError(f"Spark assigned GPU {address} to this task, but {framework} sees "
                           f"{visible} GPU(s) here: the discovery script's addresses must be "
                           f"CUDA device ordinals of this executor (check CUDA_VISIBLE_DEVICES "
                           f"and set CUDA_DEVICE_ORDER=PCI_BUS_ID in spark.executorEnv)")
    return int(address)


def physical_gpus(addresses: Any) -> List[str]:
    """Spark's GPU ``addresses`` (one, comma-separated, or a list) as the entries of this
    process's ``CUDA_VISIBLE_DEVICES`` they stand for: where an executor already sees a
    subset (set by a container runtime or a node manager), Spark's addresses may be its
    entries (kept) or positions in it (mapped). Translating once, in the process that starts
    a rank, is what lets the rank find its GPU: a second translation in the child, against
    its own narrowed variable, gave another GPU or none.

    Example (``CUDA_VISIBLE_DEVICES=2,3``): ``physical_gpus(["0", "1"]) == ["2", "3"]``,
    ``physical_gpus("3") == ["3"]``."""
    if addresses is None:
        return []
    text = [addresses] if isinstance(addresses, str) else list(addresses)
    listed = [a.strip() for item in text for a in str(item).split(",") if a.strip()]
    outer = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
             if d.strip()]

    def physical(address: str) -> str:
        if not outer or address in outer or not address.isdigit() or \
                int(address) >= len(outer):
            return address
        return outer[int(address)]

    return [physical(a) for a in listed]


def gpu_environment(addresses: Any) -> Dict[str, str]:
    """Environment for a process that must see only these GPUs (a local rank, a TensorFlow
    worker): ``CUDA_VISIBLE_DEVICES`` of their :func:`physical_gpus`; ``addresses``: one
    address, several comma-separated, a list, or ``None``."""
    listed = physical_gpus(addresses)
    return {"CUDA_VISIBLE_DEVICES": ",".join(listed)} if listed else {}
