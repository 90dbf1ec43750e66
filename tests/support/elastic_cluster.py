"""Elastic fits on a Spark standalone cluster on loopback that gains and loses machines, run by
tests/test_elastic_cluster.py in a process of its own (one SparkContext per process):

    python tests/support/elastic_cluster.py WORKDIR MASTER_URL CLUSTER_DIR  # "RESULT {json}" last

The cluster is the pytest worker's shared one (tests/support/servers.py: its Master at
MASTER_URL, logs in CLUSTER_DIR, two 1-core Workers): Workers are added here, beside those two,
and only those added here are killed (and stopped at the end).

* ``ddp``: ``num_proc=3, min_num_proc=2`` on the 2 one-core Workers: the fit starts with 2
  ranks; a third Worker is started after epoch 1 and the fit grows to 3; once an epoch ran on 3
  ranks that Worker is SIGKILLed with its executor (a machine lost for good) and the fit
  finishes on 2.
* ``too_few``: ``min_num_proc=3`` on the 2 Workers left fails at once, with the counts.
* ``horovod``, ``fsdp`` and ``keras`` (multi-worker mirrored): back to 3 Workers, each through
  one shrink (a Worker killed after epoch 1). These fits do not grow
  (``spark.sparktrain.elastic.growAfterSeconds`` is set out of reach): once a fit's shrink is
  announced, the next scenario's Worker starts beside the rest of that fit rather than after
  it (one Worker start per scenario either way, but not waited for).
* ``stream``: rows shuffled into the training stage, a Worker killed inside epoch 2 (after a
  checkpoint there): the 2 ranks left resume the epoch; the ids each generation trained are
  recorded (``IdLog``) to show that the epoch trained every row exactly once.

Epochs are paced by a callback (1 s each, until the changes a scenario waits for happened) so
that the changes land mid-fit; a thread here watches the run's checkpoints, as an operator
watches a dashboard, to act at the right epoch.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support.*, sparktrain

from sparktrain.loop.callbacks import Callback  # noqa: E402 - after sys.path is set
from support.helpers import IdLog, id_net  # noqa: E402 - after sys.path is set
from support.standalone import StandaloneCluster  # noqa: E402 - after sys.path is set


class Pace(Callback):
    """Makes every epoch last at least ``seconds`` (the data is tiny) until the file ``until``
    exists (the scenario saw all it waited for: the rest trains at full speed)."""

    def __init__(self, seconds: float, until: str) -> None:
        self.seconds, self.until = seconds, until

    def on_epoch_end(self, epoch, logs=None):
        if not os.path.exists(self.until):
            time.sleep(self.seconds)
        return False


class Changes(logging.Handler):
    """Times of sparktrain's log lines in the driver (membership changes, ranks' lines);
    writes ``done`` once a line holds ``done_at`` (the pacing then stops)."""

    def __init__(self, done: str) -> None:
        super().__init__()
        self.seen, self.done, self.done_at = [], done, None

    def emit(self, record):
        line = record.getMessage()
        self.seen.append((time.time(), line))
        if self.done_at and self.done_at in line:
            open(self.done, "w").close()

    def after(self, since: float, text: str):
        """Seconds from ``since`` to the first line holding ``text`` after it (or None)."""
        return next((t - since for t, line in self.seen if t > since and text in line), None)


def latest(store: str, run_id: str):
    from sparktrain.data.store import Store
    from sparktrain.loop.checkpoint import Checkpoints

    return Checkpoints(Store.create(store).run_path(run_id)).latest()


def act_when(store: str, run_id: str, ready, action, deadline: float = 300.0) -> threading.Thread:
    """Run ``action()`` once the run's latest checkpoint satisfies ``ready(checkpoint)``."""
    def watch():
        stop = time.time() + deadline
        while time.time() < stop:
            found = latest(store, run_id)
            if found is not None and ready(found):
                action()
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def estimator(store: str, run_id: str, epochs: int, paced_until: str, **params):
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    settings = dict(num_proc=3, min_num_proc=2, model=net,
                    optimizer=torch.optim.SGD(net.parameters(), lr=0.02), loss=torch.nn.MSELoss(),
                    feature_cols=["features"], label_cols=["label"], batch_size=16,
                    epochs=epochs, random_seed=0, store=store, run_id=run_id,
                    callbacks=[Pace(1.0, paced_until)], verbose=1)
    return TorchEstimator(**{**settings, **params})


def keras_estimator(store: str, run_id: str, epochs: int, paced_until: str):
    """The same fit with Keras (MultiWorkerMirroredStrategy, a TensorFlow process per rank)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from sparktrain import KerasEstimator

    class KerasPace(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            # The Keras loop checkpoints after its callbacks' on_epoch_end: a machine lost at
            # a checkpoint must find the next epoch still starting (its rows come from the
            # rank-local cache in well under a second)
            if epoch >= 1:
                Pace(1.0, paced_until).on_epoch_end(epoch)

        def on_epoch_end(self, epoch, logs=None):
            Pace(1.0, paced_until).on_epoch_end(epoch)

    keras.utils.set_random_seed(0)
    return KerasEstimator(num_proc=3, min_num_proc=2,
                          model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
                          optimizer=keras.optimizers.SGD(0.02), loss="mse",
                          feature_cols=["features"], label_cols=["label"], batch_size=16,
                          epochs=epochs, random_seed=0, store=store, run_id=run_id,
                          callbacks=[KerasPace()], verbose=1)


def start_after_shrink(cluster, done: str, fitted: threading.Event) -> threading.Thread:
    """Start a Worker (not waited for) once ``done`` exists: the fit's next generation has
    been announced with the ranks it has, so the Worker only serves the next scenario. Not
    once ``fitted`` is set (the fit ended without its shrink: the next scenario adds one)."""
    def watch():
        while not fitted.is_set():
            if os.path.exists(done):
                cluster.add_worker(wait=0)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def recovery(changes: Changes, killed: float) -> dict:
    """Seconds from a Worker's SIGKILL to the next generation and to its ranks training."""
    return {"to_next_generation": changes.after(killed, "elastic generation"),
            "to_training": changes.after(killed, "resuming from the checkpoint")}


def num_proc_of(checkpoint) -> list:
    return checkpoint.meta["history"].get("num_proc", [])


def _recording(params: dict, folder: str, paced_until: str) -> dict:
    """``params`` for a fit that records its rows' ids (:class:`IdLog`), checkpoints every 5
    steps, and whose epochs last a few seconds (a Worker can be killed inside one)."""
    import torch

    os.makedirs(folder, exist_ok=True)
    log, net = IdLog(folder, pause=0.03), id_net()
    return {**params, "model": net, "optimizer": torch.optim.SGD(net.parameters(), lr=0.02),
            "feature_cols": ["id", "features"], "transformation_fn": log,
            "callbacks": [Pace(1.0, paced_until), log], "checkpoint_steps": 5}


def _trained_ids(folder: str, changes: Changes) -> dict:
    """The ids epoch 2 trained: by the first generation before the checkpoint the second
    resumed from (its step, from rank 0's log line), and by the second generation."""
    import re

    resumed = [re.search(r"after epoch 1 and step (\d+) of epoch 2", line)
               for _, line in changes.seen]
    step = next((int(m.group(1)) for m in resumed if m), 0)
    stages: dict = {}
    for name, epochs in IdLog.epochs(folder).items():
        stages.setdefault(int(name[1:].split("-")[0]), []).append(epochs)
    first, last = stages[min(stages)], stages[max(stages)]
    return {"step": step, "stages": [len(ranks) for _, ranks in sorted(stages.items())],
            "before": [i for rank in first for batch in rank[1][:step] for i in batch],
            "after": [i for rank in last for batch in rank[0] for i in batch]}


def main(workdir: str, master: str, cluster_dir: str) -> dict:
    from pyspark.sql import functions as F

    from sparktrain import local_spark
    from sparktrain.launch.elastic import GROW_CONF
    from sparktrain.session.spark_jvm import max_concurrent_tasks
    from sparktrain.session.worker_daemon import DAEMON_CONF

    found: dict = {}
    done = os.path.join(workdir, "seen-it-all")
    changes = Changes(done)
    changes.done_at = "elastic generation 2:"  # the shrink, after the growth
    logging.getLogger("sparktrain").addHandler(changes)
    logging.getLogger("sparktrain").setLevel(logging.INFO)
    store = os.path.join(workdir, "store")
    with StandaloneCluster(cluster_dir, url=master, name="elastic") as cluster:
        spark = local_spark(cluster.url, "sparktrain-elastic", conf={
            "spark.driver.host": "127.0.0.1", "spark.executor.memory": "640m",
            "spark.sparktrain.slotWaitSeconds": "60",
            "spark.sparktrain.elastic.growAfterSeconds": "2", **DAEMON_CONF})
        features = F.array(*[F.randn(seed=i) for i in range(4)]).alias("features")
        df = spark.range(0, 3000, 1, 3).select("id", features)
        df = df.withColumn("label", F.expr(
            "features[0] - 2 * features[1] + 0.5 * features[2] + 3 * features[3] + 0.5")
            + 0.3 * F.randn(seed=9))  # noise: the loss settles near 0.09
        df = df.cache()
        df.count()

        # -- ddp: start with fewer, grow, lose a machine, finish -------------------------------
        grown = act_when(store, "ddp", lambda c: c.epochs_done >= 1,
                         lambda: cluster.add_worker(wait=0))
        killed = {}

        def kill():
            killed["at"] = time.time()
            cluster.kill_worker(0)

        lost = act_when(store, "ddp", lambda c: num_proc_of(c)[-1:] == [3.0], kill)
        started = time.time()
        model = estimator(store, "ddp", epochs=60, paced_until=done).fit(df)
        found["ddp"] = {"history": model.getHistory(), "seconds": time.time() - started,
                        "changes": [(t - started, text) for t, text in changes.seen
                                    if "elastic" in text or "regroup" in text]}
        grown.join(1)
        lost.join(1)
        if killed:
            found["ddp"].update(killed_after=killed["at"] - started,
                                **recovery(changes, killed["at"]))
        found["ddp"]["attempts"] = latest(store, "ddp").meta["attempts"]
        found["ddp"]["predicted"] = model.transform(df.limit(20)).count()

        # -- too few slots: fail fast ------------------------------------------------------------
        spark.conf.set("spark.sparktrain.slotWaitSeconds", "2")  # no executor is coming
        started = time.time()
        try:
            estimator(store, "too_few", epochs=1, paced_until=done, num_proc=4,
                      min_num_proc=3).fit(df)
            found["too_few"] = {"error": None}
        except Exception as exc:  # noqa: BLE001 - the message is the finding
            found["too_few"] = {"error": str(exc), "seconds": time.time() - started}

        # -- horovod, fsdp, keras and stream: one shrink each ------------------------------------
        # These fits do not grow: the next scenario's Worker starts once this one's shrink
        # happened (its 2-rank generation has begun), beside the rest of its fit, instead of
        # after it.
        spark.conf.set(GROW_CONF, "3600")
        scenarios = (("horovod", {"backend": "horovod"}), ("fsdp", {"strategy": "fsdp"}),
                     ("keras", {}), ("stream", {"input_mode": "stream"}))
        for position, (name, params) in enumerate(scenarios):
            if name == "horovod":
                try:
                    import horovod.torch  # noqa: F401 - only whether it imports
                except ImportError:
                    found[name] = {"skipped": "horovod is not installed"}
                    continue
            while 2 + len(cluster.alive()) < 3:  # the shared 2 and those added here
                cluster.add_worker()
            deadline = time.time() + 60  # their executors registered
            while (max_concurrent_tasks(spark.sparkContext) or 0) < 3 and time.time() < deadline:
                time.sleep(0.3)
            victim = cluster.alive()[0]
            marks = {}

            def kill_one(victim=victim, marks=marks):
                marks["at"] = time.time()
                cluster.kill_worker(victim)

            ready = lambda c: c.epochs_done >= 1  # noqa: E731
            if name == "stream":  # inside epoch 2, after a checkpoint there
                params = _recording(params, os.path.join(workdir, "ids"), done)
                ready = lambda c: c.epochs_done == 1 and c.step > 0  # noqa: E731
            shrink = act_when(store, name, ready, kill_one)
            started, changes.done_at = time.time(), "elastic generation 1:"
            if os.path.exists(done):
                os.remove(done)
            fitted = threading.Event()
            early = start_after_shrink(cluster, done, fitted) \
                if position < len(scenarios) - 1 else None
            build = keras_estimator if name == "keras" else estimator
            model = build(store, name, epochs=3, paced_until=done, **params).fit(df)
            fitted.set()
            if early is not None:
                early.join(10)  # its Worker is in cluster.workers before alive() is asked
            shrink.join(1)
            found[name] = {"history": model.getHistory(), "seconds": time.time() - started,
                           "predicted": model.transform(df.limit(20)).count(),
                           **(recovery(changes, marks["at"]) if marks else {})}
            if name == "stream":
                found[name]["ids"] = _trained_ids(os.path.join(workdir, "ids"), changes)
        spark.stop()
    return found


if __name__ == "__main__":
    result = main(*sys.argv[1:4])
    print("RESULT " + json.dumps(result), flush=True)
