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
    if deploy_mode == "cluster":  # the driver runs in the ApplicationMaster's container
        command += ["--conf", f"spark.yarn.appMasterEnv.PYSPARK_PYTHON={sys.executable}",
                    "--driver-memory", "768m"]
    env = dict(os.environ, **hadoop.env(), PYSPARK_PYTHON=sys.executable)
    env.pop("JAVA_TOOL_OPTIONS", None)  # the tests' JVM flags are for local Spark
    return subprocess.run(command + args, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


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


def test_spark_submit_client_mode_trains_from_hdfs_into_an_hdfs_store(hadoop, digits_on_hdfs):
    """`spark-submit --master yarn --deploy-mode client jobs/train_torch.py` with hdfs://
    input, store and model: the job checks accuracy >= 0.9 and that the model it saved on HDFS
    and loaded back predicts the same."""
    import fsspec

    done = _spark_submit(hadoop, "client", _job_args(hadoop, digits_on_hdfs, "client"))
    tail = done.stdout[-3000:] + _errors(done.stderr)
    assert done.returncode == 0, tail
    found = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert found["test_accuracy"] >= 0.9 and found["model_path"].startswith("hdfs://"), found
    fs, store = fsspec.core.url_to_fs(f"{hadoop.hdfs}/user/sparktrain/client-store")
    names = [p.rsplit("/", 1)[-1] for p in fs.find(store)]
    assert any(n.endswith(".ckpt") for n in names), names  # checkpoints on HDFS, from rank 0
    assert any(n.endswith(".parquet") for n in names), names  # the dataset the ranks read
