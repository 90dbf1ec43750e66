"""KerasEstimator (Keras 3 on TensorFlow) with backend="tensorflow": MultiWorkerMirroredStrategy
over 2 real barrier tasks, each training in its own TensorFlow process.

Full tier: test_pipeline_with_vector_assembler, test_failing_worker_surfaces_its_traceback,
test_sample_weights_weight_the_loss and test_dict_of_named_inputs_fits_and_transforms. The
quick tier fits Keras only on one numeric feature column, unweighted, uninterrupted
(test_fit_transform_save_load_classification; test_stream.py's streamed fit); only these catch a
KerasModel stage of a saved PipelineModel, a loss error in the TensorFlow worker process lost or
retried, sample_weight_col not reaching Keras's loss, and named dict inputs (one made from text
by transformation_fn) or an elastic Keras fit (num_proc=3 on 2 slots) going wrong."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")

from sparktrain import KerasEstimator, TrainingError  # noqa: E402 - after the importorskip above
from support.helpers import check_keras_classifier, check_keras_pipeline  # noqa: E402 - after the importorskip above


@pytest.mark.stack
def test_fit_transform_save_load_classification(spark, store, classification_df, tmp_path):
    model, _ = check_keras_classifier(classification_df, str(tmp_path / "keras-model"),
                                      epochs=6, store=store)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{store}/runs/{model.getOrDefault('run_id')}/tensorboard/validation")
    events.Reload()
    tags = events.Tags()
    names = tags.get("tensors", []) + tags.get("scalars", [])
    assert any("epoch/accuracy" in t for t in names), tags


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_pipeline_with_vector_assembler(spark, store, regression_df, tmp_path):
    check_keras_pipeline(regression_df, str(tmp_path / "pipeline"), store=store)


def failing_loss(y_true, y_pred):
    import os

    if "TF_CONFIG" in os.environ:  # on the workers only: the driver's preflight passes
        raise ValueError("this loss always fails")
    return keras.losses.mean_squared_error(y_true, y_pred)


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_failing_worker_surfaces_its_traceback(spark, store, regression_df):
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=net, optimizer="sgd", loss=failing_loss,
                         feature_cols=["features"], label_cols=["label"], epochs=1,
                         store=store, verbose=0)
    with pytest.raises(TrainingError, match="this loss always fails") as info:
        est.fit(regression_df)
    assert "failing_loss" in info.value.remote_traceback
    assert info.value.attempts == 1  # the user's bug is not retried


def test_keras_input_checks_run_before_launch(store, regression_df, monkeypatch):
    monkeypatch.setattr("sparktrain.estimators.fit_run.run_elastic",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="model must be a keras.Model"):
        KerasEstimator(num_proc=2, model=object(), optimizer="sgd", loss="mse",
                       feature_cols=["features"], store=store).fit(regression_df)
    with pytest.raises(ValueError, match="feature column 'nope' is not in the DataFrame"):
        KerasEstimator(num_proc=2, model=net, optimizer="sgd", loss="mse",
                       feature_cols=["nope"], store=store).fit(regression_df)
    with pytest.raises(TypeError, match="optimizer must be a keras optimizer"):
        KerasEstimator(num_proc=2, model=net, optimizer=3, loss="mse",
                       feature_cols=["features"], store=store).fit(regression_df)
    # elastic training: not with fixed roles (parameter servers) or TFoS's reserved cluster
    with pytest.raises(ValueError, match="not available with strategy='parameter_server': its "
                                         "tasks' roles"):
        KerasEstimator(num_proc=3, min_num_proc=2, model=net, optimizer="sgd", loss="mse",
                       strategy="parameter_server", feature_cols=["features"],
                       store=store).fit(regression_df)
    with pytest.raises(ValueError, match="needs backend='tensorflow': TensorFlowOnSpark"):
        KerasEstimator(num_proc=3, min_num_proc=2, model=net, optimizer="sgd", loss="mse",
                       backend="tfos", feature_cols=["features"], store=store).fit(regression_df)


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_sample_weights_weight_the_loss(spark, store):
    """A bias-only model converges to the weighted mean of the labels: (3*1 + 1*5) / 4 = 2."""
    rows = [(0.0, 1.0, 3.0)] * 64 + [(0.0, 5.0, 1.0)] * 64
    df = spark.createDataFrame(rows, "x double, y double, w double")
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.2), loss="mse",
                         feature_cols=["x"], label_cols=["y"], sample_weight_col="w",
                         batch_size=32, epochs=30, store=store, verbose=0)
    bias = float(est.fit(df).getModel().layers[0].bias.numpy()[0])
    assert abs(bias - 2.0) < 0.05, bias


def _named_inputs_model():
    """A functional model taking a dict of two named inputs: token ids (int32, 6 per row, into an
    embedding) and numbers (3 per row). The dict's order and the order of ``model.inputs``
    (sorted by name) differ from the feature_cols the tests give."""
    numbers = keras.Input((3,), name="numbers")
    tokens = keras.Input((6,), name="tokens", dtype="int32")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 2)(tokens))
    hidden = keras.layers.Concatenate()([embedded, numbers])
    return keras.Model(inputs={"numbers": numbers, "tokens": tokens},
                       outputs=keras.layers.Dense(1)(hidden))


def test_keras_inputs_rule():
    """Fed by name when the inputs' names are the feature columns, by position otherwise."""
    from sparktrain.loop.keras_inputs import in_feature_order, keras_inputs

    net = _named_inputs_model()
    assert keras_inputs(net, ["tokens", "numbers"], ["t", "n"]) == {"tokens": "t", "numbers": "n"}
    assert in_feature_order(net, ["tokens", "numbers"], ["n_shape", "t_shape"]) == \
        ["t_shape", "n_shape"]
    assert keras_inputs(net, ["ids", "numbers"], ["t", "n"]) == ["t", "n"]
    listed = keras.Model(inputs=[net.inputs[1], net.inputs[0]], outputs=net.outputs)
    assert keras_inputs(listed, ["numbers", "tokens"], ["n", "t"]) == \
        {"numbers": "n", "tokens": "t"}
    single = keras.Sequential([keras.Input((4,), name="features"), keras.layers.Dense(1)])
    assert keras_inputs(single, ["features"], ["f"]) == "f"


WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def words_to_tokens(batch):
    """transformation_fn creating the ``tokens`` input from the ``text`` column."""
    tokens = np.array([[WORDS.index(w) for w in text.split()] for text in batch["text"]],
                      dtype="int32")
    return {**{k: batch[k] for k in ("numbers", "y") if k in batch}, "tokens": tokens}


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_dict_of_named_inputs_fits_and_transforms(spark, store):
    """Inputs by name, one of them made by transformation_fn from a text column (learned on
    the driver): transform reads the text again. Also an elastic fit (num_proc=3 on local[2]):
    it starts at once with the 2 slots there are, each rank taking 3/2 of the batch."""
    rng = np.random.default_rng(4)
    rows = [(" ".join(WORDS[i] for i in rng.integers(0, 10, size=6)),
             rng.normal(size=3).tolist(), float(rng.normal())) for _ in range(64)]
    df = spark.createDataFrame(rows, "text string, numbers array<double>, y double")
    keras.utils.set_random_seed(4)
    est = KerasEstimator(num_proc=3, min_num_proc=2, model=_named_inputs_model(),
                         optimizer="adam", loss="mse", feature_cols=["tokens", "numbers"],
                         label_cols=["y"], batch_size=16, epochs=2, store=store, verbose=0,
                         transformation_fn=words_to_tokens)
    model = est.fit(df)
    assert all(np.isfinite(model.getHistory()["loss"]))
    assert model.getHistory()["num_proc"] == [2.0, 2.0]
    assert [c.name for c in model._input_specs()] == ["numbers", "text"]
    # one partition: one Python worker starts TensorFlow to predict, not two side by side
    out = model.transform(df.select("text", "numbers").coalesce(1)).select("y__output") \
        .toPandas()["y__output"]
    assert len(out) == 64 and np.isfinite(out.to_numpy()).all()
