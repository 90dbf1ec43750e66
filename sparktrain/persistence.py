"""Spark ML persistence for sparktrain estimators and models.

Layout under a saved path (any Hadoop/fsspec filesystem)::

    metadata/        Spark ML JSON metadata (class, uid, JSON-able params, extra fields)
    objects.pkl      estimators: cloudpickled object params (model, optimizer, loss, ...)
    model/           models: framework files (e.g. architecture.pkl + weights.pt for torch)

Loading runs code. ``objects.pkl`` and a torch model's ``architecture.pkl`` are cloudpickle
files, and unpickling them can execute any Python code that whoever wrote them put there:
``TorchEstimator.load``, ``TorchModel.load``, ``KerasEstimator.load``, ``KerasModel.load`` and
``PipelineModel.load`` of a pipeline holding them are as safe as ``pickle.load`` on the same
files. Load only paths you trust (written by you, or by someone you would let run code on
your driver and executors). ``PipelineModel.load`` finds the class in ``metadata`` and calls
its ``load``.

A saved estimator never holds the store's ``storage_options`` (they may be credentials): its
``Store`` is saved with the prefix only, with a warning; set it again after loading, e.g.
``est.setParams(store=Store.create(url, storage_options=...))``.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Type, TypeVar

import cloudpickle
from pyspark import SparkContext
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparktrain.data.store import Store, filesystem, to_fsspec_url
from sparktrain.params import json_params, object_params
from sparktrain.pickling import dumps
from sparktrain.spark_jvm import qualified_path

T = TypeVar("T")


def qualified_url(sc: SparkContext, path: str) -> str:
    """``path`` resolved the way Spark resolves it (default filesystem, working directory),
    in fsspec form, so Python writes land next to Spark's ``metadata``."""
    return to_fsspec_url(qualified_path(sc, path))


def write_file(sc: SparkContext, path: str, name: str, data: bytes) -> None:
    fs, root = filesystem(qualified_url(sc, path))
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{name}", "wb") as f:
        f.write(data)


def read_file(sc: SparkContext, path: str, name: str) -> bytes:
    fs, root = filesystem(qualified_url(sc, path))
    with fs.open(f"{root}/{name}", "rb") as f:
        return f.read()


def _apply_params(instance: Any, metadata: Dict[str, Any]) -> None:
    params = {p.name: p for p in instance.params}
    values = {name: value for name, value in metadata["paramMap"].items() if name in params}
    instance._set(**values)


def _without_credentials(objects: Dict[str, Any], owner: Any) -> Dict[str, Any]:
    """``objects`` with a ``Store`` that has ``storage_options`` replaced by its prefix alone."""
    store = objects.get("store")
    if not isinstance(store, Store) or not store.storage_options:
        return objects
    warnings.warn(f"{type(owner).__name__} is saved without its store's storage_options "
                  f"(they may hold credentials); after loading, set them again with "
                  f"setParams(store=Store.create({store.prefix!r}, storage_options=...))",
                  UserWarning, stacklevel=4)
    return dict(objects, store=Store(store.prefix))


class EstimatorWriter(MLWriter):
    """JSON params in ``metadata``, object params (model, optimizer...) in ``objects.pkl``;
    the store's ``storage_options`` are left out (see the module docstring)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc,
                                         paramMap=json_params(self.instance))
        objects = _without_credentials(object_params(self.instance), self.instance)
        write_file(self.sc, path, "objects.pkl", dumps(objects))


class EstimatorReader(MLReader):
    """Reads what :class:`EstimatorWriter` wrote. Unpickles ``objects.pkl``, which runs code:
    load only trusted paths."""

    def __init__(self, cls: Type[T]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The estimator saved at ``path``. Unpickling its model, optimizer, loss, metrics and
        callbacks can run arbitrary code: load only paths you trust."""
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        _apply_params(instance, metadata)
        instance._set(**cloudpickle.loads(read_file(self.sc, path, "objects.pkl")))
        return instance


class ModelWriter(MLWriter):
    """JSON params and model metadata in ``metadata``; framework files under ``model/``."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc,
                                         extraMetadata=self.instance._extra_metadata(),
                                         paramMap=json_params(self.instance))
        for name, data in self.instance._framework_files().items():
            write_file(self.sc, f"{path}/model", name, data)


class ModelReader(MLReader):
    """Reads what :class:`ModelWriter` wrote; the framework's files may be pickles (a torch
    model's architecture, Keras custom objects), which run code: load only trusted paths."""

    def __init__(self, cls: Type[T]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The model saved at ``path``. Unpickling its framework files can run arbitrary code:
        load only paths you trust."""
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        files = {name: read_file(self.sc, f"{path}/model", name)
                 for name in metadata["framework_files"]}
        instance = self.cls._from_saved(metadata, files)
        instance._resetUid(metadata["uid"])
        _apply_params(instance, metadata)
        return instance
