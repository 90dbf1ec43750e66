"""GPU scheduling: conf checks per cluster manager, and real GPU assignment by Spark to barrier
tasks on a local-cluster with a GPU discovery script (no CUDA needed: the assignment is Spark's)."""
from __future__ import annotations

import textwrap

import pytest

from sparktrain.launch.gpus import check_gpu_conf, gpu_environment, rank_gpu
from support.helpers import run_on_fake_gpus

GPU_CONF = {"spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "2"}


@pytest.mark.parametrize("master,extra,expected", [
    ("yarn", {}, True),
    ("k8s://https://api:6443", {"spark.executor.resource.gpu.vendor": "nvidia.com"}, True),
    ("spark://10.0.0.1:7077", {"spark.worker.resource.gpu.amount": "2"}, True),
])
def test_complete_gpu_conf_turns_gpus_on(master, extra, expected):
    assert check_gpu_conf({**GPU_CONF, **extra}, master, None) is expected
    assert check_gpu_conf({**GPU_CONF, **extra}, master, False) is False


@pytest.mark.parametrize("master,conf,use_gpu,message", [
    ("yarn", {}, True,
     "use_gpu=True but Spark gives tasks no GPUs: set spark.task.resource.gpu.amount=1"),
    ("yarn", {"spark.task.resource.gpu.amount": "1"}, None,
     "spark.executor.resource.gpu.amount is not set"),
    ("k8s://https://api:6443", GPU_CONF, None, "spark.executor.resource.gpu.vendor is not set"),
    ("spark://10.0.0.1:7077", GPU_CONF, None, "spark.worker.resource.gpu.amount is not set"),
    ("yarn", {**GPU_CONF, "spark.task.resource.gpu.amount": "0.5"}, None,
     r"=0.5 would run 2 ranks on one GPU, and NCCL needs a GPU per rank"),
    ("yarn", {**GPU_CONF, "spark.task.resource.gpu.amount": "1.5"}, None, "whole number"),
    ("local[4]", GPU_CONF, None, "does not schedule GPUs"),
])
def test_bad_gpu_conf_names_the_key(master, conf, use_gpu, message):
    with pytest.raises(ValueError, match=message):
        check_gpu_conf(conf, master, use_gpu)


def test_no_gpu_conf_means_cpu():
    assert check_gpu_conf({}, "yarn", None) is False


def test_rank_gpu_takes_the_first_assigned():
    assert rank_gpu({"gpu": ["3", "4"]}, True) == "3"
    assert rank_gpu({"gpu": ["3"]}, False) is None
    assert gpu_environment("3") == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(RuntimeError, match="assigned no GPU"):
        rank_gpu({}, True)


SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {root!r})
    from sparktrain import local_spark
    from sparktrain.launch.barrier import run_barrier
    from sparktrain.launch.gpus import check_gpu_conf, gpu_environment, rank_gpu

    spark = local_spark("local-cluster[1,2,1024]",
                        conf={{**{gpu_conf}, "spark.sparktrain.slotWaitSeconds": "60"}})
    sc = spark.sparkContext
    use_gpu = check_gpu_conf(dict(sc.getConf().getAll()), sc.master, None)

    def task(ctx):
        address = rank_gpu(ctx.resources, use_gpu)
        return {{"rank": ctx.rank, "spark": ctx.resources.get("gpu"), "address": address,
                 "env": gpu_environment(address)}}

    print("RESULT " + json.dumps({{"use_gpu": use_gpu, "ranks": run_barrier(spark, 2, task)}}))
    spark.stop()
''')


@pytest.mark.slow
def test_local_cluster_gives_each_rank_its_own_gpu():
    report = run_on_fake_gpus(SCRIPT, timeout=300, executor_gpus=2)
    assert report["use_gpu"] is True
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(len(r["spark"]) == 1 and r["address"] == r["spark"][0] for r in ranks)
    assert sorted(r["address"] for r in ranks) == ["0", "1"]  # distinct GPUs
    assert [r["env"] for r in ranks] == [{"CUDA_VISIBLE_DEVICES": r["address"]} for r in ranks]
