"""Streamed fits (``input_mode="stream"``) beside other fits and jobs: the way rows reach the
ranks is chosen with the slots other fits and jobs hold, so fits never wait on each other for
ever (``CrossValidator(parallelism=2)``, two threads), and a feeding job that gets no slot
fails the fit within a minute, naming what holds the slots.

Full tier: test_two_threads_each_fit_a_streamed_num_proc_2_on_local_4 and
test_an_epoch_resumed_with_fewer_ranks_trains_exactly_the_rows_left (a local[4] session of their
own, tests/support/local4_fits.py). Only they run multi-rank streamed fits side by side (one fed
from spare slots, one through its training stage) and a fed epoch Ctrl-C'd with 3 ranks and
resumed by 2 through Spark. The quick tier's concurrent streamed fits have one rank each on
local[2], and test_row_feed.py resumes 3 ranks' positions with 2 without Spark."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from sparktrain import TrainingError
from support.helpers import linear_estimator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_cross_validator_parallelism_2_over_streamed_fits_finishes_and_learns(
        spark, regression_df, tmp_path):
    """num_proc=1 on local[2]: each fit alone would feed its rank from the spare slot; two at
    once would each hold a slot with a rank and wait for feeders for ever."""
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    est = linear_estimator(str(tmp_path / "store"), num_proc=1, epochs=2, batch_size=50,
                           input_mode="stream", lr=0.05)
    grid = ParamGridBuilder().addGrid(est.epochs, [2, 6]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=5,
                        parallelism=2, evaluator=RegressionEvaluator(predictionCol="label__output"))
    cv_model = cv.fit(regression_df.select("features", "label"))
    assert cv_model.avgMetrics[1] < cv_model.avgMetrics[0] < 3.0  # learned, and more with more
    assert len(cv_model.bestModel.getHistory()["loss"]) == 6
    assert not os.path.exists(tmp_path / "store" / "datasets")  # streamed: nothing written


def _hold_a_slot(spark, seconds: float, tag: str) -> threading.Thread:
    """A job of one task that holds a task slot for ``seconds`` (tagged ``tag``)."""
    def hold(batches):
        import time as clock

        import pandas as pd

        for _ in batches:
            pass
        clock.sleep(seconds)
        yield pd.DataFrame({"x": [1]})

    def run():
        sc = spark.sparkContext
        sc.addJobTag(tag)
        sc.setInterruptOnCancel(True)
        try:
            spark.range(0, 1, 1, 1).mapInPandas(hold, "x long").collect()
        except Exception:  # noqa: BLE001 - cancelled at the test's end
            pass
        finally:
            sc.removeJobTag(tag)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_a_feed_that_gets_no_slot_fails_the_fit_within_a_minute_naming_the_holder(
        spark, regression_df, tmp_path):
    """A slot free when the fit chose to feed its ranks beside them, taken since by a job this
    fit cannot wait out (as another application's on a shared cluster would): the fit fails
    once, saying so, instead of waiting for rows for ever."""
    from sparktrain.session import slots

    spark.conf.set("spark.sparktrain.feedWaitSeconds", "10")
    tag = "test-slot-holder"
    holder = None

    def take_the_spare_slot():  # as soon as the fit has claimed its slots
        nonlocal holder
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                c.spare for claims in slots._CLAIMS.values() for c in claims.values()):
            time.sleep(0.005)
        holder = _hold_a_slot(spark, 200, tag)

    watcher = threading.Thread(target=take_the_spare_slot, daemon=True)
    watcher.start()
    est = linear_estimator(str(tmp_path / "store"), num_proc=1, epochs=1, batch_size=50,
                           input_mode="stream", max_attempts=3)
    started = time.monotonic()
    try:
        with pytest.raises(TrainingError) as failed:
            est.fit(regression_df.select("features", "label"))
        took = time.monotonic() - started
    finally:
        spark.conf.unset("spark.sparktrain.feedWaitSeconds")
        spark.sparkContext.cancelJobsWithTag(tag)
        watcher.join(10)
        if holder is not None:
            holder.join(30)
    text = str(failed.value)
    assert "got no task slot in 10s" in text, text
    # The holder is named by its call site: Spark shows the Python line ("collect at
    # tests/...py:58") where it could capture it, otherwise "collectToPython at <unknown>:0".
    assert re.search(r'stage \d+ "collect(ToPython)? at ', text), text
    assert "not retried" in text and text.count("got no task slot") <= 2, text  # one attempt
    assert took < 60, took


@pytest.fixture(scope="module")
def local4(tmp_path_factory):
    """The scenarios of tests/support/local4_fits.py, run once in a process with its own
    local[4] session: ``{scenario: result}``."""
    store = str(tmp_path_factory.mktemp("local4")) + "/s-"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support",
                                                        "local4_fits.py"), store],
                          capture_output=True, text=True, timeout=420, cwd=ROOT)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[result.pop("scenario")] = result
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-4000:]
    return results


@pytest.mark.full
@pytest.mark.timeout(480)
def test_two_threads_each_fit_a_streamed_num_proc_2_on_local_4(local4):
    """local[4], two fits of 2 ranks at once: one feeds its ranks from the spare slots, the
    other takes its rows through its training stage; both finish and learn."""
    threads = local4["threads"]
    assert not threads["errors"] and sorted(threads["losses"]) == ["a", "b"], threads
    for loss in threads["losses"].values():
        assert loss[-1] < loss[0] / 4, loss


@pytest.mark.full
@pytest.mark.timeout(480)
def test_an_epoch_resumed_with_fewer_ranks_trains_exactly_the_rows_left(local4):
    """3 ranks fed rows that are read again every epoch, Ctrl-C'd inside the epoch; the fit
    resumed with 2 ranks trains exactly the rows none of the 3 had trained (by id; a rank
    short of the most repeats a few of its own)."""
    run = local4["regrouped"]
    assert run["interrupted"] and run["step"] and run["world_size"] == 3 and run["positions"]
    before, after, ids = set(run["before"]), set(run["after"]), set(run["ids"])
    assert len(run["before"]) == len(before)  # nothing twice before the checkpoint
    assert not before & after and before | after == ids
