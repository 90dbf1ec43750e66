"""Ctrl-C at many points of fits and of a prediction, in a process of its own (run by
tests/test_interrupts.py), on a classic session or over Spark Connect:

    python tests/support/interrupt_client.py classic|sc://127.0.0.1:PORT WORKDIR \
        [torch|keras|torch,keras [POINT,...]]

A real SIGINT is sent to this process (``os.kill``, what a terminal's Ctrl-C and Jupyter's
"interrupt kernel" do) when the fit reaches a point, recognised by its log lines: at once,
after the preflight (materialization), after materialization (launch), mid-epoch, right after
an epoch (its checkpoint), and while a finalizer runs in the main thread (where Python drops
the exception). For each: the seconds from the signal to the ``KeyboardInterrupt``, to the
ranks' last batch (each batch appends to a file), and whether a fit with the same ``run_id``
right after takes the run and resumes from the last checkpoint. Prints one JSON line per
framework (:func:`main`).
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support.*, sparktrain
HANG_SECONDS = 420


POINTS = [  # (name, the log text that arms it (BEAT: a rank's first batch), seconds after)
    ("start", None, 0.3),
    ("materialization", "preflight:", 0.0),
    ("launch", "materialized ", 0.0),
    ("mid_epoch", "BEAT", 1.0),
    ("after_epoch", "epoch 1/", 0.0),
    ("finalizer", "finalizer running", 0.0),
]


class Beats:
    """transformation_fn: each rank appends a line per batch to ``path`` (the test watches
    when they stop) and sleeps, so that epochs last; on the driver (the preflight) it can run
    a slow finalizer in the main thread."""

    def __init__(self, path: str, slow_finalizer: bool = False) -> None:
        self.path, self.slow_finalizer = path, slow_finalizer

    def __call__(self, batch):
        try:
            from pyspark import BarrierTaskContext

            BarrierTaskContext.get().partitionId()
            in_rank = True
        except Exception:  # noqa: BLE001 - the driver's preflight, or a Keras rank's TF process
            in_rank = "TF_CONFIG" in os.environ
        if in_rank:
            with open(self.path, "a") as f:
                f.write(f"{time.time()}\n")
            time.sleep(0.1)
        elif self.slow_finalizer:
            _SlowFinalizer()  # dropped at once: its __del__ runs here, in the main thread
        return batch


class _SlowFinalizer:
    def __del__(self) -> None:
        logging.getLogger("sparktrain.test").warning("finalizer running")
        time.sleep(1.0)


class Trigger(logging.Handler):
    """Sends SIGINT to this process ``delay`` seconds after a log record containing
    ``text`` (or after ``arm()`` when ``text`` is None)."""

    def __init__(self, text: Optional[str], delay: float) -> None:
        super().__init__()
        self.text, self.delay, self.sent_at = text, delay, None

    def emit(self, record: logging.LogRecord) -> None:
        if self.text is not None and self.sent_at is None and self.text in record.getMessage():
            self.arm()

    def arm(self) -> None:
        def fire() -> None:
            time.sleep(self.delay)
            self.sent_at = time.time()
            os.kill(os.getpid(), signal.SIGINT)

        self.sent_at = -1.0
        threading.Thread(target=fire, daemon=True).start()


def _arm_at_first_beat(trigger: Trigger, path: str) -> None:
    def wait() -> None:
        while not os.path.exists(path):
            time.sleep(0.05)
        trigger.arm()

    threading.Thread(target=wait, daemon=True).start()


def _quiet_after(path: str, since: float, limit: float = 30.0) -> float:
    """Seconds from ``since`` to the ranks' last batch, once none came for 3 s."""
    deadline = time.time() + limit
    while time.time() < deadline:
        last = os.path.getmtime(path) if os.path.exists(path) else since
        if time.time() - last > 3.0:
            return max(0.0, last - since)
        time.sleep(0.5)
    return float("inf")


def _estimator(framework: str, store: str, run_id: str, epochs: int, transformation: Any):
    from support.helpers import linear_estimator

    if framework == "torch":
        return linear_estimator(store, epochs=epochs, batch_size=100, run_id=run_id,
                                verbose=1, transformation_fn=transformation)
    import keras

    from sparktrain import KerasEstimator

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    return KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.05),
                          loss="mse", feature_cols=["features"], label_cols=["label"],
                          batch_size=100, epochs=epochs, store=store, run_id=run_id,
                          verbose=1, transformation_fn=transformation)


def interrupt_fits(spark, workdir: str, framework: str, points: List[Any]) -> Dict[str, Any]:
    import numpy as np

    from sparktrain.data.store import Store
    from sparktrain.loop.checkpoint import Checkpoints

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double")
    found: Dict[str, Any] = {}
    for index, (name, text, delay) in enumerate(points):
        store = os.path.join(workdir, f"store-{framework}-{index}")  # materializes afresh
        beats = os.path.join(workdir, f"beats-{framework}-{index}")
        run_id = f"interrupted-{framework}-{index}"
        trigger = Trigger(text, delay)
        logging.getLogger("sparktrain").addHandler(trigger)
        est = _estimator(framework, store, run_id, 30,
                         Beats(beats, slow_finalizer=name == "finalizer"))
        outcome: Dict[str, Any] = {}
        try:
            if text is None:
                trigger.arm()
            elif text == "BEAT":
                _arm_at_first_beat(trigger, beats)
            est.fit(df)
            outcome["ended"] = "fit completed: the interrupt was lost"
        except KeyboardInterrupt:
            outcome["interrupt_to_caller_s"] = round(time.time() - trigger.sent_at, 2)
        except BaseException as exc:  # noqa: BLE001 - reported, the test fails on it
            outcome["ended"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            logging.getLogger("sparktrain").removeHandler(trigger)
        if trigger.sent_at and trigger.sent_at > 0:
            outcome["ranks_stopped_after_s"] = round(_quiet_after(beats, trigger.sent_at), 2)
        latest = Checkpoints(Store.create(store).run_path(run_id)).latest()
        done = latest.epochs_done if latest is not None else 0
        again = _estimator(framework, store, run_id, done + 1, None).fit(df)
        attempts = Checkpoints(Store.create(store).run_path(run_id)).latest().meta["attempts"]
        outcome.update(checkpoint_epochs=done, resumed_from=attempts[-1]["start_epoch"],
                       resumed_epochs=len(again.getHistory()["loss"]))
        found[name] = outcome
    return found


def interrupt_transform(spark, workdir: str) -> Dict[str, Any]:
    """Ctrl-C while a prediction job runs (the user's action on ``transform``'s output)."""
    from pyspark.sql import functions as F

    from support.helpers import linear_estimator

    df = spark.range(0, 400_000, numPartitions=2).select(
        F.array(*[F.rand(i) for i in range(4)]).alias("features"), F.rand(9).alias("label"))
    model = linear_estimator(os.path.join(workdir, "store-transform"), epochs=1,
                             batch_size=200).fit(df.limit(2000))
    model.setBatchSize(1)  # one row a call: a slow prediction
    # Ctrl-C a second after the prediction job's first row is read (a file its tasks touch):
    # a fixed delay from here landed before the job on a loaded machine
    beat = os.path.join(workdir, "prediction-running")

    def touch(features: List[float]) -> List[float]:
        if not os.path.exists(beat):
            open(beat, "a").close()
        return features

    trigger = Trigger(None, 1.0)
    _arm_at_first_beat(trigger, beat)
    try:
        rows = df.withColumn("features", F.udf(touch, "array<double>")("features"))
        model.transform(rows).agg(F.count("label__output")).collect()
        return {"ended": "the prediction completed: the interrupt was lost",
                "prediction_ran": os.path.exists(beat), "sent_at": trigger.sent_at,
                "ended_at": time.time()}
    except KeyboardInterrupt:
        return {"interrupt_to_caller_s": round(time.time() - trigger.sent_at, 2)}


#: the line on stderr that ends a framework's part, before its findings go to stdout
END_MARK = "=== sparktrain interrupts ended: {} ==="


def main(where: str, workdir: str, frameworks: str = "torch", names: str = "") -> None:
    """``frameworks``: "torch", "keras" or both, comma-separated (one after the other in this
    process: after each, ``END_MARK`` on stderr and ``{"framework": ..., "found": ...}`` on
    stdout; for one, its findings alone). ``names``: the points to interrupt at,
    comma-separated (default: every point for torch, ``mid_epoch`` for Keras)."""
    # a hang shows where every thread waits (in the test's failure), before the test's timeout
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if where == "classic":
        from sparktrain.session import local_spark

        spark = local_spark("local[2]")
    else:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.remote(where).getOrCreate()
    several = "," in frameworks
    for framework in frameworks.split(","):
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # per framework
        wanted = names.split(",") if names else \
            [p[0] for p in POINTS] if framework == "torch" else ["mid_epoch"]
        points = [p for p in POINTS if p[0] in wanted]
        found = {"fits": interrupt_fits(spark, workdir, framework, points)}
        if framework == "torch":
            found["transform"] = interrupt_transform(spark, workdir)
        if several:
            sys.stderr.write(END_MARK.format(framework) + "\n")
            sys.stderr.flush()
            print(json.dumps({"framework": framework, "found": found}), flush=True)
        else:
            print(json.dumps(found), flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(*sys.argv[1:5])
