"""Progress off a terminal (``spark-submit`` on YARN, stderr sent to a file): lines, never a
bar's carriage-return redraws. The terminal bar itself is tested in test_observability.py.

Full tier: test_fit_logging_to_a_file_has_lines_and_no_bar. Only it runs a fit in a process
whose stderr is a file, so only it catches an estimator that does not hand its real stream to
FitProgress, ranks' epoch lines that do not reach that file, or anything in the fit (Spark's
output included) writing a carriage return; the quick tests drive FitProgress on a StringIO."""
from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from sparktrain.estimators.progress import FitProgress, draws_bar, interval_from_conf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_progress_off_a_terminal_is_lines(caplog):
    log_file = io.StringIO()  # stderr redirected to a file: not a terminal
    assert not draws_bar(log_file)
    caplog.set_level(logging.INFO, logger="sparktrain")
    progress = FitProgress(verbose=1, stream=log_file, interval=0.5)
    assert progress.lines

    def lines():
        return [r.getMessage() for r in caplog.records
                if r.name == "sparktrain.estimators.progress"]

    progress.update({"event": "start", "epochs": 3, "steps": 10})
    progress.update({"event": "step", "epoch": 0, "step": 2, "loss": 0.5})
    assert lines() == []  # within the interval: nothing yet
    time.sleep(0.6)
    progress.update({"event": "step", "epoch": 0, "step": 5, "loss": 0.25})
    progress.update({"event": "step", "epoch": 0, "step": 6, "loss": 0.25})  # just printed
    assert len(lines()) == 1
    assert re.fullmatch(r"epoch 1/3  step 5/10 \(50%\)  loss=0\.25  [\d.]+ steps/s  "
                        r"epoch ETA \d+s", lines()[0]), lines()
    progress.update({"event": "epoch", "epoch": 0, "logs": {"loss": 0.2}})  # rank 0 logs it
    time.sleep(0.6)
    progress.update({"event": "step", "epoch": 1, "step": 1, "loss": 0.2})
    assert lines()[-1].startswith("epoch 2/3  step 1/10 (10%)  loss=0.2  ")
    # a retried attempt resumes from its checkpoint after epoch 2: the lines follow it
    progress.update({"event": "start", "epochs": 3, "steps": 10, "first": 2})
    time.sleep(0.6)
    progress.update({"event": "step", "epoch": 2, "step": 4, "loss": 0.1})
    assert lines()[-1].startswith("epoch 3/3  step 4/10 (40%)  loss=0.1  ")
    progress.close()
    assert len(lines()) == 3 and log_file.getvalue() == ""  # no bar was drawn

    quiet = FitProgress(verbose=1, stream=log_file, interval=0)  # 0: no periodic lines
    quiet.update({"event": "start", "epochs": 1, "steps": 10})
    time.sleep(0.01)
    quiet.update({"event": "step", "epoch": 0, "step": 5, "loss": 0.1})
    assert len(lines()) == 3


def test_progress_interval_comes_from_the_spark_conf(spark):
    assert interval_from_conf(spark) == 60.0
    spark.conf.set("spark.sparktrain.progressIntervalSeconds", "2.5")
    try:
        assert interval_from_conf(spark) == 2.5
        spark.conf.set("spark.sparktrain.progressIntervalSeconds", "often")
        try:
            interval_from_conf(spark)
            raise AssertionError("a non-number was accepted")
        except ValueError as error:
            assert "spark.sparktrain.progressIntervalSeconds='often'" in str(error)
    finally:
        spark.conf.unset("spark.sparktrain.progressIntervalSeconds")


SCRIPT = """
import sys, time
import torch
from pyspark.ml.linalg import Vectors
from sparktrain import TorchEstimator, local_spark

spark = local_spark("local[2]", conf={"spark.ui.enabled": "false",
                                      "spark.sparktrain.progressIntervalSeconds": "0.3"})
df = spark.createDataFrame([(Vectors.dense([float(i % 7), 1.0]), float(i % 7))
                            for i in range(400)], ["features", "label"])


def slow(batch):  # about 2 s per epoch: long enough for periodic lines
    time.sleep(0.08)
    return batch


net = torch.nn.Linear(2, 1)
TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
               loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
               batch_size=8, epochs=2, transformation_fn=slow, store=sys.argv[1],
               verbose=1).fit(df)
print("done")
"""


@pytest.mark.full
def test_fit_logging_to_a_file_has_lines_and_no_bar(tmp_path):
    """A real 2-rank fit with verbose=1 and stderr sent to a file, as spark-submit on YARN."""
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    log_path = tmp_path / "stderr.log"
    with open(log_path, "w") as stderr:
        result = subprocess.run([sys.executable, str(script), str(tmp_path / "store")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                timeout=300)
    log = log_path.read_text()
    assert result.returncode == 0 and result.stdout.strip() == "done", log[-4000:]
    assert "\r" not in log  # the bar's redraws (57 in a 6-epoch fit before)
    assert "[sparktrain] [rank 0] epoch 1/2  loss=" in log  # one line per epoch
    assert "[sparktrain] [rank 0] epoch 2/2  loss=" in log
    periodic = re.findall(r"\[sparktrain\] epoch [12]/2  step \d+/25 \(\d+%\)  loss=\S+  "
                          r"\S+ steps/s  epoch ETA \S+", log)
    assert periodic, log[-4000:]
