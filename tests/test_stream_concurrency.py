"""Streamed fits (``input_mode="stream"``) beside other fits and jobs: the way rows reach the
ranks is chosen with the slots other fits and jobs hold, so fits never wait on each other for
ever (``CrossValidator(parallelism=2)``, two threads), and a feeding job that gets no slot
fails the fit within a minute, naming what holds the slots."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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
    assert "got no task slot in 10s" in text and "collectToPython" in text, text  # the holder
    assert "not retried" in text and text.count("got no task slot") <= 2, text  # one attempt
    assert took < 60, took


TWO_THREADS = textwrap.dedent('''
    import sys, threading
    sys.path.insert(0, {tests!r})
    from support.helpers import linear_estimator
    from sparktrain import local_spark
    import numpy as np
    from pyspark.ml.linalg import Vectors

    spark = local_spark("local[4]", conf={{"spark.ui.enabled": "false"}})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y)],
                               ["features", "label"]).repartition(3).cache()
    results, errors = {{}}, []

    def fit(name):
        try:
            est = linear_estimator({store!r} + name, num_proc=2, epochs=4, batch_size=50,
                                   input_mode="stream", lr=0.05)
            results[name] = est.fit(df).getHistory()["loss"]
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=fit, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    print("ERRORS", errors, flush=True)
    for name, loss in sorted(results.items()):
        print("LOSS", name, loss[0], loss[-1], flush=True)
''')


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_threads_each_fit_a_streamed_num_proc_2_on_local_4(tmp_path):
    """local[4], two fits of 2 ranks at once: one feeds its ranks from the spare slots, the
    other takes its rows through its training stage; both finish and learn."""
    script = TWO_THREADS.format(tests=os.path.join(ROOT, "tests"), store=str(tmp_path / "s-"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=330, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0 and "ERRORS []" in out, out + done.stderr[-4000:]
    losses = [line.split() for line in out.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 2
    for _, _, first, last in losses:
        assert float(last) < float(first) / 4, out


def test_slot_claims_leave_a_feeding_slot_to_one_fit_where_there_is_one(spark):
    """local[2]: a fit of 1 rank may feed from the second slot; a second fit at once may not
    (its rows go through its training stage), nor a first fit of 2 ranks; claims end with
    their fits."""
    from sparktrain.session.slots import claim_slots, fits_holding_slots

    with claim_slots(spark, ranks=1, feeders=True) as first:
        assert first.spare and first.slots == 2 and first.held == 2
        with claim_slots(spark, ranks=1, feeders=True) as second:
            assert not second.spare and second.busy == 2 and fits_holding_slots(spark) == 2
    with claim_slots(spark, ranks=2, feeders=True) as wide:
        assert not wide.spare and wide.held == 2
    with claim_slots(spark, ranks=1, feeders=False) as stored:
        assert not stored.spare and fits_holding_slots(spark) == 1
    assert fits_holding_slots(spark) == 0
