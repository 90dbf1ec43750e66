"""sparktrain on a real YARN with its data and store on a real HDFS: Hadoop's mini clusters
(tests/support/hadoop.py: a MiniDFSCluster and a MiniYARNCluster with 2 NodeManagers, in a JVM
of their own), `spark-submit` of jobs/train_torch.py as users run it, and a notebook-style
client session. Only this file catches what YARN and HDFS change: containers that get their
Python from a shipped archive, ``hdfs://`` stores and models, YARN's GPUs, and a lost
container or NodeManager under a fit.

An ``hdfs:///`` store from a driver whose processes have no HADOOP_CONF_DIR (local mode).

Three YARN applications: the cluster-mode training job; the GPU session; and one client-mode
``spark-submit --archives`` whose driver runs the predict job, then the notebook's fits and
the faults (tests/support/yarn_client.py), its executors' Python the shipped environment's.
The environment is built once per content (tests/support/job_env.py: ~/.cache/sparktrain)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.hadoop import MiniHadoop, available, container_log, yarn_conf
from support.job_env import cached_environment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
pytestmark = [pytest.mark.full, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hadoop(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(why)
    pytest.importorskip("hdfs_native", reason="needs sparktrain[hdfs]: setup.sh --hadoop")
    from sparktrain import fork_safety

    fork_safety.install()  # this process's own HDFS clients (fsspec's, below) fork safely too
    with MiniHadoop(str(tmp_path_factory.mktemp("hadoop")), node_managers=2, gpus=2) as cluster:
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


@pytest.fixture(scope="module")
def environment():
    """The job's Python environment packed by venv-pack2 (tests/support/job_env.py), built
    once per content of sparktrain and its packaging and kept in ~/.cache/sparktrain."""
    return cached_environment()


def _spark_submit(hadoop, deploy_mode: str, args, timeout: int = 600, archive: str = ""):
    """spark-submit on the mini YARN cluster; with ``archive``, the Python of the driver (in
    cluster mode) and of the executors is the one it holds, as docs/yarn-and-hdfs.md says."""
    python = "./environment/bin/python" if archive else sys.executable
    command = [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", "yarn",
               "--deploy-mode", deploy_mode]
    for key, value in yarn_conf(hadoop, python=python).items():
        command += ["--conf", f"{key}={value}"]
    if archive:
        command += ["--archives", f"{archive}#environment"]
        if deploy_mode == "client":  # the driver runs here, with this machine's Python
            command += ["--conf", f"spark.pyspark.driver.python={sys.executable}"]
    if deploy_mode == "cluster":  # the driver runs in the ApplicationMaster's container,
        # with the job's script only: the `jobs` package it imports goes as --py-files
        command += ["--conf", f"spark.yarn.appMasterEnv.PYSPARK_PYTHON={python}",
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
            "--task", "classification", "--num-proc", "2", "--epochs", "10",
            "--store", f"{hadoop.hdfs}/user/sparktrain/{name}-store",
            "--output", f"{hadoop.hdfs}/models/{name}", "--min-accuracy", "0.9"]


def _app_id(done) -> str:
    """The YARN application a finished spark-submit ran."""
    import re

    found = re.findall(r"application_\d+_\d+", done.stderr)
    assert found, _errors(done.stderr)
    return found[-1]


@pytest.fixture(scope="module")
def trained(hadoop, digits_on_hdfs, environment):
    """`spark-submit --master yarn --deploy-mode cluster --archives env.tar.gz#environment
    jobs/train_torch.py`, hdfs:// input, store and model: ``(the finished process, the
    model's URL)``."""
    return (_spark_submit(hadoop, "cluster", _job_args(hadoop, digits_on_hdfs, "cluster"),
                          archive=environment), f"{hadoop.hdfs}/models/cluster")


def test_spark_submit_cluster_mode_trains_from_hdfs_into_an_hdfs_store(hadoop, trained):
    """The job, its driver in YARN's ApplicationMaster container and every Python in the
    shipped environment, checks accuracy >= 0.9 and that the model it saved on HDFS and loaded
    back predicts the same; its store on HDFS holds the dataset and the checkpoints."""
    import fsspec

    done, _ = trained
    assert done.returncode == 0, _errors(done.stderr)  # the app's final status: SUCCEEDED
    driver = container_log(hadoop.workdir, _app_id(done))  # as `yarn logs` shows it
    found = json.loads([line for line in driver.splitlines() if line.startswith("{")][-1])
    assert found["test_accuracy"] >= 0.9 and found["model_path"].startswith("hdfs://"), found
    # sparktrain came from the archive: the tests' venv has it only as an editable install
    assert "/environment/lib/" in found["sparktrain"], found
    fs, store = fsspec.core.url_to_fs(f"{hadoop.hdfs}/user/sparktrain/cluster-store")
    names = [p.rsplit("/", 1)[-1] for p in fs.find(store)]
    assert any(n.endswith(".ckpt") for n in names), names  # checkpoints on HDFS, from rank 0
    assert any(n.endswith(".parquet") for n in names), names  # the dataset the ranks read


def _result(done) -> dict:
    """What a client script (tests/support/NAME.py) printed after ``RESULT``."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + _errors(done.stderr)
    found = json.loads(lines[0][len("RESULT "):])
    print(json.dumps(found, indent=1))
    return found


def _client_script(hadoop, name: str, *args: str) -> dict:
    """Run tests/support/NAME.py, a Python session on YARN in client mode (as a notebook on an
    edge node), and return what it printed after ``RESULT``."""
    # a Python session takes its executors' Python from PYSPARK_PYTHON, not from the
    # spark.pyspark.python of its builder (pyspark's SparkContext reads the variable)
    env = dict(os.environ, **hadoop.env(), PYSPARK_PYTHON=sys.executable)
    env.pop("JAVA_TOOL_OPTIONS", None)
    return _result(subprocess.run(
        [sys.executable, os.path.join(HERE, "support", f"{name}.py"), *args,
         json.dumps(yarn_conf(hadoop))], capture_output=True, text=True, timeout=840, cwd=ROOT,
        env=env))


def test_gpus_on_yarn_are_allocated_by_yarn_and_a_whole_one_given_to_each_rank(hadoop):
    """tests/support/yarn_gpus.py: YARN allocates a yarn.io/gpu to each executor's container;
    ETL tasks share a GPU (amount 0.5) while the training stage gets one per rank (stage-level
    scheduling on YARN, Spark >= 3.5.1). (Before the client-mode application, whose last
    fault stops a NodeManager for good.)"""
    import re

    found = _client_script(hadoop, "yarn_gpus", hadoop.conf_dir, hadoop.hdfs)
    assert sum(found["allocated"]) == 2, found  # one per executor, none for the AM
    etl = found["etl"]
    assert all(gpus == ["0"] for gpus, _, _ in etl), etl
    shared = [(a, b) for i, a in enumerate(etl) for b in etl[i + 1:]
              if a[1] < b[2] and b[1] < a[2]]
    assert shared, f"no two tasks ran at once: {etl}"
    lines = "\n".join(found["lines"])
    assert "the training stage asks for 1 GPU and 2 CPU(s) per rank" in lines, lines
    ranks = re.findall(r"\[rank (\d+)\] GPU 0 \(", lines)  # its task's GPU, its ordinal
    assert sorted(ranks) == ["0", "1"], lines
    assert found["loss"][-1] < found["loss"][0] / 2, found


PREDICTIONS = "/predictions/digits"


@pytest.fixture(scope="module")
def edge_node(hadoop, digits_on_hdfs, trained, environment):
    """One client-mode application for the predict job and the notebook: `spark-submit
    --deploy-mode client --archives env.tar.gz#environment tests/support/yarn_client.py`, its
    driver here with this venv's Python, its executors' Python the shipped environment's. It
    runs jobs/predict.py's ``main`` with the model the cluster-mode job saved, then the
    notebook's fits, then the faults of tests/support/yarn_faults.py (the last stops a
    NodeManager for good, so this fixture comes after the other YARN tests in this module).
    What yarn_client.py found, and ``returncode``: spark-submit's exit status."""
    url, _ = digits_on_hdfs
    _, model = trained
    predict = ["--model", model, "--input", url, "--output", f"{hadoop.hdfs}{PREDICTIONS}",
               "--label-col", "label", "--min-accuracy", "0.9"]
    python = "./environment/bin/python"  # the builder's settings name the archive's too
    done = _spark_submit(hadoop, "client", [
        os.path.join(HERE, "support", "yarn_client.py"), hadoop.workdir, hadoop.hdfs,
        json.dumps(yarn_conf(hadoop, python=python)), json.dumps(predict)],
        timeout=840, archive=environment)
    return {**_result(done), "returncode": done.returncode, "errors": _errors(done.stderr)}


def test_spark_submit_client_mode_predicts_with_the_model_on_hdfs(hadoop, trained, edge_node):
    """A second job, its driver here (client mode, this venv's Python) and its executors'
    Python the shipped environment's, loads the model from HDFS and writes its predictions
    there (jobs/predict.py, first in the edge node's application)."""
    import fsspec
    import numpy as np
    import pyarrow.parquet as pq

    done, _ = trained
    assert done.returncode == 0, "the training job failed: see the test above"
    scored = edge_node["predict"]
    assert "error" not in scored, scored["error"]
    assert scored["exit"] == 0, scored  # the predict job's exit status (its --min-accuracy)
    assert edge_node["returncode"] == 0, edge_node["errors"]  # the app's final status
    fs, path = fsspec.core.url_to_fs(f"{hadoop.hdfs}{PREDICTIONS}")
    table = pq.read_table(path, filesystem=fs, columns=["label", "label__output"])
    logits = np.array(table.column("label__output").to_pylist())
    labels = table.column("label").to_numpy()
    assert len(labels) == 1797 and (logits.argmax(axis=1) == labels).mean() >= 0.9


def test_a_notebook_session_on_yarn_fits_a_stream(edge_node):
    """`SparkSession.builder.master("yarn")` in client mode, as a notebook on an edge node
    (in the client-mode application; a session started from plain Python is the GPU test's):
    a streamed fit (no dataset written) with its store on HDFS learns and predicts."""
    loss = edge_node["history"]
    assert len(loss) == 4 and loss[-1] < loss[0] / 4 and edge_node["predicted"] == 2000
    too_many = edge_node["too_many"]  # preflight's answer to 5 ranks on 2 one-core executors
    assert "num_proc=5 needs 5 task slots" in too_many and "master yarn" in too_many, too_many
    assert "spark.executor.instances (now 2)" in too_many, too_many
    assert "spark.yarn.queue" in too_many and "spark.executor.memory (now 1800m)" in too_many


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


# A local driver whose only Hadoop setting is spark.hadoop.fs.defaultFS (no HADOOP_CONF_DIR
# in any process: as YARN's containers and standalone Workers without one) fits into an
# hdfs:/// store; prints RESULT {json}.
RESOLVED_STORE = """
import json, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
import numpy as np
from sparktrain import local_spark
from support.helpers import linear_estimator

spark = local_spark("local[2]", conf={"spark.hadoop.fs.defaultFS": sys.argv[1]})
rng = np.random.default_rng(0)
x = rng.normal(size=(600, 4))
y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y)],
                           "features array<double>, label double")
model = linear_estimator("hdfs:///user/sparktrain/resolved-store", epochs=2, batch_size=50,
                         run_id="resolved").fit(df)
print("RESULT " + json.dumps({"loss": model.getHistory()["loss"]}), flush=True)
"""


def test_an_hdfs_store_without_a_namenode_needs_no_hadoop_conf_dir(hadoop, tmp_path):
    """``hdfs:///p``: the driver resolves it with its own Hadoop settings, so ranks without
    HADOOP_CONF_DIR reach the same HDFS (before: hdfs-native's "No fs.defaultFS setting
    found" in every rank)."""
    import fsspec

    env = {k: v for k, v in os.environ.items() if k not in ("HADOOP_CONF_DIR", "YARN_CONF_DIR")}
    done = subprocess.run([sys.executable, "-c", RESOLVED_STORE, hadoop.hdfs, ROOT],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + _errors(done.stderr)
    loss = json.loads(lines[0][len("RESULT "):])["loss"]
    assert len(loss) == 2 and loss[-1] < loss[0], loss
    fs, path = fsspec.core.url_to_fs(f"{hadoop.hdfs}/user/sparktrain/resolved-store/runs/resolved")
    assert fs.ls(path), "no checkpoint where hdfs:/// resolves to"


def test_faults_on_yarn_are_survived(edge_node):
    """tests/support/yarn_faults.py: a Ctrl-C'd fit resumes from its checkpoint on HDFS, a
    SIGKILLed executor container is replaced and the fit resumes on 2 ranks, and a NodeManager
    stopped for good leaves an elastic fit (``min_num_proc=1``) to finish on the rank left."""
    found = edge_node["faults"]
    assert "error" not in found, found["error"]
    interrupted = found["interrupted"]
    assert interrupted["to_caller_s"] < 30, interrupted
    # the run again resumed from the checkpoint there was at the interrupt, or from the one
    # its ranks finished while they stopped (the epoch in flight: pacing makes it ~1 s)
    resumed = [a["start_epoch"] for a in interrupted["attempts"]]
    epochs = interrupted["checkpoint_epochs"]
    assert resumed[0] == 0 and epochs <= resumed[1] <= epochs + 1 < 4, interrupted
    for name in ("interrupted", "container", "node_manager"):
        fit = found[name]
        loss = fit["history"]["loss"]
        assert loss[-1] < loss[0] / 4 and fit["predicted"] == 1000, (name, fit)
    container = found["container"]
    assert container["killed"]["role"] == "executor", container
    attempts = container["attempts"]  # the first, then Spark's retry resuming on 2 ranks
    assert len(attempts) >= 2 and attempts[0]["attempt"] == 0, container
    assert attempts[-1]["attempt"] >= 1 and attempts[-1]["start_epoch"] >= 1, container
    stopped = found["node_manager"]
    ranks = stopped["history"]["num_proc"]
    assert ranks[0] == 2.0 and ranks[-1] == 1.0 and len(ranks) == 5, stopped
