"""Spark ML persistence for sparktrain estimators and models.

Layout under a saved path (any Hadoop/fsspec filesystem)::

    metadata/        Spark ML JSON metadata (class, uid, JSON-able params, extra fields)
    objects.pkl      estimators: cloudpickled object params (model, optimizer, loss, ...)
    model/           models: framework files (e.g. architecture.pkl + weights.pt for torch)

Loading unpickles Python objects: only load paths you trust, as with any pickle.
``PipelineModel.load`` finds the class in ``metadata`` and calls its ``load``.
"""
from __future__ import annotations

from typing import Any, Dict, Type, TypeVar

import cloudpickle
from pyspark import SparkContext
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparktrain.data.store import filesystem, to_fsspec_url
from sparktrain.params import json_params, object_params
from sparktrain.pickling import dumps

T = TypeVar("T")


def qualified_url(sc: SparkContext, path: str) -> str:
    """``path`` resolved the way Spark resolves it (default filesystem, working directory),
    in fsspec form, so Python writes land next to Spark's ``metadata``."""
    jvm = sc._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    fs = hadoop_path.getFileSystem(sc._jsc.hadoopConfiguration())
    return to_fsspec_url(fs.makeQualified(hadoop_path).toString())


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


class EstimatorWriter(MLWriter):
    """JSON params in ``metadata``, object params (model, optimizer...) in ``objects.pkl``."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc,
                                         paramMap=json_params(self.instance))
        write_file(self.sc, path, "objects.pkl", dumps(object_params(self.instance)))


class EstimatorReader(MLReader):
    def __init__(self, cls: Type[T]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
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
    def __init__(self, cls: Type[T]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        files = {name: read_file(self.sc, f"{path}/model", name)
                 for name in metadata["framework_files"]}
        instance = self.cls._from_saved(metadata, files)
        instance._resetUid(metadata["uid"])
        _apply_params(instance, metadata)
        return instance
