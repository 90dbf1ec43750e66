"""Executors whose Python cannot run a rank fail the fit at once, naming the module, that
Python and the fix: a real local[2] Spark whose executors run a bare virtual environment, and
Spark's own error texts (captured from real failures on pyspark 4.3) for the parser.

Full tier: test_executors_without_the_packages_fail_the_fit_at_once. Only it fits with
executors that really lack the packages, so only it catches a probe that cannot run in a Python
without pandas, pyarrow or sparktrain, or a fit that launches its barrier stage (and Spark's
retries, naming nothing) before the check. The quick tier parses captured texts and runs
check_executors on executors that have everything but a made-up module."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from sparktrain import ExecutorEnvironmentError, TrainingError
from sparktrain.launch.executor_env import (
    RANK_MODULES,
    _warn_on_version_differences,
    check_executors,
    environment_error,
    fix_for,
    store_modules,
)

# Spark's texts below, verbatim: a backslash at a line's end only wraps it (Python drops it).

# The executors lacked pyarrow (a bare venv as PYSPARK_PYTHON) when a barrier mapInPandas ran.
BARRIER_NO_PYARROW = """An error occurred while calling o109.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: ShuffleMapStage 2 (collect at \
/tmp/envwork/capture.py:26) has failed the maximum allowable number of times: 2. Most recent \
failure reason: Stage failed because barrier task ShuffleMapTask(2, 1) finished unsuccessfully.
org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the \
Python worker: Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
worker.py", line 4207, in invoke_udf
    func, profiler, deserializer, serializer = read_udfs(
                                               ^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
worker.py", line 2696, in read_udfs
    import pyarrow as pa
ModuleNotFoundError: No module named 'pyarrow'
 SQLSTATE: 38000
"""

# The executors had pandas and pyarrow but not sparktrain: unpickling the rank function failed.
BARRIER_NO_SPARKTRAIN = """An error occurred while calling o56.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: ShuffleMapStage 0 (collect at \
/tmp/envwork/capture2.py:14) has failed the maximum allowable number of times: 2. Most recent \
failure reason: Stage failed because barrier task ShuffleMapTask(0, 1) finished unsuccessfully.
org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the \
Python worker: Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
worker_util.py", line 75, in read_command
    command = serializer.loads(file)
              ^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
serializers.py", line 483, in loads
    return cloudpickle.loads(obj, encoding=encoding)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
ModuleNotFoundError: No module named 'sparktrain'
 SQLSTATE: 38000
"""

# PYSPARK_PYTHON was a Python 3.10 under a 3.11 driver (a plain UDF: the probe's own job).
VERSION_MISMATCH = """An exception was thrown from the Python worker:
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
worker.py", line 4174, in invoke_udf
    check_python_version(init_info.python_version)
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/\
worker_util.py", line 93, in check_python_version
    raise PySparkRuntimeError(
pyspark.errors.exceptions.base.PySparkRuntimeError: [PYTHON_VERSION_MISMATCH] Python in worker has \
different version: 3.10 than that in driver: 3.11, PySpark cannot run with different minor versions.
Please check environment variables PYSPARK_PYTHON and PYSPARK_DRIVER_PYTHON are correctly set."""

# PYSPARK_PYTHON named a file that does not exist.
NO_SUCH_PYTHON = """An error occurred while calling o61.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 \
times, most recent failure: Lost task 0.0 in stage 0.0 (TID 0) (localhost executor driver): \
java.io.IOException: Cannot run program "/nonexistent/bin/python": error=2, No such file or \
directory
Caused by: java.io.IOException: error=2, No such file or directory
\t... 32 more

Driver stacktrace:
Caused by: java.io.IOException: Cannot run program "/nonexistent/bin/python": error=2, No such \
file or directory"""

# A rank that failed in training (not an environment problem): the parser must leave it alone.
TRAINING_FAILURE = """An error occurred while calling o208.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a \
failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task \
ResultTask(5, 1) finished unsuccessfully.
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
ValueError: Expected input batch_size (16) to match target batch_size (8)."""


def test_spark_texts_of_unfit_executors_become_one_clear_error():
    error = environment_error(BARRIER_NO_PYARROW, attempts=2)
    assert isinstance(error, ExecutorEnvironmentError) and isinstance(error, TrainingError)
    assert error.missing == ["pyarrow"] and error.attempts == 2
    message = str(error)
    assert "cannot import pyarrow" in message
    assert "PYSPARK_PYTHON" in message and "spark.pyspark.python" in message
    assert "Spark Connect" in message  # the cluster's Python needs it there

    error = environment_error(BARRIER_NO_SPARKTRAIN)
    assert error.missing == ["sparktrain"] and "install sparktrain" in str(error)

    error = environment_error(VERSION_MISMATCH)
    assert "is Python 3.10 and this driver's is Python 3.11" in str(error)
    assert sys.executable in str(error)  # the Python to point PYSPARK_PYTHON at

    error = environment_error(NO_SUCH_PYTHON)
    assert error.python == "/nonexistent/bin/python"
    assert "cannot start the executors' Python '/nonexistent/bin/python' (error=2, No such " \
           "file or directory)" in str(error)

    assert environment_error(TRAINING_FAILURE) is None


def test_fit_ready_executors_pass_the_check(spark, caplog):
    """The shared session's executors run this Python: every backend's modules are found
    (submodules without importing their packages), no version differs, and it is cached."""
    caplog.set_level(logging.WARNING, logger="sparktrain")
    modules = list(RANK_MODULES) + ["torch", "horovod.torch", "tensorflow", "keras",
                                    "tensorflowonspark.TFSparkNode"]
    check_executors(spark, modules)
    assert not [r for r in caplog.records if r.name.startswith("sparktrain")], caplog.text
    started = time.perf_counter()
    check_executors(spark, modules)  # cached for the session: no job
    assert time.perf_counter() - started < 0.01
    with pytest.raises(ExecutorEnvironmentError, match=r"cannot find no_such_module_xyz, "
                                                       r"which a test needs on every executor"):
        check_executors(spark, ["numpy", "no_such_module_xyz"], "a test")
    with pytest.raises(ExecutorEnvironmentError, match=r"cannot find numpy.no_such_submodule"):
        check_executors(spark, ["numpy.no_such_submodule"], "a test")


def test_the_stores_client_is_checked_on_the_executors_before_any_job_writes(
        spark, regression_df, tmp_path, monkeypatch):
    """A store whose filesystem package the driver has and the executors lack (a package on
    this process's path only, registered as fsspec's ``driveronly://``): the fit fails at the
    check, naming the package, the store and the fix, and never opens the store."""
    import fsspec

    from support.helpers import linear_estimator

    opened = tmp_path / "opened"
    package = tmp_path / "driveronly_fs"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from fsspec import AbstractFileSystem\n"
        "class DriverOnlyFileSystem(AbstractFileSystem):\n"
        "    protocol = 'driveronly'\n"
        "    def __init__(self, *args, **kwargs):\n"
        f"        open({str(opened)!r}, 'w').close()\n"
        "        super().__init__(*args, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # this process only: not the Python workers
    fsspec.register_implementation("driveronly", "driveronly_fs.DriverOnlyFileSystem")
    assert store_modules("driveronly://bucket/st") == ["driveronly_fs"]
    with pytest.raises(ExecutorEnvironmentError) as info:
        linear_estimator("driveronly://bucket/st", epochs=1).fit(regression_df)
    message = str(info.value)
    assert info.value.missing == ["driveronly_fs"], message
    assert "cannot find driveronly_fs, which TorchEstimator(backend='torch', " \
           "store='driveronly://bucket/st') needs on every executor" in message
    assert "PYSPARK_PYTHON" in message  # local mode: point Spark at a Python that has it
    assert not opened.exists()  # nothing was written: the store was never opened


def test_store_clients_and_fixes_by_cluster_manager():
    assert store_modules("s3a://bucket/st") == store_modules("s3://bucket/st") == ["s3fs"]
    assert store_modules("/tmp/st") == store_modules("file:///tmp/st") == []
    assert store_modules("gs://bucket/st") == ["gcsfs"]  # installed here or not: fsspec's name
    assert store_modules("nosuchproto://bucket/st") == []  # opening it says what is wrong
    hdfs = store_modules("hdfs://nn:8020/st")
    try:
        import hdfs_native  # noqa: F401 - the client this machine would use
        assert hdfs == ["hdfs_native"]
    except ImportError:  # fsspec's own (pyarrow's libhdfs): nothing more to check
        assert hdfs == []
    yarn = fix_for("yarn", False, example="/usr/bin/python3")
    assert "--archives env.tar.gz#environment" in yarn and "sparktrain[cluster,torch]" in yarn
    assert "spark.pyspark.python=./environment/bin/python" in yarn
    assert "PYSPARK_PYTHON=" not in yarn  # a driver's path means nothing in YARN's containers
    assert "spark.kubernetes.container.image" in fix_for("k8s://https://api:443", False)
    for manager in ("local[2]", "spark://host:7077"):
        assert "PYSPARK_PYTHON=/usr/bin/python3" in fix_for(manager, False, "has them",
                                                            "/usr/bin/python3")
    assert "Spark Connect server" in fix_for("local[2]", True)


def test_version_differences_are_one_warning(spark, caplog):
    here = {"python": sys.executable, "version": "3.11.7",
            "versions": {"cloudpickle": "3.1.2", "sparktrain": "0.4.0", "torch": "2.13.0"}}
    executors = {"python": "/opt/py/bin/python", "version": "3.11.2",
                 "versions": {"cloudpickle": "3.0.0", "sparktrain": "0.4.0", "torch": None}}
    caplog.set_level(logging.WARNING, logger="sparktrain")
    _warn_on_version_differences(spark, here, executors)
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "WARNING"
    message = caplog.records[0].getMessage()
    assert "the executors' Python (/opt/py/bin/python) differs from this client's: " \
           "cloudpickle 3.1.2 here, 3.0.0 on the executors." in message
    assert "Python 3.11" not in message and "torch" not in message  # same minor; unknown


SCRIPT = """
import json, sys, time
import torch
from pyspark.ml.linalg import Vectors
from sparktrain import TorchEstimator, TrainingError, local_spark

spark = local_spark("local[2]", conf={"spark.ui.enabled": "false"})
df = spark.createDataFrame([(Vectors.dense([float(i), 1.0]), float(i)) for i in range(40)],
                           ["features", "label"])
df.count()  # the session has run a job before fit, as a user's has
net = torch.nn.Linear(2, 1)
est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                     loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                     epochs=1, store=sys.argv[1], verbose=0)
started = time.perf_counter()
try:
    est.fit(df)
    found = {"error": None}
except Exception as exc:
    found = {"error": type(exc).__name__, "training_error": isinstance(exc, TrainingError),
             "message": str(exc), "python": getattr(exc, "python", None),
             "missing": getattr(exc, "missing", None)}
found["seconds"] = time.perf_counter() - started
print(json.dumps(found))
"""


def _bare_python(where) -> str:
    """A virtual environment of this interpreter's base Python with no packages at all."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = os.path.join(str(where), "bin", "python")
    probe = subprocess.run([python, "-c", "import pandas"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"the base Python {base} has pandas: no bare Python to test with")
    return python


@pytest.mark.full
def test_executors_without_the_packages_fail_the_fit_at_once(tmp_path):
    """PYSPARK_PYTHON points at a Python without pandas, torch or sparktrain: fit fails on the
    first attempt, within seconds, naming the modules, that Python and the fix."""
    bare = _bare_python(tmp_path / "bare")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYSPARK_PYTHON=bare, SPARKTRAIN_SPARK_LOG_LEVEL="ERROR")
    # cwd: not the repository, so sparktrain is not importable on the executors either
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(found)
    assert found["error"] == "ExecutorEnvironmentError" and found["training_error"]
    assert found["python"] == bare
    assert found["missing"] == ["pandas", "pyarrow", "numpy", "cloudpickle", "fsspec",
                                "sparktrain", "torch", "psutil"]
    message = found["message"]
    assert f"The executors' Python ({bare}, Python " in message
    assert "cannot find pandas, pyarrow" in message
    assert "TorchEstimator(backend='torch', store=" in message
    assert "PYSPARK_PYTHON" in message and "spark.pyspark.python" in message
    assert f"PYSPARK_PYTHON={sys.executable}" in message  # the driver's Python has them all
    # at once: one failed check, no task attempts (before: 4 attempts, naming nothing). A loose
    # bound only: 17 s was measured on a 2-core machine at load 9, 3 s when quiet.
    assert found["seconds"] < 60, found["seconds"]
