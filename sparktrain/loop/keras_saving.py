"""Keras model files and ``custom_objects``, shared by the estimator (driver, prediction) and
the rank loop: a leaf module (no Spark, no ``pyspark.ml``), so the TensorFlow child processes
import only what they use. Keras is imported when a function runs.

Example::

    data = model_bytes(net)
    net2 = load_model(data, {"MyLayer": MyLayer})
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple


def keras_module() -> Any:
    """``keras``, with the TensorFlow backend unless one was chosen."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO/WARNING lines
    import keras

    return keras


def model_bytes(model: Any) -> bytes:
    """The native ``.keras`` file of ``model``, as bytes."""
    with tempfile.TemporaryDirectory(prefix="sparktrain-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def loading_objects(keras: Any, custom_objects: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``custom_objects`` keyed by name *and* by Keras' registered name (``package>Name``):
    a class registered with ``register_keras_serializable`` is saved under the latter, and its
    registration does not survive pickling to another process, so this runs on the driver."""
    objects = dict(custom_objects or {})
    for obj in list(objects.values()):
        try:
            objects.setdefault(keras.saving.get_registered_name(obj), obj)
        except Exception:  # not a class or function Keras can name
            pass
    return objects


def load_model(data: Any, custom_objects: Optional[Dict[str, Any]]) -> Any:
    """The uncompiled model of a ``.keras`` file's bytes, or of a ``ModelFile`` referring to
    one (read from its local path: copied once per host from a remote store)."""
    keras = keras_module()
    custom_objects = loading_objects(keras, custom_objects)
    if not isinstance(data, (bytes, bytearray)):
        return keras.saving.load_model(data.local_path(), custom_objects=custom_objects or {},
                                       compile=False)
    with tempfile.TemporaryDirectory(prefix="sparktrain-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects or {}, compile=False)


def model_shapes(model: Any) -> Tuple[Optional[List[List[int]]], Optional[List[List[int]]]]:
    """``(input shapes, output shapes)`` of a built Keras model, ``-1`` for unknown dimensions
    (Horovod's ``get_model_shapes``); ``(None, None)`` for a model without known inputs (a
    subclassed model that was never called)."""
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        return None, None
    if not inputs:
        return None, None

    def shapes(tensors: Any) -> List[List[int]]:
        return [[-1 if d is None else int(d) for d in t.shape] for t in tensors]
    return shapes(inputs), shapes(outputs or [])
