"""sparktrain on a real YARN with its data and store on a real HDFS: Hadoop's mini clusters
(tests/support/hadoop.py: a MiniDFSCluster and a MiniYARNCluster with 2 NodeManagers, in a JVM
of their own), `spark-submit` of jobs/train_torch.py as users run it, and a notebook-style
client session. The executors run in YARN containers on this machine, so their Python is this
venv's (``spark.pyspark.python``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.hadoop import MiniHadoop, available, yarn_conf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hadoop(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(why)
    pytest.importorskip("hdfs_native", reason="needs sparktrain[hdfs]: setup.sh --hadoop")
    from sparktrain import fork_safety

    fork_safety.install()  # this process's own HDFS clients (fsspec's, below) fork safely too
    with MiniHadoop(str(tmp_path_factory.mktemp("hadoop")), node_managers=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def digits_on_hdfs(hadoop):
    """scikit-learn's digits as a Parquet table on HDFS: ``(its URL, the feature columns)``."""
    import fsspec
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    columns = [f"pixel_{i}" for i in range(digits.data.shape[1])]
    frame = pd.DataFrame(digits.data.astype("float64"), columns=columns)
    frame["label"] = digits.target.astype("int64")
    url = f"{hadoop.hdfs}/data/digits.parquet"
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/part-0.parquet", "wb") as f:
        frame.to_parquet(f, index=False)
    return url, columns


def _spark_submit(hadoop, deploy_mode: str, args, timeout: int = 600):
    conf = yarn_conf(hadoop)
    command = [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", "yarn",
               "--deploy-mode", deploy_mode]
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    if deploy_mode == "cluster":  # the driver runs in the ApplicationMaster's container,
        # with the job's script only: the `jobs` package it imports goes as --py-files
        command += ["--conf", f"spark.yarn.appMasterEnv.PYSPARK_PYTHON={sys.executable}",
                    "--driver-memory", "768m", "--py-files", _jobs_zip(hadoop.workdir)]
    env = dict(os.environ, **hadoop.env(), PYSPARK_PYTHON=sys.executable)
    env.pop("JAVA_TOOL_OPTIONS", None)  # the tests' JVM flags are for local Spark
    return subprocess.run(command + args, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def _jobs_zip(folder: str) -> str:
    """The ``jobs`` package (its ``common`` module) as a zip for ``--py-files``."""
    import zipfile

    path = os.path.join(folder, "jobs.zip")
    with zipfile.ZipFile(path, "w") as archive:
        for name in ("__init__.py", "common.py"):
            archive.write(os.path.join(ROOT, "jobs", name), f"jobs/{name}")
    return path


def _errors(stderr: str) -> str:
    """The lines of a Spark driver's log that say what went wrong (not its INFO lines)."""
    keep = [line for line in stderr.splitlines() if not line.lstrip().startswith("at ")
            and " INFO " not in line]
    return "\n".join(keep)[-8000:]


def _job_args(hadoop, digits, name: str):
    url, columns = digits
    return [os.path.join(ROOT, "jobs", "train_torch.py"), "--input", url,
            "--feature-cols", ",".join(columns), "--label-col", "label",
            "--task", "classification", "--num-proc", "2", "--epochs", "12",
            "--store", f"{hadoop.hdfs}/user/sparktrain/{name}-store",
            "--output", f"{hadoop.hdfs}/models/{name}", "--min-accuracy", "0.9"]


@pytest.fixture(scope="module")
def trained(hadoop, digits_on_hdfs):
    """`spark-submit --master yarn --deploy-mode client jobs/train_torch.py`, hdfs:// input,
    store and model: ``(the finished process, the model's URL)``."""
    return (_spark_submit(hadoop, "client", _job_args(hadoop, digits_on_hdfs, "client")),
            f"{hadoop.hdfs}/models/client")


def test_spark_submit_client_mode_trains_from_hdfs_into_an_hdfs_store(hadoop, trained):
    """The job checks accuracy >= 0.9 and that the model it saved on HDFS and loaded back
    predicts the same; its store on HDFS holds the dataset and the checkpoints."""
    import fsspec

    done, _ = trained
    assert done.returncode == 0, done.stdout[-3000:] + _errors(done.stderr)
    found = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert found["test_accuracy"] >= 0.9 and found["model_path"].startswith("hdfs://"), found
    fs, store = fsspec.core.url_to_fs(f"{hadoop.hdfs}/user/sparktrain/client-store")
    names = [p.rsplit("/", 1)[-1] for p in fs.find(store)]
    assert any(n.endswith(".ckpt") for n in names), names  # checkpoints on HDFS, from rank 0
    assert any(n.endswith(".parquet") for n in names), names  # the dataset the ranks read


def test_spark_submit_cluster_mode_predicts_with_the_model_on_hdfs(hadoop, digits_on_hdfs,
                                                                   trained):
    """A second job, its driver in YARN's ApplicationMaster container (cluster mode), loads the
    model from HDFS and writes its predictions there."""
    import fsspec
    import numpy as np
    import pyarrow.parquet as pq

    done, model = trained
    assert done.returncode == 0, "the training job failed: see the test above"
    url, _ = digits_on_hdfs
    output = f"{hadoop.hdfs}/predictions/digits"
    scored = _spark_submit(hadoop, "cluster", [
        os.path.join(ROOT, "jobs", "predict.py"), "--model", model, "--input", url,
        "--output", output, "--label-col", "label", "--min-accuracy", "0.9"])
    assert scored.returncode == 0, _errors(scored.stderr)  # the app's final status
    fs, path = fsspec.core.url_to_fs(output)
    table = pq.read_table(path, filesystem=fs, columns=["label", "label__output"])
    logits = np.array(table.column("label__output").to_pylist())
    labels = table.column("label").to_numpy()
    assert len(labels) == 1797 and (logits.argmax(axis=1) == labels).mean() >= 0.9


def test_a_notebook_session_on_yarn_fits_a_stream(hadoop):
    """`SparkSession.builder.master("yarn")` in client mode, as a notebook on an edge node:
    a streamed fit (no dataset written) with its store on HDFS learns and predicts."""
    # a Python session takes its executors' Python from PYSPARK_PYTHON, not from the
    # spark.pyspark.python of its builder (pyspark's SparkContext reads the variable)
    env = dict(os.environ, **hadoop.env(), PYSPARK_PYTHON=sys.executable)
    env.pop("JAVA_TOOL_OPTIONS", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "support", "yarn_client.py"),
                           hadoop.hdfs, json.dumps(yarn_conf(hadoop))], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + _errors(done.stderr)
    found = json.loads(lines[0][len("RESULT "):])
    print(found)
    loss = found["history"]
    assert len(loss) == 4 and loss[-1] < loss[0] / 4 and found["predicted"] == 2000, found
    too_many = found["too_many"]  # preflight's answer to 5 ranks on 2 one-core executors
    assert "num_proc=5 needs 5 task slots" in too_many and "master yarn" in too_many, too_many
    assert "spark.executor.instances (now 2)" in too_many, too_many
    assert "spark.yarn.queue" in too_many and "spark.executor.memory (now 640m)" in too_many


FORK_AFTER_HDFS = """
import os, subprocess, sys
from sparktrain.fs import filesystem  # its first filesystem installs sparktrain's fork hooks:
fs, path = filesystem(sys.argv[1] + "/")  # without them both forks below hang for ever
fs.ls(path)  # an hdfs-native client, its runtime's threads running
subprocess.run(["true"], preexec_fn=lambda: None, check=True)  # as pyspark starts its JVM
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child's interpreter finalizes: it drops what it inherited
assert os.waitpid(pid, 0)[1] == 0
print("FORKED", flush=True)
"""


def test_a_process_that_used_hdfs_can_fork(hadoop):
    """fsspec empties its filesystem cache in a forked child; dropping hdfs-native's client
    there waited for ever for threads the child does not have (sparktrain/fork_safety.py).
    That hung this suite's next SparkSession after the HDFS tests."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", FORK_AFTER_HDFS, hadoop.hdfs],
                             stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        out, _ = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        pytest.fail("a fork after using HDFS hung")
    assert child.returncode == 0 and "FORKED" in out
