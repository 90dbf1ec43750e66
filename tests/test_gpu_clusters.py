"""GPU clusters as they are set up, on the shared standalone cluster on loopback: Workers added
for this file announce fake GPUs (conf/getGpusResources.sh reads ``SPARKTRAIN_FAKE_GPUS``),
Spark schedules and assigns them for real, and a rank given GPUs trains on the CPU
(launch.gpus), its log line naming its GPU and ``CUDA_VISIBLE_DEVICES``. Only this file runs
sparktrain's GPU plans through a real cluster manager's scheduling: stage-level profiles,
multi-GPU tasks, per-task prediction devices.

- GPUs shared with ETL (``spark.task.resource.gpu.amount=0.25``): an ordinary stage runs
  several tasks per GPU, the training stage gets a whole GPU per rank (stage-level scheduling),
  prediction tasks predict on the GPU of their task (or the CPU: ``use_gpu=False``, a profile
  without GPUs).
- One task per machine with all its GPUs (``amount=2``): two tasks run 4 ranks, one process
  per GPU, and learn what 4 one-GPU tasks learn (DDP; Horovod on streamed rows); Keras runs
  one worker per task using its 2 GPUs.
- An impossible request fails before any Spark job, naming what to set.

Both scenarios are applications of one driver process (one JVM: the second session starts
after the first stopped) on the same two Workers: "20,21" with 4 cores (the only one the
first application's 4-core executors fit) and "30,31" with 2.
"""
from __future__ import annotations

import re
import sys
import textwrap

import pytest

from support.helpers import FAKE_GPU_DISCOVERY, run_reporting_script
from support.servers import gpu_worker_env, restore

pytestmark = pytest.mark.full

GPU_LINE = re.compile(r"\[rank (\d+)\] GPU(?:s)? ([\d,]+) .*?CUDA_VISIBLE_DEVICES=([\w,]+)")
#: what the script prints to stderr between its two applications
BETWEEN = "SHARED GPUS DONE"

# The script: a session on the cluster per application (its GPU settings), the regression rows
# of tests/conftest.py, and helpers fitting them. Each application's findings go in the report
# (an application that raised: its traceback), printed as one "RESULT" line at the end.
SCRIPT = textwrap.dedent('''
    import json, logging, os, sys, traceback
    sys.path[:0] = [{root!r}, {tests!r}]
    import numpy as np
    from pyspark.ml.linalg import Vectors
    from sparktrain import local_spark
    from sparktrain.session.worker_daemon import DAEMON_CONF
    from support.helpers import linear_estimator

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    STORE = {store!r}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5

    def session(conf):
        spark = local_spark(None, conf={{
            "spark.master": {url!r}, "spark.driver.host": "127.0.0.1",
            "spark.pyspark.python": sys.executable, "spark.executor.memory": "768m",
            "spark.executor.resource.gpu.discoveryScript": {discovery!r},
            "spark.sparktrain.slotWaitSeconds": "90", **DAEMON_CONF, **conf}})
        df = spark.createDataFrame(
            [(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y)],
            ["features", "label"]).cache()
        df.count()
        return spark, df

    def weights(model):
        net = model.getModel()
        return [float(v) for v in net.weight.detach().flatten()] + [float(net.bias)]

    def jobs(spark):
        return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))

    def shared_gpus(report):
        spark, df = session({{"spark.executor.cores": "4",
                              "spark.executor.resource.gpu.amount": "2",
                              "spark.task.resource.gpu.amount": "0.25"}})
        import time
        from pyspark import TaskContext

        def hold(rows):  # an ordinary stage: which GPU each task holds, and when
            started = time.time()
            time.sleep(2.5)  # long enough to overlap on a loaded machine
            yield (TaskContext.get().resources()["gpu"].addresses, started, time.time())

        report["etl"] = spark.sparkContext.parallelize(range(4), 4).mapPartitions(hold).collect()
        model = linear_estimator(STORE, num_proc=2, epochs=3, batch_size=32,
                                 verbose=2).fit(df)
        report["loss"] = model.getHistory()["loss"]

        # prediction tasks: the GPU of each task (no CUDA here: the error names it), or the CPU
        import torch
        from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests
        from sparktrain import KerasModel, TorchModel

        features = df.select("features").limit(40).repartition(2).cache()

        def outcome(name, model, expected):
            try:
                rows = model.transform(features).select("features", "y__output").collect()
                got = np.array([r.y__output for r in rows])
                want = expected(np.array([r.features.toArray() for r in rows], dtype=np.float32))
                report[name] = {{"max_error": float(np.abs(got - want).max())}}
            except Exception as exc:
                report[name] = {{"error": str(exc)[-3000:]}}

        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        on_driver = lambda a: net(torch.from_numpy(a)).detach().numpy()
        torch_model = TorchModel(model=net, feature_columns=["features"], label_columns=["y"])
        outcome("torch_default", torch_model, on_driver)
        outcome("torch_cpu", torch_model.copy().setUseGpu(False), on_driver)
        no_gpu = ResourceProfileBuilder().require(TaskResourceRequests().cpus(1)).build
        outcome("torch_profile_without_gpu", torch_model.copy().setResourceProfile(no_gpu),
                on_driver)
        import keras
        net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        keras_model = KerasModel(model=net, feature_columns=["features"], label_columns=["y"])
        keras_driver = lambda a: np.asarray(net(a, training=False))
        outcome("keras_default", keras_model, keras_driver)
        outcome("keras_cpu", keras_model.copy().setUseGpu(False), keras_driver)
        spark.stop()

    def gpus_per_task(report):
        spark, df = session({{"spark.executor.cores": "2",
                              "spark.executor.resource.gpu.amount": "2",
                              "spark.task.resource.gpu.amount": "2"}})
        from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

        fit = dict(num_proc=4, epochs=2, batch_size=16, verbose=2)
        local = linear_estimator(STORE, **fit).fit(df)
        print("LOCAL RANKS DONE", file=sys.stderr, flush=True)
        one_each = ResourceProfileBuilder().require(
            TaskResourceRequests().cpus(1).resource("gpu", 1)).build
        tasks = linear_estimator(STORE, resource_profile=one_each, **fit).fit(df)
        horovod = linear_estimator(STORE, backend="horovod", input_mode="stream",
                                   **fit).fit(df)
        print("TORCH DONE", file=sys.stderr, flush=True)
        import keras
        from sparktrain import KerasEstimator

        keras_fit = KerasEstimator(
            num_proc=2, model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
            optimizer=keras.optimizers.SGD(0.05), loss="mse", feature_cols=["features"],
            label_cols=["label"], batch_size=32, epochs=2, store=STORE, verbose=2).fit(df)
        spark.conf.set("spark.sparktrain.slotWaitSeconds", "0")
        before = jobs(spark)
        try:
            linear_estimator(STORE, num_proc=6, epochs=1).fit(df)
            refused = None
        except RuntimeError as error:
            refused = str(error)
        report.update({{
            "local": weights(local), "tasks": weights(tasks),
            "loss": local.getHistory()["loss"], "refused": refused,
            "horovod_loss": horovod.getHistory()["loss"],
            "keras_loss": keras_fit.getHistory()["loss"],
            "jobs": jobs(spark) - before}})
        spark.stop()

    import time
    report = {{"shared_gpus": {{}}, "gpus_per_task": {{}}}}
    for name, scenario in (("shared_gpus", shared_gpus), ("gpus_per_task", gpus_per_task)):
        started = time.time()
        try:
            scenario(report[name])
            report[name]["seconds"] = time.time() - started
        except Exception:
            report[name]["failed"] = traceback.format_exc()[-6000:]
            from pyspark.sql import SparkSession
            active = SparkSession.getActiveSession()
            if active is not None:
                active.stop()
        print({between!r}, file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def found(standalone, tmp_path_factory):
    """One driver process, both applications, on two Workers added to the worker's shared
    cluster (tests/support/servers.py), which is restored after: ``{scenario: (its findings,
    its part of the driver's stderr)}``."""
    import os

    try:
        # not waited for: the Workers start while the driver does (its first job waits)
        standalone.add_worker(gpu_worker_env("20,21"), cores=4, wait=0)
        standalone.add_worker(gpu_worker_env("30,31"), cores=2, wait=0)
        tests = os.path.dirname(os.path.abspath(__file__))
        code = SCRIPT.format(root=os.path.dirname(tests), tests=tests, url=standalone.url,
                             discovery=FAKE_GPU_DISCOVERY, between=BETWEEN,
                             store=str(tmp_path_factory.mktemp("gpu_clusters") / "store"))
        report, stderr = run_reporting_script(code, 560)
    finally:
        restore(standalone)
    parts = stderr.split(BETWEEN)
    print({name: found.get("seconds") for name, found in report.items()})  # with -s
    return {name: (report[name], parts[i]) for i, name in enumerate(report)}


def _scenario(found, name):
    report, stderr = found[name]
    assert "failed" not in report, report["failed"] + "\n" + stderr[-6000:]
    return report, stderr


def _gpu_lines(stderr):
    """``{rank: (its GPUs, CUDA_VISIBLE_DEVICES)}`` from the ranks' device lines."""
    return {int(rank): (gpus, visible) for rank, gpus, visible in GPU_LINE.findall(stderr)}


def test_gpus_shared_with_etl_train_a_whole_gpu_per_rank(found):
    report, stderr = _scenario(found, "shared_gpus")
    etl = report["etl"]
    assert all(len(gpus) == 1 for gpus, _, _ in etl)
    shared = [(a, b) for i, a in enumerate(etl) for b in etl[i + 1:]
              if a[0] == b[0] and a[1] < b[2] and b[1] < a[2]]
    assert shared, f"no GPU ran two tasks at once: {etl}"
    assert "the training stage asks for 1 GPU and 2 CPU(s) per rank" in stderr
    devices = _gpu_lines(stderr)
    assert sorted(devices) == [0, 1] and sorted(g for g, _ in devices.values()) == ["20", "21"]
    loss = report["loss"]
    assert loss[-1] < loss[0] / 2

    # prediction: each task's GPU, shared (0.25) with other tasks; no CUDA here, so a task that
    # got a GPU proves it by the error naming its address
    import torch

    assert re.search(rf"Spark assigned GPU 2[01] to this prediction task, but torch "
                     rf"{re.escape(torch.__version__)} cannot use CUDA here.*setUseGpu\(False\)",
                     report["torch_default"].get("error", "")), report
    assert re.search(r"Spark assigned GPU 2[01] to this prediction task, but TensorFlow \S+ "
                     r"sees no GPU here", report["keras_default"].get("error", "")), report
    # use_gpu=False, or a stage profile without GPUs: the CPU, the driver's predictions
    for name in ("torch_cpu", "torch_profile_without_gpu", "keras_cpu"):
        assert report[name].get("max_error", 1) < 1e-5, (name, report[name])


def test_a_task_with_two_gpus_runs_two_ranks_or_one_keras_worker(found):
    report, stderr = _scenario(found, "gpus_per_task")
    local_fit = stderr.split("LOCAL RANKS DONE")[0]
    devices = _gpu_lines(local_fit)
    assert sorted(devices) == list(range(4))
    assert sorted(g for g, _ in devices.values()) == \
        ["20", "21", "30", "31"]  # every rank on a distinct device
    assert all(gpus == visible for gpus, visible in devices.values())
    assert "each task holds 2 GPUs and runs 2 ranks" in local_fit
    np = pytest.importorskip("numpy")
    np.testing.assert_allclose(report["local"], report["tasks"], rtol=1e-5, atol=1e-6)
    loss = report["loss"]
    assert loss[-1] < loss[0] / 2
    # Horovod's 4 ranks take the rows each task streams, dealt to its 2 ranks (another order
    # than the store's shards): it learns as much
    horovod = report["horovod_loss"]
    assert horovod[-1] < horovod[0] / 2 and abs(horovod[-1] - loss[-1]) < 0.5 * loss[-1]
    assert "num_proc=6 needs 3 task(s) of 2 GPU(s) each" in report["refused"]
    assert "room for 4 rank(s)" in report["refused"]
    assert report["jobs"] == 0
    # Keras: one worker per task, using the task's 2 GPUs (MultiWorkerMirroredStrategy)
    keras_fit = stderr.split("TORCH DONE")[1]
    workers = _gpu_lines(keras_fit)
    assert sorted(workers) == [0, 1]
    assert sorted(workers.values()) == [("20,21", "20,21"), ("30,31", "30,31")]
    assert report["keras_loss"][-1] < report["keras_loss"][0]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-n", "0"]))
