"""KerasEstimator(strategy="parameter_server") scenarios, run by tests/test_parameter_server.py
in the slot host (tests/support/slot_host.py: its local[4] session; the test session's local[2]
has too few slots for 3 ranks), both on one session and one TensorFlow import:
``run(spark, "fit,kill", workdir)``; by hand, on a local[3] session of their own:

    python tests/support/ps_scenarios.py fit,kill WORKDIR    # prints one JSON line last

fit: 1 ps + 1 chief + 1 worker on digits with validation, metrics, callbacks and TensorBoard;
transform, save, load; then a fit whose worker fails in transformation_fn; after each, the
processes the fits started (fresh ones by a marker in their environment, children of fork
templates by their parent) are listed.
kill: the coordinator's callback SIGKILLs the worker's TensorFlow server at the start of epoch 2;
the fit must resume from the checkpoint of epoch 1.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import keras  # noqa: E402 - after sys.path is set
import numpy as np  # noqa: E402 - after sys.path is set
import psutil  # noqa: E402 - after sys.path is set

MARKER = "SPARKTRAIN_PS_SCENARIO"
ZYGOTE = "sparktrain.launch.zygote"


def marked_processes(marker: str, root: int) -> list:
    """``[(pid, TF job)]`` of the live TensorFlow processes a fit started: fresh ``keras_worker``
    processes whose environment carries ``marker``, and children of fork templates
    (``sparktrain.launch.zygote``) owned by a process under ``root``, this scenario's process
    (a template's owner is the executor's Python daemon). /proc shows a forked
    child the environment its template was started with, so a child's job is read from where
    its output goes: a server's ``sparktrain-tf-<job>-*/server.log``, else the coordinator."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            command = " ".join(proc.info["cmdline"] or [])
            if "keras_worker" not in command or ZYGOTE in command:  # templates: below
                continue
            env = proc.environ()
            if env.get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc.pid, json.loads(env["TF_CONFIG"])["task"]["type"]))
        except (psutil.Error, OSError, KeyError):
            continue
    ours = {root} | {p.pid for p in psutil.Process(root).children(recursive=True)}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            template = proc.parent().cmdline() if proc.parent() else []
            # a template's child, the template's owner (its argv after the name) one of ours
            if ZYGOTE not in " ".join(proc.info["cmdline"] or []) or ZYGOTE not in template \
                    or int(template[template.index(ZYGOTE) + 2]) not in ours \
                    or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            output = re.search(r"sparktrain-tf-(ps|worker)-", os.readlink(f"/proc/{proc.pid}/fd/1"))
            found.append((proc.pid, output.group(1) if output else "chief"))
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    return found


def settled(marker: str, seconds: float = 15.0) -> list:
    """The TensorFlow processes of this scenario's fits still alive after up to ``seconds``."""
    deadline = time.time() + seconds
    while True:
        left = marked_processes(marker, os.getpid())
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


class FailOnWorker:
    """transformation_fn raising in the worker's server process only (a user error there)."""

    def __call__(self, batch):
        if '"type": "worker"' in os.environ.get("TF_CONFIG", ""):
            raise ValueError("transformation_fn failed on the worker")
        return batch


class KillWorkerServer(keras.callbacks.Callback):
    """On the coordinator: SIGKILL the worker's TensorFlow server at the start of epoch 2."""

    def __init__(self, marker: str, done_file: str) -> None:
        super().__init__()
        self.marker, self.done_file = marker, done_file
        self.root = os.getpid()  # the scenario's process: its fits' processes are under it

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and not os.path.exists(self.done_file):
            for pid, job in marked_processes(self.marker, self.root):
                if job == "worker":
                    open(self.done_file, "w").close()
                    os.kill(pid, signal.SIGKILL)


class Recorder(keras.callbacks.Callback):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch, "keys": sorted(logs)}) + "\n")


def digits(spark):
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = (data.data / 16.0).astype("float32")[order], data.target[order]
    rows = [(x[i].tolist(), int(y[i]), bool(i % 10 == 0), bool(i >= 1437))
            for i in range(len(y))]
    # 3 partitions, as on the local[3] session these scenarios had before the slot host
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 3),
                               "features array<float>, label long, is_val boolean, "
                               "is_test boolean")
    return df.filter("not is_test").drop("is_test"), df.filter("is_test").drop("is_test")


def estimator(workdir, run_id, marker, **kwargs):
    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(10)])
    params = dict(num_proc=3, strategy="parameter_server", num_ps=1, model=net,
                  optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=32, epochs=6, random_seed=0, store=os.path.join(workdir, "store"),
                  run_id=run_id, verbose=1, backend_env={MARKER: marker})
    params.update(kwargs)
    return KerasEstimator(**params)


def accuracy(model, test) -> float:
    out = model.transform(test).select("label", "label__output").toPandas()
    return float(np.mean(np.stack(out["label__output"]).argmax(-1) == out["label"].to_numpy()))


def fit_scenario(spark, workdir) -> dict:
    from sparktrain import KerasModel, TrainingError

    train, test = digits(spark)
    marker = uuid.uuid4().hex
    record = os.path.join(workdir, "callback.jsonl")
    started = time.time()
    model = estimator(workdir, "ps-fit", marker, validation="is_val",
                      callbacks=[Recorder(record)]).fit(train)
    out = {"fit_seconds": time.time() - started, "history": model.getHistory(),
           "left_after_fit": settled(marker), "test_accuracy": accuracy(model, test)}
    with open(record) as f:
        out["callback_epochs"] = [json.loads(line) for line in f]
    path = os.path.join(workdir, "model")
    model.write().overwrite().save(path)
    out["loaded_accuracy"] = accuracy(KerasModel.load(path), test)
    run = os.path.join(workdir, "store", "runs", "ps-fit")
    out["tensorboard"] = sorted(os.listdir(os.path.join(run, "tensorboard"))) \
        if os.path.isdir(os.path.join(run, "tensorboard")) else []
    failing = uuid.uuid4().hex
    try:
        estimator(workdir, "ps-fail", failing, epochs=1,
                  transformation_fn=FailOnWorker()).fit(train)
        out["failure"] = None
    except TrainingError as exc:
        out["failure"] = str(exc)[:2000]
    out["left_after_failure"] = settled(failing)
    out["session_usable"] = spark.range(5).count() == 5
    return out


def kill_scenario(spark, workdir) -> dict:
    from sparktrain.data.store import Store
    from sparktrain.loop.checkpoint import Checkpoints

    train, test = digits(spark)
    marker = uuid.uuid4().hex
    done = os.path.join(workdir, "killed")
    model = estimator(workdir, "ps-kill", marker, epochs=3,
                      callbacks=[KillWorkerServer(marker, done)]).fit(train)
    latest = Checkpoints(Store.create(os.path.join(workdir, "store")).run_path("ps-kill")).latest()
    return {"killed": os.path.exists(done), "epochs": len(model.getHistory()["loss"]),
            "attempts": [(a["attempt"], a["start_epoch"]) for a in latest.meta["attempts"]],
            "test_accuracy": accuracy(model, test), "left_after_fit": settled(marker)}


SCENARIOS = {"fit": fit_scenario, "kill": kill_scenario}


def run(spark, scenarios: str, workdir: str) -> dict:
    """Run the comma-separated ``scenarios`` one after the other on ``spark`` (one TensorFlow
    import for all): ``{name: findings}``."""
    result = {}
    for name in scenarios.split(","):
        os.makedirs(os.path.join(workdir, name), exist_ok=True)
        result[name] = SCENARIOS[name](spark, os.path.join(workdir, name))
    return result


def main(scenarios: str, workdir: str) -> None:
    """:func:`run` on a local[3] session of its own; print ``{name: findings}``."""
    from sparktrain import local_spark

    spark = local_spark("local[3]", app_name="sparktrain-ps", conf={
        "spark.sparktrain.slotWaitSeconds": "1", "spark.default.parallelism": "3",
        "spark.stage.maxConsecutiveAttempts": "3"})
    try:
        result = run(spark, scenarios, workdir)
    finally:
        spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
