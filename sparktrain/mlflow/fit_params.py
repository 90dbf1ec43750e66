"""An estimator's params as MLflow params: plain values as they are, objects by their type name,
``backend_env`` by its variable names only and ``store`` without credentials (a ``Store``'s
``storage_options`` are never read here).

Example::

    fit_params(TorchEstimator(model=net, backend_env={"TOKEN": "s3cret"}, epochs=3))
    # {"model": "Sequential", "backend_env": "TOKEN", "epochs": "3", ...}
"""
from __future__ import annotations

from typing import Any, Dict
from urllib.parse import urlsplit, urlunsplit

MAX_VALUE = 6000  # MLflow's limit on a param value (MAX_PARAM_VAL_LENGTH)
_PLAIN = (str, int, float, bool, type(None))


def _value(name: str, value: Any) -> str:
    if name == "backend_env":
        return ",".join(sorted(value or {}))  # names only: values may be tokens
    if name == "store":
        if isinstance(value, str):
            parts = urlsplit(value)  # s3://key:secret@bucket -> s3://bucket
            host = parts.hostname or ""
            if parts.port:
                host += f":{parts.port}"
            return urlunsplit(parts._replace(netloc=host)) if parts.netloc else value
        return type(value).__name__ if value is not None else "None"
    if isinstance(value, _PLAIN):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) if isinstance(v, _PLAIN) else type(v).__name__
                               for v in value) + "]"
    return type(value).__name__


def fit_params(estimator: Any) -> Dict[str, str]:
    """Every defined param of ``estimator`` (see the module docstring)."""
    return {p.name: _value(p.name, estimator.getOrDefault(p))[:MAX_VALUE]
            for p in estimator.params if estimator.isDefined(p)}
