"""GPU inference in ``TorchModel.transform`` / ``KerasModel.transform``: the device choice, the
``use_gpu`` and ``resource_profile`` params. Spark's real GPU assignment to prediction tasks:
tests/test_gpu_clusters.py (a cluster whose Workers announce fake GPUs)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from sparktrain import TorchModel
from sparktrain.launch.gpus import cuda_ordinal, rank_gpu


# -- the device choice (pure functions) ----------------------------------------------------------
def test_use_gpu_none_takes_the_tasks_first_gpu_if_any():
    assert rank_gpu({"gpu": ["1", "0"]}, None) == "1"
    assert rank_gpu({}, None) is None
    assert rank_gpu({"gpu": []}, None) is None
    assert rank_gpu({"gpu": ["1"]}, False) is None
    assert rank_gpu({"gpu": ["1"]}, True) == "1"
    with pytest.raises(RuntimeError, match=r"use_gpu=True but Spark assigned no GPU to this "
                                           r"task; set spark\.task\.resource\.gpu\.amount=1"):
        rank_gpu({}, True)


def test_cuda_ordinal_checks_the_address():
    assert cuda_ordinal("1", 2, "torch") == 1
    with pytest.raises(RuntimeError, match="GPU 2 to this task, but torch sees 2 GPU"):
        cuda_ordinal("2", 2, "torch")
    with pytest.raises(RuntimeError, match="CUDA device ordinals"):
        cuda_ordinal("GPU-5e1c", 2, "TensorFlow")


def test_a_gpu_without_cuda_is_a_clear_error():
    from sparktrain.estimators.torch_model import predict_device

    assert predict_device(None) == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    with pytest.raises(RuntimeError, match=rf"GPU 1 to this prediction task, but torch "
                                           rf"{re.escape(torch.__version__)} cannot use CUDA"
                                           r".*setUseGpu"):
        predict_device("1")


# -- params on a local session (no GPUs) ---------------------------------------------------------
def _linear_model():
    torch.manual_seed(0)
    return TorchModel(model=torch.nn.Linear(3, 2), feature_columns=["features"],
                      label_columns=["y"])


@pytest.fixture(scope="module")
def features_df(spark):
    rng = np.random.default_rng(0)
    rows = [(rng.normal(size=3).tolist(), 0.0) for _ in range(40)]
    return spark.createDataFrame(rows, "features array<double>, y double")


def test_use_gpu_true_without_gpus_fails_naming_the_conf(features_df):
    model = _linear_model().setUseGpu(True)
    with pytest.raises(Exception, match=r"use_gpu=True but Spark assigned no GPU to this task; "
                                        r"set spark\.task\.resource\.gpu\.amount=1"):
        model.transform(features_df).collect()


def test_use_gpu_false_and_none_predict_on_cpu(features_df):
    model = _linear_model()
    assert model.getUseGpu() is None
    x = np.array([r.features for r in features_df.collect()], dtype=np.float32)
    expected = model.getModel()(torch.from_numpy(x)).detach().numpy()
    for use_gpu in (None, False):
        out = model.setUseGpu(use_gpu).transform(features_df).toPandas()
        np.testing.assert_allclose(np.stack(out["y__output"]), expected, rtol=1e-5)


def test_use_gpu_saves_loads_and_old_models_load(spark, features_df, tmp_path):
    from sparktrain import KerasModel

    model = _linear_model()
    model.transform(features_df)  # completes the hand-built model (column specs, shapes)
    for value in (False, True, None):
        path = str(tmp_path / f"torch-{value}")
        model.setUseGpu(value).write().overwrite().save(path)
        assert TorchModel.load(path).getUseGpu() is value
    # saved before use_gpu existed: no such key in the metadata -> the default, None
    meta_dir = os.path.join(path, "metadata")
    part = next(f for f in os.listdir(meta_dir) if f.startswith("part-"))
    metadata = json.loads(open(os.path.join(meta_dir, part)).read())
    for key in ("paramMap", "defaultParamMap"):
        metadata[key].pop("use_gpu", None)
        metadata[key].pop("resource_profile", None)
    with open(os.path.join(meta_dir, part), "w") as f:
        f.write(json.dumps(metadata) + "\n")
    os.remove(os.path.join(meta_dir, f".{part}.crc"))  # Hadoop's checksum of the old text
    old = TorchModel.load(path)
    assert old.getUseGpu() is None
    assert old.transform(features_df).count() == 40

    import keras

    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    keras_model = KerasModel(model=net, feature_columns=["features"], label_columns=["y"])
    path = str(tmp_path / "keras")
    keras_model.setUseGpu(False).write().overwrite().save(path)
    assert KerasModel.load(path).getUseGpu() is False


def test_fitted_model_carries_the_estimators_use_gpu(spark, store, regression_df, tmp_path):
    from support.helpers import linear_estimator

    model = linear_estimator(store, num_proc=1, epochs=1, use_gpu=False).fit(regression_df)
    assert model.getUseGpu() is False
    path = str(tmp_path / "fitted")
    model.write().overwrite().save(path)
    assert TorchModel.load(path).getUseGpu() is False


def test_resource_profile_param_is_checked_and_not_saved(spark, features_df, tmp_path):
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    with pytest.raises(TypeError, match="resource_profile must be a pyspark.resource"):
        _linear_model().setResourceProfile({"gpu": 1})
    profile = ResourceProfileBuilder().require(TaskResourceRequests().cpus(1)).build
    model = _linear_model().setResourceProfile(profile)
    assert model.getResourceProfile() is profile
    model.transform(features_df)
    path = str(tmp_path / "profiled")
    model.write().overwrite().save(path)
    assert TorchModel.load(path).getResourceProfile() is None


def test_a_changed_model_is_not_served_from_a_workers_cache(spark):
    """Executors keep a predictor per model; new weights (setModel, or changed in place)
    must predict with the new weights in the same reused Python worker."""
    import torch

    from sparktrain import TorchModel

    net = torch.nn.Linear(2, 1)
    df = spark.createDataFrame([([1.0, 2.0],)], "features array<double>")
    model = TorchModel(model=net, feature_columns=["features"], label_columns=["y"])
    model._output_shapes = [[1]]
    before = model.transform(df).first()["y__output"]
    with torch.no_grad():
        net.bias += 10.0  # in place
    after = model.transform(df).first()["y__output"]
    assert after == pytest.approx(before + 10.0, abs=1e-4)
    replaced = torch.nn.Linear(2, 1)
    with torch.no_grad():
        replaced.weight.zero_()
        replaced.bias.fill_(-3.0)
    assert model.setModel(replaced).transform(df).first()["y__output"] == pytest.approx(-3.0)
