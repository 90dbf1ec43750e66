"""Builders shared by test modules."""
from __future__ import annotations

import os
import signal
from typing import Any


def linear_estimator(store: str, seed: int = 0, lr: float = 0.05, **overrides: Any):
    """A 2-rank ``TorchEstimator`` fitting ``Linear(4, 1)`` with SGD on the ``features`` /
    ``label`` columns of the ``regression_df`` fixture; any param can be overridden."""
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  random_seed=seed, store=store, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


class KillRankOnce:
    """A transformation_fn that SIGKILLs rank 1's Python worker at its ``at``-th batch, once
    per marker file (so the retried attempt runs through)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at, self.seen = marker, at, 0

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        self.seen += 1
        if BarrierTaskContext.get().partitionId() == 1 and self.seen == self.at \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_GPU_DISCOVERY = os.path.join(ROOT, "conf", "getGpusResources.sh")


def run_reporting_script(code: str, timeout: int, fake_gpus: str = "") -> tuple:
    """Run ``python -c code`` in its own process (e.g. a Spark session with another master):
    ``(the JSON it printed on its "RESULT " line, its stderr)``; fails with its output if it
    printed none.
    ``fake_gpus`` (``"0,1"``): the addresses ``FAKE_GPU_DISCOVERY`` announces."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(FAKE_GPU_DISCOVERY))
    env = dict(os.environ, SPARKTRAIN_FAKE_GPUS=fake_gpus) if fake_gpus else None

    def tails(stdout, stderr) -> str:  # the output's ends, without the JVM's stack frames
        stdout, stderr = (b.decode(errors="replace") if isinstance(b, bytes) else b or ""
                          for b in (stdout, stderr))
        return stdout[-3000:] + "\n".join(
            line for line in stderr.splitlines()
            if not line.lstrip().startswith("at "))[-6000:]

    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=timeout, cwd=root, env=env)
    except subprocess.TimeoutExpired as exc:  # its output so far says where it stuck
        raise AssertionError(f"the script ran past {timeout} s:\n"
                             + tails(exc.stdout, exc.stderr)) from None
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, tails(result.stdout, result.stderr)
    return json.loads(lines[0][len("RESULT "):]), result.stderr


def class_accuracy(out, label: str = "label") -> float:
    """The share of ``out``'s rows whose ``label__output`` scores are highest at ``label``."""
    from pyspark.sql import functions as F

    predicted = F.expr(f"array_position({label}__output, array_max({label}__output)) - 1")
    return out.select(F.avg((predicted == F.col(label)).cast("double"))).first()[0]


def assert_reload_predicts_the_same(model, out, df, path: str, atol: float = 0.0):
    """Save ``model`` at ``path`` and load it with its class: the loaded model predicts
    ``label__output`` on ``df`` as ``out`` (``model.transform(df)``) holds. Returns it."""
    import numpy as np

    model.write().overwrite().save(path)
    loaded = type(model).load(path)
    a = np.stack(out.select("label__output").toPandas()["label__output"].tolist())
    b = loaded.transform(df).select("label__output").toPandas()["label__output"]
    np.testing.assert_allclose(a, np.stack(b.tolist()), rtol=1e-5, atol=atol)
    return loaded


def keras_scale_layer() -> type:
    """``Scale``, a custom Keras layer (a model holding it only loads with ``custom_objects`` or
    Keras's registration), made and registered once, on first use: importing this module
    imports no Keras. It is pickled by reference, as ``helpers.Scale`` (see ``__getattr__``)."""
    if "Scale" in globals():
        return globals()["Scale"]
    import keras

    class Scale(keras.layers.Layer):
        def __init__(self, factor=1.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, x):
            return x * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    Scale.__qualname__ = "Scale"
    globals()["Scale"] = keras.saving.register_keras_serializable("sparktrain_tests")(Scale)
    return Scale


def __getattr__(name: str):
    """``helpers.Scale`` (where a pickled model's custom layer is looked up) makes it."""
    if name == "Scale":
        return keras_scale_layer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_keras_classifier(classification_df, path: str, epochs: int, **params: Any):
    """Fit ``Sequential([Scale(1.0), Dense(16, relu), Dense(3)])`` (``Scale``: the custom layer
    above, loaded through ``custom_objects``) with a 2-rank ``KerasEstimator`` on the
    ``classification_df`` fixture (``params``: more of its params) and check the history
    (``epochs`` of loss and accuracy, with validation over 0.95), the predictions (over 0.95
    right) and that the model saved at ``path`` loads with the same history and predictions.
    Returns (model, loaded)."""
    import keras

    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    scale = keras_scale_layer()
    net = keras.Sequential([keras.Input((2,)), scale(1.0),
                            keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(0.02),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                         batch_size=32, epochs=epochs, validation=0.2, random_seed=3,
                         custom_objects={"Scale": scale}, verbose=0,
                         **params)
    model = est.fit(classification_df)
    history = model.getHistory()
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history["loss"]) == epochs and history["val_accuracy"][-1] > 0.95
    out = model.transform(classification_df)
    assert out.columns == classification_df.columns + ["label__output"]
    assert class_accuracy(out) > 0.95
    loaded = assert_reload_predicts_the_same(model, out, classification_df, path)
    assert loaded.getHistory() == history
    assert isinstance(loaded.getModel(), keras.Model)
    return model, loaded


def check_keras_pipeline(regression_df, path: str, **params: Any) -> None:
    """A ``Pipeline`` of a ``VectorAssembler`` (of ``x0`` to ``x3``, the ``regression_df``
    fixture's features) and a 2-rank ``KerasEstimator`` of ``Dense(1)`` (``params``: more of its
    params) fits to under the noise's loss, and the ``PipelineModel`` saved at ``path`` loads
    and predicts the same."""
    import keras
    import numpy as np
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.functions import vector_to_array

    from sparktrain import KerasEstimator

    values = vector_to_array("features")
    df = regression_df.select("label", *[values[i].alias(f"x{i}") for i in range(4)])
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=[f"x{i}" for i in range(4)], outputCol="features"),
        KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                       feature_cols=["features"], label_cols=["label"], batch_size=32,
                       epochs=4, random_seed=1, verbose=0, **params)])
    fitted = pipeline.fit(df)
    assert fitted.stages[-1].getHistory()["loss"][-1] < 0.05  # noise variance is 0.01
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    a = fitted.transform(df).select("label__output").toPandas().to_numpy()
    b = loaded.transform(df).select("label__output").toPandas().to_numpy()
    np.testing.assert_allclose(a, b, rtol=1e-5)


def id_net(seed: int = 0):
    """``Linear(4, 1)`` of ``features`` that takes (and ignores) an ``id`` column first, for
    fits that record which rows they trained (``feature_cols=["id", "features"]``)."""
    import torch

    class IgnoreId(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, ids, features):
            return self.linear(features)

    torch.manual_seed(seed)
    return IgnoreId()


class IdLog:
    """A ``transformation_fn`` and a callback that record which rows each rank trained: every
    batch's ``id`` column as a line of ``folder/s{stage}-rank-{partition}`` (a file per
    training stage, so per elastic generation), ``end`` at every epoch's end; each batch
    waits ``pause`` seconds (a short epoch that a test can still act inside)."""

    def __init__(self, folder: str, pause: float = 0.0) -> None:
        self.folder, self.pause = folder, pause

    def _write(self, line: str) -> None:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        if context is None:  # the driver's preflight
            return
        name = f"s{context.stageId()}-rank-{context.partitionId()}"
        with open(os.path.join(self.folder, name), "a") as f:
            f.write(line + "\n")

    def __call__(self, batch):
        import time

        self._write(" ".join(str(int(i)) for i in batch["id"].ravel()))
        time.sleep(self.pause)
        return batch

    def on_epoch_end(self, epoch, logs=None):
        self._write("end")
        return False

    @staticmethod
    def epochs(folder: str) -> dict:
        """``{file: [[ids of each batch] for each epoch]}`` as recorded."""
        found = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name)) as f:
                epochs = [[]]
                for line in f.read().split("\n"):
                    if line == "end":
                        epochs.append([])
                    elif line:
                        epochs[-1].append([int(v) for v in line.split()])
            found[name] = epochs
        return found
