"""Horovod drop-in parity: Horovod 0.28.1's Spark estimator API on sparktrain.

The two examples in ``tests/support/horovod_examples`` are Horovod's MNIST examples on the
digits with only their imports changed; the other tests check each Horovod param's meaning here.

Full tier: test_pytorch_example_runs_with_only_its_imports_changed,
test_keras_example_runs_with_only_its_imports_changed and test_keras_horovod_params. Only the
examples run a Horovod user's whole script (sparktrain.estimators.torch and .keras as ``hvd``, a
tf.keras model, setOutputCols, an evaluator, 90% accuracy), and only the last fits Keras with
Horovod's params: label_shapes, loss_weights, backend_env in the TensorFlow worker process,
checkpoint_callback's best epoch as the fitted model, one warning for what has no equivalent.
The quick tier checks the API's names and each param's meaning with TorchEstimator fits.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch

from sparktrain import Store, TorchEstimator, TorchModel, TrainingError
from sparktrain.options.horovod import IgnoredParamWarning, reader_options, warn_ignored
from support.helpers import linear_estimator

# Every getter/setter and constructor param of Horovod 0.28.1's classes, from
# horovod/spark/{common/params.py, torch/estimator.py, keras/estimator.py} at tag v0.28.1
# (test_horovod_api_list_is_horovods checks this list against the installed Horovod's source).
HOROVOD_ACCESSORS = {
    "EstimatorParams": [
        "getBackend", "getBackwardPassesPerStep", "getBatchSize", "getCallbacks",
        "getCategoricalCols", "getCompressSparseCols", "getContinuousCols", "getEpochs",
        "getFeatureCols", "getGradientCompression", "getInMemoryCacheAll", "getLabelCols",
        "getLabelShapes", "getLoss", "getLossWeights", "getMetrics", "getModel",
        "getMpStartMethod", "getNumProc", "getOptimizer", "getPartitionsPerProcess",
        "getRandomSeed", "getReaderPoolType", "getRunId", "getSampleWeightCol", "getShuffle",
        "getShufflingBufferSize", "getStore", "getTrainReaderNumWorker", "getTrainStepsPerEpoch",
        "getTransformationEditFields", "getTransformationFn", "getTransformationRemovedFields",
        "getUseGpu", "getValBatchSize", "getValReaderNumWorker", "getValidation",
        "getValidationStepsPerEpoch", "getVerbose", "setBackend", "setBackwardPassesPerStep",
        "setBatchSize", "setCallbacks", "setCategoricalCols", "setCompressSparseCols",
        "setContinuousCols", "setEpochs", "setFeatureCols", "setGradientCompression",
        "setInMemoryCacheAll", "setLabelCols", "setLabelShapes", "setLoss", "setLossWeights",
        "setMetrics", "setModel", "setMpStartMethod", "setNumProc", "setOptimizer", "setParams",
        "setPartitionsPerProcess", "setRandomSeed", "setReaderPoolType", "setRunId",
        "setSampleWeightCol", "setShuffle", "setShufflingBufferSize", "setStore",
        "setTrainReaderNumWorker", "setTrainStepsPerEpoch", "setTransformationEditFields",
        "setTransformationFn", "setTransformationRemovedFields", "setUseGpu", "setValBatchSize",
        "setValReaderNumWorker", "setValidation", "setValidationStepsPerEpoch", "setVerbose"],
    "ModelParams": [
        "getFeatureColumns", "getHistory", "getLabelColumns", "getModel", "getRunId",
        "setFeatureColumns", "setHistory", "setLabelColoumns", "setModel", "setOutputCols",
        "setParams", "setRunId"],
    "TorchEstimator": [
        "getDataModule", "getInputShapes", "getLossConstructors", "getOptimizer",
        "getTrainMinibatchFn", "get_model_class", "setDataModule", "setInputShapes",
        "setLossConstructors", "setTrainMinibatchFn"],
    "TorchModel": [
        "getInputShapes", "getLoss", "getLossConstructors", "getOptimizer", "setInputShapes",
        "setLoss", "setLossConstructors", "setOptimizer"],
    "KerasEstimator": [
        "getBackendEnv", "getCheckpointCallback", "getCustomObjects", "getDataModule",
        "get_model_class", "get_model_shapes", "setBackendEnv", "setCheckpointCallback",
        "setCustomObjects", "setDataModule"],
    "KerasModel": ["getCustomObjects", "setCustomObjects"],
}
HOROVOD_INIT = {
    "TorchEstimator": [
        "num_proc", "data_module", "model", "backend", "store", "optimizer", "loss",
        "loss_constructors", "metrics", "loss_weights", "sample_weight_col",
        "gradient_compression", "feature_cols", "continuous_cols", "categorical_cols",
        "input_shapes", "validation", "label_cols", "callbacks", "batch_size", "val_batch_size",
        "epochs", "verbose", "random_seed", "shuffle_buffer_size", "shuffle",
        "partitions_per_process", "run_id", "train_minibatch_fn", "train_steps_per_epoch",
        "validation_steps_per_epoch", "transformation_fn", "train_reader_num_workers",
        "val_reader_num_workers", "reader_pool_type", "label_shapes", "inmemory_cache_all",
        "use_gpu", "mp_start_method", "backward_passes_per_step"],
    "TorchModel": ["history", "model", "feature_columns", "input_shapes", "label_columns",
                   "optimizer", "run_id", "_metadata", "loss", "loss_constructors"],
    "KerasEstimator": [
        "num_proc", "data_module", "model", "backend", "store", "custom_objects", "optimizer",
        "loss", "loss_weights", "sample_weight_col", "gradient_compression", "metrics",
        "feature_cols", "label_cols", "continuous_cols", "categorical_cols", "validation",
        "callbacks", "batch_size", "val_batch_size", "epochs", "verbose", "random_seed",
        "shuffle_buffer_size", "shuffle", "partitions_per_process", "run_id",
        "train_steps_per_epoch", "validation_steps_per_epoch", "transformation_fn",
        "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type", "label_shapes",
        "checkpoint_callback", "inmemory_cache_all", "backend_env", "use_gpu", "mp_start_method"],
    "KerasModel": ["history", "model", "feature_columns", "label_columns", "custom_objects",
                   "run_id", "_metadata", "_floatx"],
}


def _example_args(module, work_dir, **overrides):
    args = module.parser.parse_args(["--work-dir", str(work_dir)])
    return argparse.Namespace(**dict(vars(args), **overrides))


# -- the examples ------------------------------------------------------------------------------
@pytest.mark.full
def test_pytorch_example_runs_with_only_its_imports_changed(spark, tmp_path):
    from support.horovod_examples import pytorch_spark_digits

    accuracy = pytorch_spark_digits.train_and_evaluate(
        spark, _example_args(pytorch_spark_digits, tmp_path, epochs=8))
    assert accuracy >= 0.9


@pytest.mark.full
def test_keras_example_runs_with_only_its_imports_changed(spark, tmp_path):
    from support.horovod_examples import keras_spark_digits

    accuracy = keras_spark_digits.train_and_evaluate(
        spark, _example_args(keras_spark_digits, tmp_path, epochs=5))
    assert accuracy >= 0.9


# -- API surface -------------------------------------------------------------------------------
def _classes():
    from sparktrain import KerasEstimator, KerasModel

    return {"EstimatorParams": [TorchEstimator, KerasEstimator],
            "ModelParams": [TorchModel, KerasModel], "TorchEstimator": [TorchEstimator],
            "TorchModel": [TorchModel], "KerasEstimator": [KerasEstimator],
            "KerasModel": [KerasModel]}


def test_every_horovod_getter_and_setter_exists():
    missing = [f"{cls.__name__}.{name}" for group, names in HOROVOD_ACCESSORS.items()
               for cls in _classes()[group] for name in names
               if not callable(getattr(cls, name, None))]
    assert not missing


def test_every_horovod_constructor_param_is_accepted():
    import inspect

    from sparktrain import KerasEstimator, KerasModel

    classes = {"TorchEstimator": TorchEstimator, "TorchModel": TorchModel,
               "KerasEstimator": KerasEstimator, "KerasModel": KerasModel}
    for name, params in HOROVOD_INIT.items():
        accepted = inspect.signature(classes[name].__init__).parameters
        assert not [p for p in params if p not in accepted], name


def test_horovod_api_list_is_horovods():
    """The lists above are Horovod's: compare with the installed Horovod's source (parsed,
    not imported)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        pytest.skip("Horovod is not installed")
    root = os.path.join(spec.submodule_search_locations[0], "spark")
    found_accessors, found_init = {}, {}
    for path in ("common/params.py", "torch/estimator.py", "keras/estimator.py"):
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in HOROVOD_ACCESSORS:
                functions = [n for n in node.body if isinstance(n, ast.FunctionDef)]
                found_accessors[node.name] = sorted(f.name for f in functions
                                                    if f.name.startswith(("get", "set")))
                for f in functions:
                    if f.name == "__init__" and node.name in HOROVOD_INIT:
                        found_init[node.name] = [a.arg for a in f.args.args[1:]]
    assert found_accessors == {k: sorted(v) for k, v in HOROVOD_ACCESSORS.items()}
    assert found_init == HOROVOD_INIT


def test_generated_accessors_get_and_set_with_horovod_spellings():
    est = TorchEstimator()
    assert est.setTrainReaderNumWorker(3) is est and est.getTrainReaderNumWorker() == 3
    assert est.setShufflingBufferSize(10).getShuffleBufferSize() == 10
    assert est.setInMemoryCacheAll(True).getInmemoryCacheAll() is True
    assert est.setInputShapes([[-1, 4]]).getInputShapes() == [[-1, 4]]
    assert est.setEpochs(3).getEpochs() == 3 and est.get_model_class() is TorchModel
    assert "Horovod" in TorchEstimator.setMpStartMethod.__doc__ or \
        "mp_start_method" in TorchEstimator.setMpStartMethod.__doc__
    model = TorchModel(torch.nn.Linear(2, 1), feature_columns=["x"], label_columns=["y"])
    assert model.setLabelColoumns(["z"]).getLabelColumns() == ["z"]
    assert model.getOutputCols() == ["z__output"]
    model.setHistory([{"loss": 1.0}, {"loss": 0.5}])
    assert model.getHistory() == {"loss": [1.0, 0.5]}


# -- bad values fail at once, naming the param ---------------------------------------------------
def test_a_horovod_backend_object_gets_a_clear_error():
    from horovod.spark.common.backend import SparkBackend

    with pytest.raises(TypeError, match=r"backend must be the name of the distributed engine "
                                        r"\('torch' or 'horovod'.*got a SparkBackend object.*"
                                        r"num_proc=N \(num_proc=2 for this one\)"):
        TorchEstimator(backend=SparkBackend(num_proc=2))


@pytest.mark.parametrize("params, message", [
    (dict(input_shapes=[-1, 1, 8, 8]), r"input_shapes.*single shape \[-1, 1, 8, 8\].*wrap"),
    (dict(input_shapes=[[-1, 0, 8]]), r"input_shapes.*dimensions are >= 1"),
    (dict(label_shapes="x"), r"label_shapes must be a list with one shape per column"),
    (dict(loss_weights=2.0), r"loss_weights must be a list.*single number 2.0"),
    (dict(reader_pool_type="threads"), r"reader_pool_type must be one of \[.*\], got 'threads'"),
    (dict(mp_start_method="fork-exec"), r"mp_start_method must be one of \[.*\], got 'fork-exec'"),
    (dict(train_reader_num_workers=-1),
     r"train_reader_num_workers must be None or an integer >= 0, got -1"),
    (dict(backend_env={"A": object()}), r"backend_env must map variable names"),
    (dict(backend_env=["A=1"]), r"backend_env must be a dict"),
    (dict(gradient_compression="gzip"), r"gradient_compression must be .*, got 'gzip'"),
    (dict(train_minibatch_fn=3), r"train_minibatch_fn must be a function"),
])
def test_bad_values_fail_when_set(params, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TorchEstimator(**params)


@pytest.mark.parametrize("params, message", [
    (dict(input_shapes=[[-1, 4], [-1, 4]]), r"input_shapes has 2 shape\(s\) for 1 feature"),
    (dict(label_shapes=[[-1], [-1]]), r"label_shapes has 2 shape\(s\) for 1 label"),
    (dict(loss_weights=[1.0, 2.0]), r"loss_weights has 2 weight\(s\) for 1 label"),
    (dict(loss=None, loss_constructors=[1]), r"loss_constructors must be callable"),
    (dict(train_minibatch_fn=lambda *a: None, mixed_precision="fp16"),
     r"mixed_precision='fp16' cannot be combined with train_minibatch_fn"),
    (dict(metrics=[[abs, abs]]), r"metrics: the group"),
])
def test_bad_combinations_fail_before_any_spark_job(spark, store, regression_df, params, message):
    est = linear_estimator(store, **params)
    with pytest.raises((TypeError, ValueError), match=message):
        est.fit(regression_df)


def test_loss_and_loss_constructors_are_exclusive(store):
    with pytest.raises(ValueError, match="give loss or loss_constructors, not both"):
        linear_estimator(store, loss_constructors=[lambda **kw: torch.nn.MSELoss()])


def test_input_shape_that_does_not_hold_the_column_fails_before_launch(spark, store,
                                                                       regression_df):
    est = linear_estimator(store, input_shapes=[[-1, 1, 3]])
    with pytest.raises(ValueError, match=r"input_shapes: column 'features' has 4 value\(s\) per "
                                         r"row .* do not fit the shape \[-1, 1, 3\]"):
        est.fit(regression_df)


# -- what each param does ------------------------------------------------------------------------
class NeedsSquares(torch.nn.Module):
    """Refuses anything but (batch, 2, 2) input: proves input_shapes is applied."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        if x.dim() != 3 or tuple(x.shape[1:]) != (2, 2):
            raise ValueError(f"expected (batch, 2, 2) input, got {tuple(x.shape)}")
        return self.linear(x.reshape(-1, 4))


def mse_on_boxed_labels(output, label):
    """label_shapes=[[-1, 1, 1]]: labels arrive as (batch, 1, 1), not reshaped to the output."""
    if label.dim() != 3:
        raise ValueError(f"expected (batch, 1, 1) labels, got {tuple(label.shape)}")
    return torch.nn.functional.mse_loss(output, label.reshape(output.shape))


def horovod_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                      sample_weights, backward_passes_per_step, batch_idx):
    """Horovod 0.28.1's default ``_train_minibatch_fn`` (horovod/spark/torch/remote.py),
    checking the arguments it is given."""
    if not (isinstance(inputs, list) and isinstance(labels, list) and sample_weights is None
            and backward_passes_per_step == 2):
        raise AssertionError("train_minibatch_fn got unexpected arguments")
    if batch_idx % backward_passes_per_step == 0:
        if batch_idx != 0:
            optimizer.step()
        optimizer.zero_grad()
    outputs = model(*inputs)
    outputs, labels = transform_outputs(outputs, labels)
    loss = loss_fn(outputs, labels, sample_weights)
    if backward_passes_per_step > 1:
        loss.div_(float(backward_passes_per_step))
    loss.backward()
    return outputs, loss


def mae(output, label):
    return (output - label.reshape(output.shape)).abs().mean()


def test_input_shapes_label_shapes_minibatch_fn_in_training_transform_and_save(
        spark, store, regression_df, tmp_path):
    """One fit with Horovod's shape params, a Horovod train_minibatch_fn, metric groups and
    reader params: the model only accepts (batch, 2, 2) inputs, the loss only (batch, 1, 1)
    labels; training converges; transform, save/load and a hand-built TorchModel reshape the
    same way; the reader params without an equivalent give ONE warning."""
    torch.manual_seed(0)
    net = NeedsSquares()
    est = linear_estimator(
        store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=mse_on_boxed_labels, input_shapes=[[-1, 2, 2]], label_shapes=[[-1, 1, 1]],
        train_minibatch_fn=horovod_minibatch, backward_passes_per_step=2, metrics=[[mae]],
        epochs=3, reader_pool_type="process", shuffle_buffer_size=1000,
        partitions_per_process=4, mp_start_method="spawn", train_reader_num_workers=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = est.fit(regression_df)
    ignored = [w for w in caught if issubclass(w.category, IgnoredParamWarning)]
    assert len(ignored) == 1
    for name in ("reader_pool_type='process'", "shuffle_buffer_size", "partitions_per_process",
                 "mp_start_method"):
        assert name in str(ignored[0].message)
    history = model.getHistory()
    assert history["loss"][-1] < 0.05 and history["mae"][-1] < 0.2
    assert model.getInputShapes() == [[-1, 2, 2]]
    assert isinstance(model.getOptimizer(), torch.optim.SGD) and model.getOptimizer().state_dict()

    row = regression_df.limit(8)
    expected = model.transform(row).select("label__output").toPandas()["label__output"]
    model.write().overwrite().save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"))
    assert loaded.getInputShapes() == [[-1, 2, 2]]
    again = loaded.transform(row).select("label__output").toPandas()["label__output"]
    np.testing.assert_allclose(again, expected, rtol=1e-6)

    by_hand = TorchModel(model=model.getModel(), feature_columns=["features"],
                         label_columns=["label"], input_shapes=[[-1, 2, 2]])
    out = by_hand.setOutputCols(["y_hat"]).transform(row).select("y_hat").toPandas()["y_hat"]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_minibatch_fn_with_horovods_contract_computes_the_builtin_steps(spark, store,
                                                                        regression_df):
    """Horovod's default minibatch function (zero_grad/step at group starts, a last step after
    the epoch) and sparktrain's built-in step are the same SGD steps. The history records the
    loss the function returns, which it divided by backward_passes_per_step (as Horovod's own
    history does): exactly half the built-in's, epoch after epoch, when the steps agree."""
    params = dict(shuffle=False, epochs=2, backward_passes_per_step=2, seed=3)
    builtin = linear_estimator(store, **params).fit(regression_df).getHistory()["loss"]
    custom = linear_estimator(store, train_minibatch_fn=horovod_minibatch, **params) \
        .fit(regression_df).getHistory()["loss"]
    np.testing.assert_allclose(np.array(custom) * 2, builtin, rtol=1e-5)


def build_mse(rank, world_size, **context):
    """A Horovod-style loss constructor; sparktrain passes the rank and world size (1 in the
    driver's preflight, 2 on the ranks)."""
    if world_size not in (1, 2) or rank not in (0, 1) or "model" not in context:
        raise AssertionError("loss constructor got unexpected arguments")
    return torch.nn.MSELoss()


def test_loss_constructors_and_loss_weights(spark, store, regression_df):
    """The loss is built on each rank; a weight of 0 makes the total loss 0 (no training)."""
    est = linear_estimator(store, loss=None, loss_constructors=[build_mse], loss_weights=[0.0],
                           epochs=2)
    before = {k: v.clone() for k, v in est.getModel().state_dict().items()}
    model = est.fit(regression_df)
    assert model.getHistory()["loss"] == [0.0, 0.0]
    for key, value in model.getModel().state_dict().items():
        assert torch.equal(value, before[key])
    weighted = linear_estimator(store, loss_weights=[3.0], epochs=1, lr=0.0).fit(regression_df)
    plain = linear_estimator(store, epochs=1, lr=0.0).fit(regression_df)
    np.testing.assert_allclose(weighted.getHistory()["loss"], [3 * plain.getHistory()["loss"][0]],
                               rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "horovod"])
def test_gradient_compression_fp16(spark, store, regression_df, backend):
    """horovod.torch.Compression.fp16: Horovod's compressor on backend='horovod', DDP's
    fp16_compress_hook on 'torch'. Training converges, and the steps differ (fp16-rounded
    gradients) from uncompressed ones computed from the same start."""
    import horovod.torch as hvd

    params = dict(shuffle=False, epochs=3, backend=backend, seed=4)
    plain = linear_estimator(store, **params).fit(regression_df).getHistory()["loss"]
    fp16 = linear_estimator(store, gradient_compression=hvd.Compression.fp16, **params) \
        .fit(regression_df).getHistory()["loss"]
    assert fp16[-1] < 0.05
    assert fp16 != plain
    np.testing.assert_allclose(fp16, plain, rtol=1e-2)


class EnvCheck:
    """A torch callback that fails unless backend_env reached the rank's process."""

    def on_train_begin(self, model, history):
        if os.environ.get("SPARKTRAIN_PARITY_ENV") != "42":
            raise RuntimeError("backend_env did not reach the rank")


def test_backend_env_reaches_every_torch_rank_and_is_restored(spark, store, regression_df):
    est = linear_estimator(store, backend_env={"SPARKTRAIN_PARITY_ENV": 42}, epochs=1,
                           callbacks=[EnvCheck()])
    assert est.getBackendEnv() == {"SPARKTRAIN_PARITY_ENV": "42"}
    est.fit(regression_df)
    with pytest.raises(TrainingError, match="backend_env did not reach the rank"):
        linear_estimator(store, epochs=1, callbacks=[EnvCheck()], max_attempts=1) \
            .fit(regression_df)


def test_estimator_with_horovod_params_saves_and_loads(spark, tmp_path):
    import horovod.torch as hvd

    params = dict(input_shapes=[[-1, 2, 2]], label_shapes=[[-1, 1]], loss_weights=[0.5],
                  backend_env={"A": "1"}, reader_pool_type="dummy", train_reader_num_workers=3,
                  partitions_per_process=4)
    objects = dict(gradient_compression=hvd.Compression.fp16, loss_constructors=[build_mse],
                   train_minibatch_fn=horovod_minibatch)
    TorchEstimator(**params, **objects).write().overwrite().save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    for name, value in params.items():
        if name != "backend_env":  # its values are not saved (they often hold tokens)
            assert loaded.getOrDefault(name) == value, name
    assert loaded.getGradientCompression() is hvd.Compression.fp16
    assert loaded.getTrainMinibatchFn().__name__ == "horovod_minibatch"
    assert loaded.getLossConstructors()[0].__name__ == "build_mse"


def test_reader_params_map_to_the_reader():
    def prefetch(options):
        return {k: options[k] for k in ("train_prefetch", "val_prefetch")}

    assert prefetch(reader_options(TorchEstimator())) == {"train_prefetch": 2, "val_prefetch": 2}
    est = TorchEstimator(train_reader_num_workers=5, val_reader_num_workers=0)
    assert reader_options(est) == {"train_prefetch": 5, "val_prefetch": 0, "reader_pool": "thread",
                                   "train_decode_workers": 5, "val_decode_workers": 1,
                                   "mp_start_method": None}
    dummy = TorchEstimator(reader_pool_type="dummy", train_reader_num_workers=4)
    assert prefetch(reader_options(dummy)) == {"train_prefetch": 0, "val_prefetch": 0}
    spawn = TorchEstimator(reader_pool_type="process", mp_start_method="spawn")
    assert reader_options(spawn)["mp_start_method"] == "spawn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'dummy' and 'thread' have an equivalent: no warning
        warn_ignored(dummy)
        warn_ignored(TorchEstimator(reader_pool_type="thread", compress_sparse_cols=False))
    with pytest.warns(IgnoredParamWarning, match="data_module.*\n.*categorical_cols"):
        warn_ignored(TorchEstimator(data_module=object, categorical_cols=["c"]))


def test_store_create_takes_horovods_keywords(tmp_path):
    from horovod.spark.common.store import Store as HorovodStore

    hdfs = Store.create(prefix_path="hdfs:///user/me/runs", host="nn1", port=8020, user="me",
                        kerb_ticket="/tmp/krb5cc")
    assert hdfs.prefix == "hdfs://nn1:8020/user/me/runs"
    assert hdfs.storage_options == {"user": "me", "kerb_ticket": "/tmp/krb5cc"}
    with pytest.warns(IgnoredParamWarning, match=r"runs_path.*\n.*save_runs=False"):
        local = Store.create(str(tmp_path), runs_path=str(tmp_path / "r"), save_runs=False)
    assert local.prefix == str(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['runpath'\]"):
        Store.create(str(tmp_path), runpath="x")
    with pytest.raises(ValueError, match="disagree with the namenode"):
        Store.create("hdfs://nn1:8020/x", host="nn2")
    theirs = HorovodStore.create(str(tmp_path / "h"), storage_options={"auto_mkdir": True})
    ours = Store.create(theirs)
    assert ours.prefix == str(tmp_path / "h") and ours.storage_options == {"auto_mkdir": True}


# -- Keras ----------------------------------------------------------------------------------------
class KerasEnvCheck:
    """Built lazily: keras.callbacks.Callback needs Keras imported."""

    @staticmethod
    def make():
        import keras

        class EnvCheckCallback(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                if os.environ.get("SPARKTRAIN_PARITY_ENV") != "keras":
                    raise RuntimeError("backend_env did not reach the Keras worker")

        return EnvCheckCallback()


@pytest.mark.full
def test_keras_horovod_params(spark, store, regression_df, tmp_path):
    """One Keras fit: features reshaped to the model's (2, 2) input as Horovod does,
    label_shapes, loss_weights, backend_env in the worker process, checkpoint_callback with
    save_best_only (monitor 'loss', mode 'max': the best epoch is the first, so the fitted
    model is not the last epoch's), and one warning for what has no equivalent."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from sparktrain import KerasEstimator
    from sparktrain.loop.checkpoint import Checkpoints
    from sparktrain.loop.keras_loop import _read_checkpoint

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((2, 2)), keras.layers.Flatten(), keras.layers.Dense(1)])
    best = keras.callbacks.ModelCheckpoint(str(tmp_path / "c.keras"), monitor="loss",
                                           mode="max", save_best_only=True)
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                         feature_cols=["features"], label_cols=["label"],
                         label_shapes=[[-1, 1]], loss_weights=[2.0], epochs=3, batch_size=32,
                         backend_env={"SPARKTRAIN_PARITY_ENV": "keras"},
                         callbacks=[KerasEnvCheck.make()], checkpoint_callback=best,
                         gradient_compression="fp16", partitions_per_process=2, store=store,
                         run_id="keras-parity", verbose=0, random_seed=0)
    assert est.get_model_shapes() == ([[-1, 2, 2]], [[-1, 1]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = est.fit(regression_df)
    ignored = [w for w in caught if issubclass(w.category, IgnoredParamWarning)]
    assert len(ignored) == 1 and "gradient_compression" in str(ignored[0].message) \
        and "partitions_per_process" in str(ignored[0].message)
    losses = model.getHistory()["loss"]
    assert losses[0] > losses[-1]  # it trained; the weight 2 doubles the MSE
    run = Store.create(store).run_path("keras-parity")
    with open(os.path.join(run, "checkpoint_callback", "best.keras"), "rb") as f:
        assert model._model_file.read_bytes() == f.read()
    checkpoints = Checkpoints(run)
    last_model, _ = _read_checkpoint(checkpoints.read(checkpoints.latest()))
    assert last_model != model._model_file.read_bytes()
    predictions = model.transform(regression_df.limit(5)).toPandas()["label__output"]
    assert predictions.notna().all()


def test_fp16_loss_scaling_on_horovod_fails_before_launch(spark, store, regression_df):
    """The engine says it cannot wrap fp16 loss scaling; checked before the GPU check."""
    with pytest.raises(ValueError, match="not supported with backend='horovod'.*use 'bf16'"):
        linear_estimator(store, backend="horovod", mixed_precision="fp16").fit(regression_df)
