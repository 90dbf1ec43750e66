"""Where sparktrain keeps materialized datasets and training runs.

A :class:`Store` is one root URL seen two ways: as a Hadoop path for Spark (which writes the
datasets) and as an fsspec path for Python code on the driver and the executors (which reads
them). Local paths, ``file:``, ``hdfs://``, ``s3://``/``s3a://``, ``gs://``, ``abfs://`` and
Databricks' ``dbfs:/`` are understood.

Example::

    store = Store.create("s3://bucket/sparktrain", storage_options={"anon": False})
    store.dataset_path("ab12")   # 's3://bucket/sparktrain/datasets/ab12' (fsspec)
    store.spark_path("datasets", "ab12")   # 's3a://bucket/sparktrain/datasets/ab12' (Spark)
"""
from __future__ import annotations

import os
import posixpath
import tempfile
from typing import Any, Dict, List, Optional, Tuple, Union

DEFAULT_LOCAL_STORE = os.path.join(tempfile.gettempdir(), "sparktrain-store")

# Hadoop scheme -> fsspec protocol, where the two differ.
_SPARK_TO_FSSPEC = {"s3a": "s3", "s3n": "s3", "wasbs": "abfs", "abfss": "abfs"}
_FSSPEC_TO_SPARK = {"s3": "s3a"}


def _split_scheme(url: str) -> Tuple[str, str]:
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    if url.startswith(("file:", "dbfs:")):
        scheme, rest = url.split(":", 1)
        return scheme.lower(), rest
    return "", url


def to_fsspec_url(url: str) -> str:
    """The fsspec form of a Hadoop or fsspec URL (``file:/x`` -> ``/x``, ``s3a://`` -> ``s3://``)."""
    scheme, rest = _split_scheme(url)
    if scheme in ("", "file"):
        return "/" + rest.lstrip("/") if scheme else os.path.abspath(rest)
    if scheme == "dbfs":  # Databricks mounts DBFS at /dbfs on every node (FUSE)
        return "/dbfs/" + rest.lstrip("/")
    return f"{_SPARK_TO_FSSPEC.get(scheme, scheme)}://{rest}"


def to_spark_url(url: str) -> str:
    """The Hadoop form of a URL (``/x`` -> ``file:///x``, ``s3://`` -> ``s3a://``)."""
    scheme, rest = _split_scheme(url)
    if scheme == "":
        return "file://" + os.path.abspath(rest)
    if scheme == "file":
        return "file:///" + rest.lstrip("/")
    if scheme == "dbfs":
        return url
    return f"{_FSSPEC_TO_SPARK.get(scheme, scheme)}://{rest}"


def _secret_strings(options: Any) -> List[str]:
    """Every string value (at any depth) of ``storage_options``: all of them may be secrets."""
    if isinstance(options, dict):
        return [s for value in options.values() for s in _secret_strings(value)]
    if isinstance(options, (list, tuple, set)):
        return [s for value in options for s in _secret_strings(value)]
    if isinstance(options, bytes):
        options = options.decode("utf-8", "replace")
    return [options] if isinstance(options, str) and len(options) >= 4 else []


def redact(text: str, storage_options: Optional[Dict[str, Any]]) -> str:
    """``text`` with every string value of ``storage_options`` replaced by ``***``."""
    for secret in sorted(_secret_strings(storage_options), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def filesystem(url: str, storage_options: Optional[Dict[str, Any]] = None):
    """``(fsspec filesystem, path within it)`` for any URL this module understands.

    A filesystem that fails to start may quote its options in the error (e.g. a token taken
    for a file name): such an error is raised again, same type where possible, with every
    option value replaced by ``***`` and without the original attached.
    """
    import fsspec

    options = dict(storage_options or {})
    try:
        return fsspec.core.url_to_fs(to_fsspec_url(url), **options)
    except Exception as exc:  # noqa: BLE001 - re-raised below, redacted if it quotes a secret
        text = str(exc)
        cleaned = redact(text, options)
        if cleaned == text:
            raise
        error = _same_kind(exc, f"cannot open the store {to_fsspec_url(url)!r}: {cleaned}")
    raise error  # outside the except block: the original (with the secret) is not chained


def _same_kind(exc: Exception, message: str) -> Exception:
    try:
        error = type(exc)(message)
        if str(error) == message:
            return error
    except Exception:  # noqa: BLE001 - the type needs other arguments
        pass
    return RuntimeError(f"{type(exc).__name__}: {message}")


class Store:
    """A root directory for datasets (``datasets/<key>``) and runs (``runs/<run_id>``).

    ``storage_options`` (fsspec's keyword arguments: keys, tokens, endpoints) are passed to the
    filesystem on the driver and the executors and nowhere else: not in ``repr``, logs or
    Params, not in a saved estimator (it keeps the prefix only: set the Store again after
    loading), and filesystem errors that quote them come out with ``***``. Credentials written
    into the URL itself are not hidden: the prefix appears in logs and paths.
    """

    def __init__(self, prefix: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.prefix = to_fsspec_url(prefix).rstrip("/") or "/"
        self._storage_options = dict(storage_options or {})

    @classmethod
    def create(cls, store: Union[None, str, "Store"] = None,
               storage_options: Optional[Dict[str, Any]] = None) -> "Store":
        """A Store from a URL/path, an existing Store, or ``None`` for the default local store."""
        if isinstance(store, Store):
            return store
        if store is None:
            store = DEFAULT_LOCAL_STORE
        if not isinstance(store, str):
            raise TypeError(f"store must be a path/URL string or a sparktrain Store, "
                            f"got {type(store).__name__}")
        return cls(store, storage_options)

    def __repr__(self) -> str:  # never shows storage_options: they may hold credentials
        return f"Store({self.prefix!r})"

    @property
    def is_local(self) -> bool:
        return "://" not in self.prefix

    @property
    def storage_options(self) -> Dict[str, Any]:
        return dict(self._storage_options)

    @property
    def fs(self):
        return filesystem(self.prefix, self._storage_options)[0]

    def path(self, *parts: str) -> str:
        """fsspec path (what the executors read) of ``parts`` under the store root."""
        return posixpath.join(self.prefix, *parts)

    def spark_path(self, *parts: str) -> str:
        """Hadoop path (what Spark writes) of ``parts`` under the store root."""
        return to_spark_url(self.path(*parts))

    def dataset_path(self, key: str) -> str:
        return self.path("datasets", key)

    def run_path(self, run_id: str) -> str:
        return self.path("runs", run_id)


class StoredBytes:
    """Bytes the client writes to the store once and each task reads when it first needs
    them (``.value``, like a broadcast's): how a fit ships its pickled model, optimizer and
    loss to the ranks on any session (Spark Connect has no broadcast, and its plans are
    capped at 128 MiB). Pickles as its URL only.

    Example::

        payload = StoredBytes.put(store.path("runs", run_id, "payload.pkl"), data)
        payload.value      # on an executor: the bytes, read from the store once
    """

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.url = url
        self._storage_options = dict(storage_options or {})
        self._value: Optional[bytes] = None

    @classmethod
    def put(cls, url: str, data: bytes,
            storage_options: Optional[Dict[str, Any]] = None) -> "StoredBytes":
        fs, path = filesystem(url, storage_options)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
        return cls(url, storage_options)

    @property
    def value(self) -> bytes:
        if self._value is None:
            fs, path = filesystem(self.url, self._storage_options)
            self._value = fs.cat_file(path)
        return self._value

    def delete(self) -> None:
        fs, path = filesystem(self.url, self._storage_options)
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass

    def __getstate__(self) -> Dict[str, Any]:
        return {"url": self.url, "_storage_options": self._storage_options, "_value": None}

    def __repr__(self) -> str:
        return f"StoredBytes({self.url!r})"
