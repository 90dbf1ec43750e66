"""One real SparkSession (local[2]: two barrier slots) shared by the whole test session."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sparktrain.session.jvm_archive import java_options  # noqa: E402 - after the path
from support import durations, scheduling  # noqa: E402 - after sys.path is set

# one standalone cluster, Connect server and MLflow server per pytest worker, for every file
from support.servers import connect_server, mlflow_server, standalone, standalone_cluster  # noqa: E402,F401 - fixtures, after the path

# and one slot host (a local[4] driver in a process of its own) for scenarios needing other slots
from support.slot_host import slot_host  # noqa: E402,F401 - a fixture, after the path

# Every JVM the tests start (Spark drivers and executors, Connect servers, standalone Masters
# and Workers) compiles with C1 only: they live seconds to minutes on tiny data, and C2's
# compiler threads were most of their CPU. Measured: a local[2] session running a few small
# jobs used 16 CPU-s by default and 9.7 CPU-s with this (the suite is CPU-bound on 2 cores).
# They also map Spark's classes from the class-data sharing archive `scripts/setup.sh` built
# (sparktrain/session/jvm_archive.py) rather than loading them from the jars: ~3.5 CPU-s less
# per JVM again. A JVM with another class path (spark-submit's launcher) goes on without it.
os.environ.setdefault("JAVA_TOOL_OPTIONS", f"-XX:TieredStopAtLevel=1 {java_options()}".strip())

# pytest-xdist hands whole files (`--dist loadfile`) to whichever worker is free, in collection
# order (`--no-loadscope-reorder` in pytest.ini; its default orders files by test count), and
# the files sharing a server as one unit (tests/support/scheduling.py: each server starts once
# per run): the longest units go first and the short ones fill the gaps at the end, so no
# worker is left alone with a long file while the other idles (longest-processing-time-first).
# The seconds per file come from tests/durations.json (a 2-worker run on 2 cores;
# tests/support/durations.py refreshes it from a `--durations=0` report). Files it does not
# list count as short.
FILE_SECONDS = durations.load()
UNIT_SECONDS = scheduling.unit_seconds(FILE_SECONDS)


def pytest_xdist_make_scheduler(config, log):
    return scheduling.make_scheduler(config, log)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full suite: the quick tier and the tests marked `full` "
                          "(clusters, YARN and HDFS, S3, Spark Connect, the jobs, TFoS, MLflow)")


def pytest_collection_modifyitems(session, config, items):
    """The tier (without ``--full`` the tests marked ``full`` are deselected: the quick tier),
    then the longest units first (see ``UNIT_SECONDS``), a unit's files together."""
    if not config.getoption("--full"):
        full = [item for item in items if item.get_closest_marker("full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    def order(item):
        name = os.path.basename(str(item.path))
        unit = scheduling.unit_of(name)
        return -UNIT_SECONDS.get(unit, 0), unit, -FILE_SECONDS.get(name, 0), name

    items.sort(key=order)  # stable: the order inside a file is kept


@pytest.fixture(scope="session")
def spark():
    from sparktrain import local_spark

    session = local_spark("local[2]", app_name="sparktrain-tests", conf={
        "spark.sparktrain.slotWaitSeconds": "1",
        "spark.default.parallelism": "2",
        "spark.stage.maxConsecutiveAttempts": "3",  # Spark retries a failed training stage
    })
    yield session
    session.stop()


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a new tmpfs of ``size`` ("8m") mounted under ``tmp_path`` (a real disk
    that fills up; needs root, as CI runs) and unmounted after the test; ``tmpfs.resize(path,
    size)`` gives one more room, as a user freeing space would."""
    import subprocess

    mounted = []

    def mount(size: str):
        folder = tmp_path / f"tmpfs-{len(mounted)}"
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(folder)
        return folder

    def resize(folder, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)

    mount.resize = resize
    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """A store shared by the session, so tests reusing a DataFrame reuse its materialization."""
    return str(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="session")
def regression_df(spark):
    """2000 rows: y = x . w + 0.5 + N(0, 0.1^2), features as a vector column."""
    import numpy as np
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5 + 0.1 * rng.normal(size=2000)
    rows = [(Vectors.dense(a.tolist()), float(b), int(i % 5 == 0))
            for i, (a, b) in enumerate(zip(x, y, strict=True))]
    df = spark.createDataFrame(rows, ["features", "label", "is_val"]).repartition(3)
    df = df.withColumn("is_val", df["is_val"].cast("boolean")).cache()
    df.count()
    return df


@pytest.fixture(scope="session")
def classification_df(spark):
    """600 rows, 3 well separated classes, features as array<double>, integer labels."""
    import numpy as np

    rng = np.random.default_rng(1)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
    labels = rng.integers(0, 3, size=600)
    x = centers[labels] + 0.4 * rng.normal(size=(600, 2))
    df = spark.createDataFrame([(a.tolist(), int(b)) for a, b in zip(x, labels, strict=True)],
                               "features array<double>, label int").cache()
    df.count()
    return df
