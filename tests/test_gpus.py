"""GPU scheduling without Spark jobs: the training stage's plan per cluster manager, Spark
version and task amount (launch.gpus), a rank's device and its environment. Real assignment
by Spark: tests/test_gpu_clusters.py (training), tests/test_gpu_inference.py (prediction)."""
from __future__ import annotations

import pytest

from sparktrain.launch.gpus import (
    GpuPlan,
    cuda_ordinal,
    gpu_environment,
    plan_gpus,
    rank_gpu,
    stage_scheduling_gap,
    worker_gpus,
)

GPU_CONF = {"spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "2"}
STANDALONE = "spark://10.0.0.1:7077"
WORKER = {"spark.worker.resource.gpu.amount": "4"}


def plan(conf, master="yarn", version="4.0.1", use_gpu=None, **more):
    return plan_gpus(conf, master, version, use_gpu, **more)


@pytest.mark.parametrize("master,extra", [
    ("yarn", {}),
    ("k8s://https://api:6443", {"spark.executor.resource.gpu.vendor": "nvidia.com"}),
    (STANDALONE, WORKER),
])
def test_a_gpu_per_task_trains_a_rank_per_task(master, extra):
    assert plan({**GPU_CONF, **extra}, master) == GpuPlan(True, 1, 1)
    assert plan({**GPU_CONF, **extra}, master, use_gpu=False) == GpuPlan(False)


def test_several_gpus_per_task_run_a_rank_each_or_one_worker():
    conf = {**GPU_CONF, "spark.task.resource.gpu.amount": "4",
            "spark.executor.resource.gpu.amount": "4"}
    torch_plan = plan(conf)
    assert (torch_plan.gpus_per_task, torch_plan.ranks_per_task) == (4, 4)
    assert torch_plan.tasks(8) == 2 and not torch_plan.needs_profile
    with pytest.raises(ValueError, match=r"num_proc=6 counts training processes, one per GPU; "
                                         r".* must be a multiple of 4: 4 or 8"):
        torch_plan.tasks(6)
    keras_plan = plan(conf, ranks_per_gpu=False)  # one worker using its 4 GPUs
    assert (keras_plan.gpus_per_task, keras_plan.ranks_per_task) == (4, 1)
    assert keras_plan.tasks(3) == 3


@pytest.mark.parametrize("amount", ["0.25", None])
def test_shared_or_unset_task_gpus_get_a_stage_profile(amount):
    conf = {"spark.executor.resource.gpu.amount": "4", "spark.executor.cores": "8", **WORKER,
            **({"spark.task.resource.gpu.amount": amount} if amount else {})}
    staged = plan(conf, STANDALONE, "3.4.0")
    assert staged == GpuPlan(True, 1, 1, profile_cpus=2, source="stage")
    assert staged.needs_profile and staged.tasks(3) == 3


@pytest.mark.parametrize("master,version,conf,message", [
    ("yarn", "3.5.0", {}, r"Spark 3.5.0 cannot give one stage its own task resources on YARN "
                          r"and Kubernetes \(that needs Spark >= 3.5.1\)"),
    (STANDALONE, "3.3.2", WORKER, r"needs Spark >= 3.4"),
    ("yarn", "4.0.1", {"spark.dynamicAllocation.enabled": "true"},
     "spark.dynamicAllocation.enabled=true"),
    ("mesos://m:5050", "4.0.1", {}, "no stage-level scheduling"),
])
def test_no_stage_scheduling_names_what_to_set(master, version, conf, message):
    conf = {"spark.task.resource.gpu.amount": "0.25",
            "spark.executor.resource.gpu.amount": "2", **conf}
    with pytest.raises(ValueError, match=message) as error:
        plan(conf, master, version)
    assert "shares a GPU among 4 tasks" in str(error.value)
    assert "Set spark.task.resource.gpu.amount=1 for the application" in str(error.value)


def test_old_pyspark_clients_cannot_attach_a_profile():
    assert "pyspark >= 4.0" in stage_scheduling_gap("yarn", "3.5.1", {}, False)
    assert stage_scheduling_gap("yarn", "3.5.1", {}, True) is None


@pytest.mark.parametrize("master,conf,use_gpu,message", [
    ("yarn", {}, True,
     "use_gpu=True but the executors have no GPUs: set spark.executor.resource.gpu.amount"),
    ("yarn", {"spark.task.resource.gpu.amount": "1"}, None,
     "spark.executor.resource.gpu.amount is not set"),
    ("k8s://https://api:6443", GPU_CONF, None, "spark.executor.resource.gpu.vendor is not set"),
    ("local-cluster[2,1,1024]", GPU_CONF, None, "spark.worker.resource.gpu.amount is not set"),
    ("yarn", {**GPU_CONF, "spark.task.resource.gpu.amount": "1.5"}, None,
     "spark.task.resource.gpu.amount=1.5: training needs a whole number of GPUs per task"),
    ("local[4]", GPU_CONF, None, "does not schedule GPUs"),
])
def test_bad_gpu_conf_names_the_key(master, conf, use_gpu, message):
    with pytest.raises(ValueError, match=message):
        plan(conf, master, use_gpu=use_gpu)


def test_no_gpu_conf_means_cpu():
    assert plan({}) == GpuPlan(False)
    assert plan({"spark.executor.resource.gpu.amount": "1"}, "local[2]") == GpuPlan(False)


def test_resource_profile_decides_the_task_gpus(spark):
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    def profile(gpus):
        requests = TaskResourceRequests().cpus(1)
        return ResourceProfileBuilder().require(
            requests.resource("gpu", gpus) if gpus else requests).build

    assert plan({}, profile=profile(2)) == GpuPlan(True, 2, 2, source="resource_profile")
    assert plan({}, profile=profile(0)) == GpuPlan(False, source="resource_profile")
    with pytest.raises(ValueError, match="resource_profile asks no GPU"):
        plan({}, use_gpu=True, profile=profile(0))
    with pytest.raises(ValueError, match="task GPU amount=0.5: training needs a whole number"):
        plan({}, profile=profile(0.5))


def test_rank_and_worker_gpus():
    assert rank_gpu({"gpu": ["3", "4"]}, True) == "3"
    assert rank_gpu({"gpu": ["3"]}, False) is None
    assert worker_gpus({"gpu": ["3", "4"]}, None) == "3,4"
    assert worker_gpus({}, None) is None
    assert gpu_environment("3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert gpu_environment(["3", "4"]) == {"CUDA_VISIBLE_DEVICES": "3,4"}
    with pytest.raises(RuntimeError, match="assigned no GPU"):
        rank_gpu({}, True)


def test_a_child_sees_the_gpu_its_address_stands_for(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the executor sees GPUs 2 and 3
    assert gpu_environment("3") == {"CUDA_VISIBLE_DEVICES": "3"}  # addresses are entries
    assert gpu_environment(["0", "1"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}  # ... or positions


class _Barrier:
    """What :func:`~sparktrain.launch.local_ranks.places` reads of a barrier task holding
    Spark's GPU addresses ``gpus``."""

    def __init__(self, gpus):
        from types import SimpleNamespace

        self.gpus = gpus
        self.getTaskInfos = lambda: [SimpleNamespace(address="10.0.0.5:4040")]
        self.resources = lambda: {"gpu": SimpleNamespace(addresses=gpus)}
        self.partitionId, self.cpus, self.stageId = (lambda: 0), (lambda: 4), (lambda: 7)


CHILD = ("import os, sys; from sparktrain.launch.gpus import cuda_ordinal; "
         "print(os.environ['CUDA_VISIBLE_DEVICES'], cuda_ordinal(sys.argv[1], 1, 'torch'))")


@pytest.mark.parametrize("outer,spark", [("2,3", ["0", "1"]), ("2,3", ["2", "3"]),
                                          ("2,3", ["1"]), ("4,5,6,7", ["0", "1", "2", "3"]),
                                          ("", ["0", "1"]), ("7,6", ["1", "0"])])
def test_each_local_rank_finds_the_gpu_spark_gave_it_once_translated(monkeypatch, outer, spark):
    """The executor's CUDA_VISIBLE_DEVICES (a container runtime's) and Spark's addresses,
    positions in it or its entries, for 1, 2 and 4 local ranks: each local rank's process (a
    real child, started with the environment the parent gives it) sees exactly the GPU its
    address stands for, and finds it as its device 0 (it was translated twice: rank 1 failed
    "torch sees 1 GPU(s)")."""
    import subprocess
    import sys

    from sparktrain.launch.local_ranks import places, rank_environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", outer)
    entries = outer.split(",") if outer else []
    want = [entries[int(a)] if entries and a not in entries else a for a in spark]
    for place, gpu in zip(places(_Barrier(spark), len(spark)), want, strict=True):
        child = subprocess.run([sys.executable, "-c", CHILD, place.resources["gpu"][0]],
                               env=rank_environment(place), capture_output=True, text=True,
                               timeout=60)
        assert child.stdout.split() == [gpu, "0"], (place, child.stdout, child.stderr)


def test_a_keras_worker_sees_every_gpu_of_its_task_translated(monkeypatch):
    from sparktrain.launch.tf_multiworker import child_environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    gpus = worker_gpus({"gpu": ["0", "1"]}, True)
    assert child_environment("{}", gpus)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert child_environment("{}", None)["CUDA_VISIBLE_DEVICES"] == ""  # a CPU worker


def test_a_local_rank_finds_its_gpu_among_the_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    assert cuda_ordinal("6", 1, "torch") == 0  # a local rank sees only its own GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_ordinal("1", 2, "torch") == 1


def test_a_gpu_torch_cannot_use_fails_once_not_retried(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine's torch has CUDA")
    from sparktrain.faults import is_user_error
    from sparktrain.launch.gpus import GpuUnavailableError
    from sparktrain.launch.rank_context import RankContext
    from sparktrain.loop.torch_batch import select_device

    monkeypatch.delenv("SPARKTRAIN_FAKE_GPUS", raising=False)
    ctx = RankContext(rank=1, world_size=2, hosts=["h", "h"], cpus=1, resources={"gpu": ["0"]},
                      barrier=None)
    with pytest.raises(GpuUnavailableError, match="Spark assigned GPU 0 to rank 1, but torch "
                                                  ".* cannot use CUDA here") as error:
        select_device(ctx, True)
    assert is_user_error(error.value)  # the fit fails at once: a retry finds the same torch
    monkeypatch.setenv("SPARKTRAIN_FAKE_GPUS", "0")
    assert select_device(ctx, True).type == "cpu"


def test_the_training_profile_is_a_param_not_saved(spark, tmp_path):
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    from sparktrain import TorchEstimator

    with pytest.raises(TypeError, match="resource_profile must be a pyspark.resource"):
        TorchEstimator(resource_profile={"gpu": 1})
    profile = ResourceProfileBuilder().require(TaskResourceRequests().cpus(1)).build
    estimator = TorchEstimator(num_proc=2, resource_profile=profile)
    assert estimator.getResourceProfile() is profile
    estimator.write().overwrite().save(str(tmp_path / "estimator"))
    assert TorchEstimator.load(str(tmp_path / "estimator")).getResourceProfile() is None


class _Settings:
    """A session's settings as ``spark_api`` reads them (``spark.conf.get``), nothing else: the
    slot count from the conf is arithmetic on them (a Spark Connect client has no live count)."""

    def __init__(self, conf):
        self.conf = self
        self._values = conf

    def get(self, key, default=None):
        return self._values.get(key, default)


def test_gpu_slots_from_the_conf_count_whole_tasks_of_the_profile():
    from pyspark.resource import ResourceProfile, TaskResourceRequests

    from sparktrain.session.slots import _gpu_slots_from_conf

    def profile(gpus, cpus=1):
        return ResourceProfile(_exec_req={},
                               _task_req=TaskResourceRequests().cpus(cpus).resource("gpu", gpus)
                               .requests)

    conf = {"spark.master": "yarn", "spark.executor.instances": "2",
            "spark.executor.cores": "16", "spark.executor.resource.gpu.amount": "4"}
    assert _gpu_slots_from_conf(_Settings(conf), profile(1)) == 8  # GPUs, not the 32 cores
    assert _gpu_slots_from_conf(_Settings(conf), profile(4)) == 2
    assert _gpu_slots_from_conf(_Settings(conf), profile(1, cpus=8)) == 4  # 2 cores-bound
    assert _gpu_slots_from_conf(_Settings({**conf, "spark.executor.cores": "2"}),
                                profile(1)) == 4
    cluster = {"spark.master": "local-cluster[2,2,1024]",
               "spark.executor.resource.gpu.amount": "2"}
    assert _gpu_slots_from_conf(_Settings(cluster), profile(1)) == 4
    assert _gpu_slots_from_conf(_Settings({"spark.master": "yarn"}), profile(1)) is None
