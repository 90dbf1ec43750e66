"""GPUs as Spark schedules them: check the cluster's conf before launch, pick a rank's device.

Spark assigns GPUs to tasks (``spark.task.resource.gpu.amount``) out of the executors' GPUs
(``spark.executor.resource.gpu.amount``, found by a discovery script); a barrier task sees its
addresses in ``TaskContext.resources()["gpu"]``. sparktrain trains one rank per task on the
first GPU Spark gave it:

* ``use_gpu=None`` (default): GPUs when tasks are given GPUs, else CPU; ``True``: require them;
  ``False``: CPU even if Spark assigned GPUs.
* ``spark.task.resource.gpu.amount`` must be a whole number >= 1. A fraction would put several
  ranks on one GPU, which NCCL refuses; more than 1 gives the rank several GPUs, of which it
  uses the first (the others stay idle: use more ranks instead).
* Prediction (``TorchModel``/``KerasModel.transform``) asks each task: :func:`task_gpu`, with
  the model's ``use_gpu``; any task GPU amount works there (fractions share a GPU).

Example::

    use_gpu = check_gpu_conf(all_conf(spark), master(spark), use_gpu=None)
"""
from __future__ import annotations

from typing import Dict, List, Optional

TASK_GPUS = "spark.task.resource.gpu.amount"
EXECUTOR_GPUS = "spark.executor.resource.gpu.amount"


def _required_keys(master: str) -> Dict[str, str]:
    """Conf keys a GPU cluster of this kind needs besides the task amount, with what to set."""
    keys = {EXECUTOR_GPUS: "the number of GPUs of each executor"}
    if master.startswith("k8s://"):
        keys["spark.executor.resource.gpu.vendor"] = "the device plugin's vendor, e.g. nvidia.com"
    if master.startswith(("spark://", "local-cluster")):
        keys["spark.worker.resource.gpu.amount"] = "the GPUs of each worker (in the worker's conf)"
    return keys


def check_gpu_conf(conf: Dict[str, str], master: str, use_gpu: Optional[bool]) -> bool:
    """Whether ranks train on GPUs; ``ValueError`` naming the conf key when the cluster's
    GPU configuration cannot give each rank its own GPU."""
    if use_gpu is False:
        return False
    task_amount = conf.get(TASK_GPUS)
    if task_amount is None:
        if use_gpu:
            raise ValueError(
                f"use_gpu=True but Spark gives tasks no GPUs: set {TASK_GPUS}=1 and "
                f"{EXECUTOR_GPUS}=<GPUs per executor> with a discovery script "
                f"(spark.executor.resource.gpu.discoveryScript; see conf/), or use_gpu=False")
        return False
    amount = float(task_amount)
    if amount < 1:
        raise ValueError(
            f"{TASK_GPUS}={task_amount} would run {int(1 / amount)} ranks on one GPU, and NCCL "
            f"needs a GPU per rank; set {TASK_GPUS}=1 (or use_gpu=False to train on CPUs)")
    if amount != int(amount):
        raise ValueError(f"{TASK_GPUS}={task_amount}: expected a whole number of GPUs per task")
    if master.startswith("local") and not master.startswith("local-cluster"):
        raise ValueError(f"{TASK_GPUS} is set but master {master} does not schedule GPUs; use "
                         f"a cluster (or local-cluster[...] with worker GPU resources)")
    for key, meaning in _required_keys(master).items():
        if key not in conf:
            raise ValueError(f"{TASK_GPUS}={task_amount} but {key} is not set; set it to "
                             f"{meaning}")
    return True


def rank_gpu(resources: Dict[str, List[str]], use_gpu: Optional[bool]) -> Optional[str]:
    """The GPU address this task runs on (the first Spark assigned), or ``None`` for CPU.

    ``use_gpu``: ``True`` requires a GPU (``RuntimeError`` without one), ``False`` means CPU,
    ``None`` (inference: the task decides) the task's GPU when it has one. Training passes
    the bool :func:`check_gpu_conf` resolved on the driver.

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

    Spark's discovery script reports ``nvidia-smi`` indices (PCI bus order); CUDA numbers
    devices fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA programming guide,
    environment variables); on hosts with identical GPUs the two orders usually agree, set
    ``spark.executorEnv.CUDA_DEVICE_ORDER=PCI_BUS_ID`` to be sure.
    """
    if not address.isdigit():
        raise RuntimeError(f"Spark assigned GPU {address!r} to this task; sparktrain expects "
                           f"the discovery script to report CUDA device ordinals (0, 1, ...)")
    if int(address) >= visible:
        raise RuntimeError(f"Spark assigned GPU {address} to this task, but {framework} sees "
                           f"{visible} GPU(s) here: the discovery script's addresses must be "
                           f"CUDA device ordinals of this executor (check CUDA_VISIBLE_DEVICES "
                           f"and set CUDA_DEVICE_ORDER=PCI_BUS_ID in spark.executorEnv)")
    return int(address)


def gpu_environment(address: Optional[str]) -> Dict[str, str]:
    """Environment for a process that must see only this rank's GPU (e.g. TensorFlow in a
    child process); in-process torch uses the device ordinal instead (``cuda:<address>``)."""
    return {} if address is None else {"CUDA_VISIBLE_DEVICES": address}
