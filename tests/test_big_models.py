"""Models of any size: weights travel through files (issue #28), never inside a closure.

Spark-free: the weights-by-key pickle, the file reference and its per-host copy, the worker
cache. With the shared local[2] session: a fitted model predicts from its file in the store
with a UDF of a few KiB, saves by streaming that file, and loads and predicts by reference; a
re-saved path is never served stale; a file removed between fit and transform is named.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.big_models import DirtyWeightPages, FrozenTable  # noqa: E402 - after the skip


def test_the_pickle_refers_to_weights_by_key_and_keeps_ties_and_the_optimizer(tmp_path):
    from sparktrain.loop.torch_files import (
        ShippedModule,
        dumps_without_weights,
        load_module,
        load_weights,
        save_weights,
    )

    net = torch.nn.Sequential(torch.nn.Embedding(50_000, 64), torch.nn.Linear(64, 50_000))
    net[1].weight = net[0].weight  # tied, as a language model's input and output embeddings
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    architecture = dumps_without_weights(net, net)
    assert len(architecture) < 16_384  # KiB, against 12.8 MB of weights

    ref = save_weights(net.state_dict(), str(tmp_path / "weights.pt"))
    assert os.path.getsize(tmp_path / "weights.pt") < 13_500_000  # the tied table stored once
    loaded = load_module(architecture, load_weights(ref.local_path()))
    assert loaded[1].weight is loaded[0].weight and not loaded.training
    torch.testing.assert_close(loaded[0].weight, net[0].weight)

    module, opt = ShippedModule.of(net, optimizer, ref).load()
    assert opt.param_groups[0]["params"][0] is module[0].weight  # bound to the loaded module
    module(torch.tensor([1, 2])).sum().backward()
    opt.step()  # trains on the mapped file's pages (copy-on-write): the file is unchanged
    torch.testing.assert_close(load_weights(ref.local_path())["0.weight"], net[0].weight)


def test_a_module_pickled_with_meta_tensors_still_loads(tmp_path):
    """Models saved before weights were referenced by key: meta tensors in the pickle."""
    import copy
    import io

    from sparktrain.loop.torch_files import load_module
    from sparktrain.pickling import dumps

    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    skeleton = copy.deepcopy(net).to("meta")
    state = torch.load(io.BytesIO(_saved(net.state_dict())), weights_only=True)
    loaded = load_module(dumps(skeleton), state)
    for key, value in net.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_file_reference_is_small_and_names_a_replaced_or_missing_file(tmp_path):
    from sparktrain.model_files import ModelFile, ModelFileChanged

    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    ref = ModelFile.of(str(path))
    assert len(pickle.dumps(ref)) < 1000 and ref.read_bytes() == b"x" * 1000
    os.utime(path, (1, 1))  # replaced: another save wrote the same path
    with pytest.raises(ModelFileChanged, match="w.bin"):
        ref.local_path()
    path.unlink()
    with pytest.raises(FileNotFoundError, match="w.bin"):
        ModelFile.of(str(path)).local_path()


def test_a_remote_file_is_copied_once_per_host(tmp_path, monkeypatch):
    """An fsspec filesystem that is not local (the in-memory one stands for HDFS/S3): the
    first reader copies it under LOCAL_COPIES, every later one uses that copy."""
    import fsspec

    from sparktrain import model_files

    monkeypatch.setattr(model_files, "LOCAL_COPIES", str(tmp_path / "copies"))
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bucket/model/weights.pt", b"w" * 5000)
    opened = []
    original = fs.open
    monkeypatch.setattr(fs, "open", lambda *a, **k: opened.append(a[0]) or original(*a, **k))
    ref = model_files.ModelFile.of("memory://bucket/model/weights.pt")
    first = ref.local_path()
    assert first.startswith(str(tmp_path / "copies")) and open(first, "rb").read() == b"w" * 5000
    assert ref.local_path() == first and len(opened) == 1
    assert sorted(os.listdir(os.path.dirname(first))) == [".lock", "weights.pt"]  # no partial copy


@pytest.fixture(scope="module")
def fitted(spark, regression_df, tmp_path_factory):
    from sparktrain import TorchEstimator

    store = str(tmp_path_factory.mktemp("big-store"))
    pages = tmp_path_factory.mktemp("dirty-pages")
    net = FrozenTable(rows=120_000)  # 29 MiB of frozen table, 69 trained parameters
    est = TorchEstimator(num_proc=2, model=net, store=store,
                         optimizer=torch.optim.Adam(net.head.parameters(), lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=64, epochs=3, verbose=0,
                         callbacks=[DirtyWeightPages(str(pages))])
    fitted = est.fit(regression_df)
    dirty_kib = {name: int((pages / name).read_text()) for name in os.listdir(pages)}
    return fitted, net, store, dirty_kib


def test_ranks_share_the_shipped_weights_pages(fitted):
    """Every rank maps the same weights file and none writes the frozen table: DDP's initial
    broadcast is skipped (it would write all 29 MiB on rank 1), so each rank's private copy
    of that file is only the trained head's pages."""
    dirty_kib = fitted[3]
    assert len(dirty_kib) == 2, dirty_kib
    assert max(dirty_kib.values()) < 1024, dirty_kib  # KiB, of a 29 MiB file


def test_a_fitted_model_predicts_from_its_file_with_a_small_udf(fitted, regression_df):
    import cloudpickle

    model, net, store, _ = fitted
    assert model._model is None  # nothing loaded in the driver by the fit
    factory = model._predict_fn_factory()
    assert len(cloudpickle.dumps(factory)) < 1 << 20  # < 1 MiB, against 29 MiB of weights
    weights = model._files.weights.url
    assert weights.startswith(store) and os.path.getsize(weights) > 29 << 20
    history = model.getHistory()["loss"]
    assert history[-1] < history[0]

    predicted = model.transform(regression_df).select("label", "label__output").toPandas()
    error = float(np.mean((predicted["label"] - predicted["label__output"]) ** 2))
    assert error < 0.5 * float(np.var(predicted["label"]))
    trained = model.getModel()  # now mapped in the driver
    torch.testing.assert_close(trained.table.weight, net.table.weight)  # frozen: unchanged
    assert model.getOptimizer().param_groups[0]["params"][0] is trained.head.weight


def test_save_streams_the_file_and_load_predicts_by_reference(fitted, regression_df, tmp_path):
    from sparktrain import TorchModel

    model, *_ = fitted
    path = str(tmp_path / "m")
    model.write().overwrite().save(path)
    assert os.path.getsize(os.path.join(path, "model", "weights.pt")) > 29 << 20
    loaded = TorchModel.load(path)
    assert loaded._model is None and loaded._files.weights.url.startswith(path)
    a = model.transform(regression_df.limit(50)).select("label__output").toPandas()
    b = loaded.transform(regression_df.limit(50)).select("label__output").toPandas()
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-6)


def test_a_resaved_path_is_never_served_stale(spark, regression_df, tmp_path):
    """Two models saved in turn under one path: each load predicts its own weights, and an
    object loaded before the path was overwritten fails naming the file."""
    from sparktrain import TorchModel

    path = str(tmp_path / "m")
    rows = regression_df.limit(20)
    outputs = []
    for bias in (1.0, -7.0):
        net = FrozenTable(rows=16)
        torch.nn.init.zeros_(net.head.weight)
        torch.nn.init.constant_(net.head.bias, bias)
        hand = TorchModel(net, feature_columns=["features"], label_columns=["label"])
        hand._complete(rows)  # its input columns and output shape, as transform would
        hand.write().overwrite().save(path)
        loaded = TorchModel.load(path)
        outputs.append(loaded.transform(rows).select("label__output").toPandas())
        if bias == 1.0:
            first = loaded
    assert set(outputs[0]["label__output"]) == {1.0}
    assert set(outputs[1]["label__output"]) == {-7.0}
    with pytest.raises(Exception, match="weights.pt"):
        first.transform(rows).collect()


def test_a_weights_file_removed_after_the_fit_is_named(spark, regression_df, tmp_path):
    from sparktrain import TorchModel

    net = FrozenTable(rows=16)
    saved = str(tmp_path / "gone")
    hand = TorchModel(net, feature_columns=["features"], label_columns=["label"])
    hand._complete(regression_df)
    hand.write().save(saved)
    model = TorchModel.load(saved)
    os.remove(os.path.join(saved, "model", "weights.pt"))
    with pytest.raises(Exception, match="gone/model/weights.pt"):
        model.transform(regression_df.limit(5)).collect()


def test_a_large_module_built_in_the_driver_goes_through_a_file(spark, regression_df,
                                                                monkeypatch):
    from sparktrain import TorchModel
    from sparktrain.estimators import torch_model

    monkeypatch.setattr(torch_model, "INLINE_WEIGHTS_BYTES", 1 << 10)
    net = FrozenTable(rows=1024)
    model = TorchModel(net, feature_columns=["features"], label_columns=["label"])
    out = model.transform(regression_df.limit(10)).select("label__output").toPandas()
    assert model._files is not None and os.path.exists(model._files.weights.url)
    expected = net(torch.tensor(np.stack(regression_df.limit(10).toPandas()["features"]
                                         .map(lambda v: v.toArray())), dtype=torch.float32))
    np.testing.assert_allclose(out["label__output"], expected.detach().numpy().ravel(), rtol=1e-5)
    with torch.no_grad():
        net.head.bias.add_(100.0)  # changed in place: written again, not served stale
    again = model.transform(regression_df.limit(10)).select("label__output").toPandas()
    np.testing.assert_allclose(again["label__output"], out["label__output"] + 100.0, rtol=1e-5)


BUILT_ON = []  # the device of each FrozenTable a Builder makes in this (the driver's) process


class Builder:
    """A model callable, as ``lambda: AutoModel.from_pretrained(path)`` would be."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.model_class = FrozenTable  # held, so its module travels by value with the builder

    def __call__(self):
        torch.manual_seed(0)
        net = self.model_class(rows=self.rows)
        BUILT_ON.append(net.table.weight.device.type)
        return net


def test_a_model_callable_trains_without_the_driver_building_its_weights(spark, regression_df,
                                                                        tmp_path):
    from sparktrain import TorchEstimator

    BUILT_ON.clear()
    est = TorchEstimator(num_proc=2, model=Builder(rows=20_000), store=str(tmp_path),
                         optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=64, epochs=2, verbose=0)
    model = est.fit(regression_df)
    assert BUILT_ON and set(BUILT_ON) == {"meta"}  # the driver checked shapes on meta only
    assert model._model is None and model._files.weights.url.startswith(str(tmp_path))
    predicted = model.transform(regression_df).select("label", "label__output").toPandas()
    error = float(np.mean((predicted["label"] - predicted["label__output"]) ** 2))
    assert error < 0.5 * float(np.var(predicted["label"]))
    trained = model.getModel()  # the ranks' build, trained: its frozen table as built
    torch.testing.assert_close(trained.table.weight, Builder(rows=20_000)().table.weight)


def test_a_bad_model_callable_fails_before_training_naming_it(spark, regression_df, tmp_path):
    from sparktrain import TorchEstimator
    from sparktrain.errors import PreflightError

    def broken():
        raise OSError("no such checkpoint directory: /dbfs/models/bert")

    common = dict(num_proc=2, store=str(tmp_path), loss=torch.nn.MSELoss(),
                  optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                  feature_cols=["features"], label_cols=["label"], epochs=1, verbose=0)
    with pytest.raises((PreflightError, OSError), match="broken") as raised:
        TorchEstimator(model=broken, **common).fit(regression_df)
    assert "no such checkpoint directory" in str(raised.value)
    with pytest.raises(TypeError, match="returned dict, not a torch.nn.Module"):
        TorchEstimator(model=lambda: {"weights": 1}, **common).fit(regression_df)
    net = FrozenTable(rows=8)
    with pytest.raises(TypeError, match="optimizer must be a callable params -> Optimizer"):
        TorchEstimator(**dict(common, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)),
                       model=lambda: FrozenTable(rows=8)).fit(regression_df)
