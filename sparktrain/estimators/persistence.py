"""Spark ML persistence for sparktrain estimators and models.

Layout under a saved path (any Hadoop/fsspec filesystem)::

    metadata/        Spark ML JSON metadata (class, uid, JSON-able params, extra fields)
    objects.pkl      estimators: cloudpickled object params (model, optimizer, loss, ...)
    model/           models: framework files (e.g. architecture.pkl + weights.pt for torch),
                     and predict_transformation_fn.pkl when the model decodes its inputs;
                     weights are streamed from the store and read by reference on load
                     (:mod:`sparktrain.model_files`), never whole through the driver

Loading runs code. ``objects.pkl`` and a torch model's ``architecture.pkl`` are cloudpickle
files, and unpickling them can execute any Python code that whoever wrote them put there:
``TorchEstimator.load``, ``TorchModel.load``, ``KerasEstimator.load``, ``KerasModel.load`` and
``PipelineModel.load`` of a pipeline holding them are as safe as ``pickle.load`` on the same
files. Load only paths you trust (written by you, or by someone you would let run code on
your driver and executors). ``PipelineModel.load`` finds the class in ``metadata`` and calls
its ``load``.

A saved estimator never holds the store's ``storage_options`` or its ``backend_env`` values
(they may be credentials): its ``Store`` is saved with the prefix only and ``backend_env`` with
the variables' names only (in the metadata's ``backend_env_keys``), with a warning on save and
on load; set them again after loading, e.g.
``est.setParams(store=Store.create(url, storage_options=...), backend_env={"TOKEN": ...})``.
"""
from __future__ import annotations

import posixpath
import warnings
from typing import Any, Dict, List, Optional, Protocol, Tuple, Type
from urllib.parse import unquote

import cloudpickle
from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter
from pyspark.sql import SparkSession

from sparktrain.data.store import Store
from sparktrain.fs import filesystem, to_fsspec_url
from sparktrain.model_files import ModelFile
from sparktrain.options.params import json_params, object_params
from sparktrain.pickling import dumps
from sparktrain.session.spark_api import is_remote

PREDICT_FN_FILE = "model/predict_transformation_fn.pkl"


# Driver-side only (pyspark.ml is imported here, never on a rank).
def ml_context(writer: Any) -> Any:
    """What pyspark's ``DefaultParamsWriter``/``Reader`` take: the SparkContext on a classic
    session (Spark 3.5 needs it), the session itself over Connect (Spark 4 takes either)."""
    return writer.sparkSession if is_remote(writer.sparkSession) else writer.sc


def remove_saved(spark: SparkSession, path: str) -> None:
    """Delete ``path`` for ``write().overwrite()``, resolved by Spark as Spark resolves it."""
    if is_remote(spark):
        # pyspark's own remote writers overwrite through this server-side helper.
        from pyspark.ml.connect.readwrite import RemoteMLWriter

        RemoteMLWriter.handleOverwrite(path, True)
        return
    from sparktrain.session.spark_jvm import remove_path

    remove_path(spark, path)


def saved_root(spark: SparkSession, path: str) -> str:
    """The directory Spark wrote ``path/metadata`` to, fully qualified and in fsspec form, so
    Python's files land next to Spark's (``models/m`` -> ``/home/me/models/m``,
    ``hdfs://nn:8020/user/me/models/m``). Spark resolves ``path`` (default filesystem, working
    directory: the server's, over Connect), so the metadata must exist; its file list says
    where."""
    listed = spark.read.text(f"{path}/metadata").inputFiles()
    if not listed:
        raise FileNotFoundError(f"no Spark ML metadata under {path!r}")
    # Spark lists files as URIs (``file:///a%20b/...``): decode them back to paths.
    return to_fsspec_url(unquote(listed[0].rsplit("/metadata/", 1)[0]))


def write_file(root: str, name: str, data: bytes) -> None:
    fs, directory = filesystem(posixpath.dirname(f"{root}/{name}"))
    fs.makedirs(directory, exist_ok=True)
    with fs.open(f"{directory}/{posixpath.basename(name)}", "wb") as f:
        f.write(data)


def read_file(root: str, name: str) -> bytes:
    fs, path = filesystem(f"{root}/{name}")
    with fs.open(path, "rb") as f:
        return f.read()


def write_model_files(root: str, files: Dict[str, Any]) -> None:
    """A model's framework files under ``root/model/``: bytes written, a :class:`ModelFile`
    (weights already in the store) streamed, never read into memory."""
    for name, data in files.items():
        if isinstance(data, ModelFile):
            data.copy_to(f"{root}/model/{name}")
        else:
            write_file(root, f"model/{name}", data)


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


def _without_env_values(params: Dict[str, Any], owner: Any) -> Tuple[Dict[str, Any], List[str]]:
    """``params`` without ``backend_env`` (environment variables often hold tokens), and the
    names of its variables, which are saved so that loading can say what to set again."""
    env = params.get("backend_env") or {}
    if not env:
        return params, []
    warnings.warn(f"{type(owner).__name__} is saved without its backend_env values (they may "
                  f"hold credentials), only their names {sorted(env)}; after loading, set "
                  f"them again with setParams(backend_env={{...}})", UserWarning, stacklevel=4)
    return {k: v for k, v in params.items() if k != "backend_env"}, sorted(env)


class SessionWriter(MLWriter):
    """An MLWriter that works on classic and Spark Connect sessions alike."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        remove_saved(self.sparkSession, path)

    def _save_metadata(self, path: str, params: Optional[Dict[str, Any]] = None,
                       **extra: Any) -> str:
        """Write Spark ML's ``metadata``; returns the saved directory (:func:`saved_root`)."""
        DefaultParamsWriter.saveMetadata(
            self.instance, path, ml_context(self),
            paramMap=json_params(self.instance) if params is None else params, **extra)
        return saved_root(self.sparkSession, path)


class EstimatorWriter(SessionWriter):
    """JSON params in ``metadata``, object params (model, optimizer...) in ``objects.pkl``;
    the store's ``storage_options`` are left out (see the module docstring)."""

    def saveImpl(self, path: str) -> None:
        params, env_keys = _without_env_values(json_params(self.instance), self.instance)
        root = self._save_metadata(path, params,
                                   extraMetadata={"backend_env_keys": env_keys} if env_keys
                                   else None)
        objects = _without_credentials(object_params(self.instance), self.instance)
        objects.pop("resource_profile", None)  # a session's object (the JVM's, on classic)
        write_file(root, "objects.pkl", dumps(objects))


class EstimatorReader(MLReader):
    """Reads what :class:`EstimatorWriter` wrote. Unpickles ``objects.pkl``, which runs code:
    load only trusted paths."""

    def __init__(self, cls: Type[Params]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The estimator saved at ``path``. Unpickling its model, optimizer, loss, metrics and
        callbacks can run arbitrary code: load only paths you trust."""
        metadata = DefaultParamsReader.loadMetadata(path, ml_context(self))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        _apply_params(instance, metadata)
        root = saved_root(self.sparkSession, path)
        instance._set(**cloudpickle.loads(read_file(root, "objects.pkl")))
        env_keys = metadata.get("backend_env_keys")
        if env_keys:
            warnings.warn(f"{path!r} was saved without its backend_env values; set "
                          f"{sorted(env_keys)} again with setParams(backend_env={{...}}) "
                          f"before fitting", UserWarning, stacklevel=3)
        return instance


class ModelWriter(SessionWriter):
    """JSON params and model metadata in ``metadata``; framework files under ``model/``."""

    def saveImpl(self, path: str) -> None:
        files = self.instance._framework_files()
        root = self._save_metadata(path, extraMetadata=self.instance._extra_metadata(sorted(files)))
        write_model_files(root, files)
        transform = self.instance.getPredictTransformationFn()
        if transform is not None:  # by value, like the model's own classes
            write_file(root, PREDICT_FN_FILE, dumps(transform))


class SavedModelClass(Protocol):
    """What :class:`ModelReader` needs of a model class (``ModelBase`` has it)."""

    def _from_saved(self, metadata: Dict[str, Any], files: Dict[str, ModelFile]) -> Params: ...


class ModelReader(MLReader):
    """Reads what :class:`ModelWriter` wrote; the framework's files may be pickles (a torch
    model's architecture, Keras custom objects), which run code: load only trusted paths."""

    def __init__(self, cls: SavedModelClass) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The model saved at ``path``. Unpickling its framework files can run arbitrary code:
        load only paths you trust."""
        metadata = DefaultParamsReader.loadMetadata(path, ml_context(self))
        root = saved_root(self.sparkSession, path)
        # references: a framework reads what it needs (torch maps its weights file lazily)
        files = {name: ModelFile.of(f"{root}/model/{name}") for name in metadata["framework_files"]}
        instance = self.cls._from_saved(metadata, files)
        instance._resetUid(metadata["uid"])
        _apply_params(instance, metadata)
        if metadata.get("predict_transformation_fn"):
            instance._set(predict_transformation_fn=cloudpickle.loads(
                read_file(root, PREDICT_FN_FILE)))
        return instance
