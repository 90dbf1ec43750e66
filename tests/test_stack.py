"""What depends on the installed Spark, Arrow and NumPy: run on both tested stacks.

CI runs the whole suite on the primary stack (.venv: pyspark 4, NumPy 2) and the tests marked
``stack`` on the classic one (.venv-spark35: pyspark 3.5, pyarrow 14, NumPy 1.26, Petastorm).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pyarrow
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from sparktrain.data.materialize import materialize, plan_key
from sparktrain.data.schema import training_columns
from sparktrain.data.store import Store
from sparktrain.estimators.persistence import saved_root
from sparktrain.session.slots import slots_from_conf, task_slots
from sparktrain.session.spark_jvm import hadoop_conf, max_concurrent_tasks, remove_path

pytestmark = pytest.mark.stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A user's core packages: sparktrain may state ranges for them, never move them.
CORE = {"pyspark", "numpy", "pyarrow", "pandas", "torch", "tensorflow", "tensorflow-cpu", "keras"}
CLASSIC = Version(pyarrow.__version__) < Version("15")


def _requirements():
    return [Requirement(r) for r in importlib.metadata.requires("sparktrain")]


def test_requirements_are_ranges_that_admit_spark4_and_numpy2():
    requirements = _requirements()
    for req in requirements:
        if req.name.lower() in CORE:
            assert not any(s.operator in ("==", "===", "~=") for s in req.specifier), str(req)
    base = {r.name.lower(): r for r in requirements if r.marker is None}
    assert "petastorm" not in base, "petastorm must stay an optional extra"
    assert base["pyspark"].specifier.contains("4.3.0")
    assert base["pyspark"].specifier.contains("3.5.8")
    assert base["numpy"].specifier.contains("2.4.6") and base["numpy"].specifier.contains("1.26.4")
    assert base["pyarrow"].specifier.contains("26.0.1")
    assert base["pyarrow"].specifier.contains("14.0.2")
    extras = {r.name.lower(): r for r in requirements
              if r.marker is not None and not r.marker.evaluate({"extra": "petastorm"})}
    assert extras["torch"].specifier.contains("2.13.0")
    assert extras["tensorflow-cpu"].specifier.contains("2.21.0")


def _left_out_requirements(tmp_path) -> list:
    """Requirements of installed packages that this environment lacks on purpose, each as a
    wheel of metadata alone under ``tmp_path`` (for a ``--no-index`` resolution only, never
    installed): Triton, which PyPI's CUDA torch requires and ``scripts/setup.sh`` leaves out
    where there is no NVIDIA GPU (it crashes processes that imported TensorFlow first)."""
    import importlib.util
    import zipfile

    made = []
    for dist in importlib.metadata.distributions():
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = requirement.name.lower()
            if name != "triton" or importlib.util.find_spec("triton") is not None \
                    or name in made:
                continue
            version = next(iter(requirement.specifier)).version
            info = f"{name}-{version}.dist-info"
            with zipfile.ZipFile(tmp_path / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\n"
                                                   f"Version: {version}\n")
                wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                                "Root-Is-Purelib: true\nTag: py3-none-any\n")
                wheel.writestr(f"{info}/RECORD", "")
            made.append(name)
    return made


@pytest.mark.timeout(300)
def test_installing_sparktrain_changes_none_of_the_users_packages(tmp_path):
    """``pip install sparktrain[...]`` into this environment (which already holds one tested
    stack) would install sparktrain alone: no package of the user's is upgraded or downgraded.
    ``--no-index``: pip may use only what is installed (and the metadata of what the set-up
    left out on purpose), so anything else fails the test."""
    extras = "torch,tf-cpu,tfos,horovod,plot" + (",petastorm" if CLASSIC else ",connect,mlflow")
    report = tmp_path / "report.json"
    wheels = tmp_path / "left-out"
    wheels.mkdir()
    left_out = _left_out_requirements(wheels)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "--quiet", "--find-links", str(wheels),
         "--report", str(report), f"{ROOT}[{extras}]"],
        capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert set(planned) - set(left_out) == {"sparktrain"}, planned


def _values(spark, values):
    """A local relation (``VALUES``: the data sits in the plan itself)."""
    rows = ", ".join(f"({float(v)}, {2.0 * v})" for v in values)
    return spark.sql(f"SELECT * FROM VALUES {rows} AS t(x, y)")


def test_plan_key_is_equal_for_the_same_plan_and_differs_for_other_data(spark, tmp_path):
    columns = training_columns(_values(spark, [0]), ["x"], ["y"])

    def key(df, validation=None):
        return plan_key(df, columns, validation, seed=1)

    def ranged(n):
        return spark.range(n).selectExpr("CAST(id AS DOUBLE) AS x", "2.0 * id AS y")

    base = ranged(50)
    assert key(base) == key(base) == key(ranged(50))      # the same plan, built twice
    assert key(base) != key(ranged(51))
    assert key(base) != key(base.limit(10))
    assert key(base) != key(base.filter("x > 3"))
    assert key(base) != key(base, validation=0.2)
    local = _values(spark, range(20))
    assert key(local) == key(_values(spark, range(20)))   # the same local data, built twice
    assert key(local) != key(_values(spark, [*range(19), 99]))  # one value differs
    # a frame made from Python objects is a new RDD each time: equal only to itself
    made = spark.createDataFrame([(1.0, 2.0)], "x double, y double")
    assert key(made) == key(made) != key(spark.createDataFrame([(1.0, 2.0)], "x double, y double"))

    path = str(tmp_path / "source")
    base.write.parquet(path)
    on_disk = spark.read.parquet(path)
    assert key(on_disk) == key(spark.read.parquet(path))  # the same files read twice
    assert key(on_disk) != key(base)
    ranged(60).write.mode("overwrite").parquet(path)
    assert key(spark.read.parquet(path)) != key(on_disk)  # rewritten: other files


def test_spark_jvm_calls(spark, tmp_path):
    sc = spark.sparkContext
    assert max_concurrent_tasks(sc) == 2  # local[2]
    assert task_slots(spark) == slots_from_conf(spark) == 2  # the JVM and the conf agree
    assert hadoop_conf(sc, "fs.defaultFS").startswith("file:")
    assert hadoop_conf(sc, "sparktrain.no.such.key") is None
    # where Spark put a saved model's metadata, qualified (a relative path: Spark's working
    # directory, which is this process's as long as nothing changed it)
    relative = f"build/saved model {uuid.uuid4().hex[:6]}"
    for path, expected in ((relative, os.path.join(os.getcwd(), relative)),
                           (str(tmp_path / "absolute"), str(tmp_path / "absolute"))):
        spark.createDataFrame([("{}",)], "value string").write.text(f"{path}/metadata")
        assert saved_root(spark, path) == expected
        remove_path(spark, path)
        assert not os.path.exists(expected)


def _read_pyarrow(path):
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return np.array(table["features"].to_pylist(), dtype=np.float32), table["label"].to_numpy()


def _read_petastorm(path):
    from petastorm import make_batch_reader

    features, labels = [], []
    with make_batch_reader("file://" + path, num_epochs=1, workers_count=2) as reader:
        for batch in reader:
            features.extend(np.asarray(f, dtype=np.float32) for f in batch.features)
            labels.extend(batch.label)
    return np.array(features), np.array(labels)


@pytest.mark.parametrize("reader", ["pyarrow", "petastorm"])
def test_materialized_rows_read_back_with_their_values(spark, tmp_path, regression_df, reader):
    """Every row that sparktrain materializes is read back once, with its values, by a plain
    ``pyarrow.parquet`` reader (what a user writes on any stack) and by Petastorm's
    ``make_batch_reader`` (classic stack only: Petastorm cannot import with pyarrow >= 15)."""
    if reader == "petastorm" and not CLASSIC:
        pytest.skip(f"Petastorm imports pyarrow.filesystem, gone in pyarrow {pyarrow.__version__} "
                    f"(this reader is checked on the classic stack)")
    read = {"pyarrow": _read_pyarrow, "petastorm": _read_petastorm}[reader]
    store = Store.create(str(tmp_path))
    columns = training_columns(regression_df, ["features"], ["label"])
    dataset = materialize(regression_df, store, columns, validation="is_val")
    parts = [read(dataset.path(split)) for split in ("train", "val")]
    features = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    assert len(labels) == dataset.train_rows + dataset.val_rows == 2000

    source = regression_df.toPandas()
    expected_features = np.array([v.toArray() for v in source["features"]], dtype=np.float32)
    expected_labels = source["label"].to_numpy(dtype=np.float32)
    order = np.argsort(labels, kind="stable")
    expected_order = np.argsort(expected_labels, kind="stable")
    np.testing.assert_array_equal(labels[order], expected_labels[expected_order])
    np.testing.assert_array_equal(features[order], expected_features[expected_order])
