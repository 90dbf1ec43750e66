"""Where sparktrain keeps materialized datasets and training runs.

A :class:`Store` is one root URL seen two ways: as a Hadoop path for Spark (which writes the
datasets) and as an fsspec path for Python code on the driver and the executors (which reads
them). Local paths, ``file:``, ``hdfs://``, ``s3://``/``s3a://``, ``gs://``, ``abfs://`` and
Databricks' ``dbfs:/`` are understood.

Example::

    store = Store.create("s3://bucket/sparktrain", storage_options={"anon": False})
    store.dataset_path("ab12")   # 's3://bucket/sparktrain/datasets/ab12' (fsspec)
    store.spark_path("datasets", "ab12")   # 's3a://bucket/sparktrain/datasets/ab12' (Spark)

Horovod's ``Store.create(prefix_path, ...)`` keywords are understood too (see
:meth:`Store.create`), and a Horovod store object given as ``store=`` is converted.
"""
from __future__ import annotations

import posixpath
import re
import warnings
from typing import Any, Dict, Optional, Tuple, Union

from sparktrain.fs import (
    DEFAULT_LOCAL_STORE,
    client_package,
    filesystem,
    put_file,
    split_scheme,
    to_fsspec_url,
    to_spark_url,
)

# Horovod 0.28.1's Store.create keywords (horovod/spark/common/store.py: AbstractFilesystemStore
# and HDFSStore) -> what sparktrain does with them instead, for those it does not map.
_HDFS_KEYWORDS = ("host", "port", "user", "kerb_ticket", "extra_conf")
_IGNORED_STORE_KEYWORDS = {
    "train_path": "datasets live under <prefix>/datasets/<key>, one per DataFrame plan",
    "val_path": "the validation split is stored with the training split",
    "test_path": "sparktrain materializes no test split",
    "runs_path": "runs live under <prefix>/runs/<run_id>",
    "checkpoint_filename": "checkpoints are <prefix>/runs/<run_id>/checkpoints/epoch-N",
    "driver": "only pyarrow < 0.17 had a choice of HDFS driver",
}


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
               storage_options: Optional[Dict[str, Any]] = None, *,
               prefix_path: Optional[str] = None, **horovod: Any) -> "Store":
        """A Store from a URL/path, an existing Store, a Horovod store object, or ``None`` for
        the default local store.

        Horovod's keyword forms work: ``Store.create(prefix_path="hdfs:///user/me/st",
        host="nn", port=8020, user="me")``. For ``hdfs://`` prefixes ``host``/``port`` go into
        the URL (when it names no namenode) and ``user``, ``kerb_ticket``, ``extra_conf``
        into ``storage_options`` (fsspec's HDFS filesystem takes them); ``save_runs=True`` is
        what sparktrain always does. The other Horovod keywords (``train_path``, ``runs_path``,
        ``checkpoint_filename``, ...) are accepted with one warning saying what sparktrain does
        instead; unknown keywords are a ``TypeError``.
        """
        if prefix_path is not None:
            if store is not None:
                raise TypeError("give the store's path once: Store.create(path) or "
                                "Store.create(prefix_path=path)")
            store = prefix_path
        if isinstance(store, Store):
            if horovod:
                raise TypeError(f"Store.create(<a Store>) takes no other keywords, got "
                                f"{sorted(horovod)}")
            return store
        if store is not None and not isinstance(store, str) and hasattr(store, "prefix_path"):
            return cls._from_horovod_store(store)
        if store is None:
            store = DEFAULT_LOCAL_STORE
        if not isinstance(store, str):
            raise TypeError(f"store must be a path/URL string or a sparktrain Store, "
                            f"got {type(store).__name__}")
        if horovod:
            store, storage_options = _horovod_keywords(store, storage_options, horovod)
        return cls(store, storage_options)

    @classmethod
    def _from_horovod_store(cls, store: Any) -> "Store":
        """A sparktrain Store at the same place as a ``horovod.spark.common.store`` object:
        its ``prefix_path`` and ``storage_options`` (for an ``HDFSStore``, its namenode, user,
        Kerberos ticket and extra conf)."""
        hdfs = dict(getattr(store, "_hdfs_kwargs", None) or {})
        prefix = str(store.prefix_path)
        options = dict(getattr(store, "storage_options", None) or {})
        if hdfs:
            host, port = hdfs.pop("host", None), hdfs.pop("port", None)
            hdfs.pop("driver", None)
            scheme, rest = split_scheme(prefix)
            if host not in (None, "default") and not rest.split("/", 1)[0]:
                rest = f"{host}{f':{port}' if port else ''}{rest}"
                prefix = f"hdfs://{rest}"
            options.update({k: v for k, v in hdfs.items() if v is not None})
        return cls(prefix, options)

    @property
    def on_hdfs(self) -> bool:
        return split_scheme(self.prefix)[0] in ("hdfs", "viewfs")

    def resolved(self, hadoop: Dict[str, str]) -> "Store":
        """This store as every process can open it without a Hadoop configuration of its own:
        ``hdfs:///p`` with the driver's ``fs.defaultFS`` (``hdfs://nn:8020/p``), and an HA
        nameservice's namenodes in the storage options of the HDFS client (hdfs-native reads
        them as Hadoop settings; pyarrow's client in ``extra_conf``). ``hadoop``: the driver's
        settings (:func:`sparktrain.session.spark_api.hdfs_settings`). Others: unchanged.

        Example: ``Store("hdfs:///st").resolved({"fs.defaultFS": "hdfs://nn:8020"}).prefix ==
        "hdfs://nn:8020/st"``
        """
        if not self.on_hdfs:
            return self
        scheme, rest = split_scheme(self.prefix)
        authority, _, path = rest.partition("/")
        prefix = self.prefix
        if not authority:
            default_scheme, default_rest = split_scheme(hadoop.get("fs.defaultFS", ""))
            authority = default_rest.split("/", 1)[0] if default_scheme == scheme else ""
            if not authority:  # nothing to resolve it with here: the client's own settings
                return self
            prefix = f"{scheme}://{authority}/{path}"
        options = dict(self._storage_options)
        service = authority.rsplit("@", 1)[-1]
        if service in [s.strip() for s in hadoop.get("dfs.nameservices", "").split(",")]:
            ha = {key: value for key, value in hadoop.items()
                  if key == "dfs.nameservices" or key.endswith(f".{service}")
                  or f".{service}." in key}
            if client_package(prefix) == "hdfs_native":
                options = {**ha, **options}
            else:
                options["extra_conf"] = {**ha, **dict(options.get("extra_conf") or {})}
        return Store(prefix, options)

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


def _horovod_keywords(prefix: str, storage_options: Optional[Dict[str, Any]],
                      given: Dict[str, Any]) -> Tuple[str, Optional[Dict[str, Any]]]:
    """Apply Horovod's ``Store.create`` keywords (see :meth:`Store.create`)."""
    unknown = sorted(set(given) - set(_HDFS_KEYWORDS) - set(_IGNORED_STORE_KEYWORDS)
                     - {"save_runs"})
    if unknown:
        raise TypeError(f"Store.create() got unexpected keyword(s) {unknown}; it takes "
                        f"storage_options and Horovod's {sorted(_HDFS_KEYWORDS)} (hdfs://), "
                        f"save_runs, {sorted(_IGNORED_STORE_KEYWORDS)}")
    options = dict(storage_options or {})
    notes = [f"{name}: {_IGNORED_STORE_KEYWORDS[name]}"
             for name in _IGNORED_STORE_KEYWORDS if given.get(name) is not None]
    if given.get("save_runs") is False:
        notes.append("save_runs=False: runs are always kept (each epoch's checkpoint is what a "
                     "retried attempt resumes from); delete <prefix>/runs/<run_id> after fit")
    hdfs = {k: given[k] for k in _HDFS_KEYWORDS if given.get(k) is not None}
    scheme, rest = split_scheme(prefix)
    if hdfs and scheme != "hdfs":
        notes.append(f"{sorted(hdfs)}: they configure HDFS, and {prefix!r} is not an hdfs:// "
                     f"path")
    elif hdfs:
        authority, path = (rest.split("/", 1) + [""])[:2]
        host, port = hdfs.pop("host", None), hdfs.pop("port", None)
        if host is not None or port is not None:
            match = re.fullmatch(r"([^:]*)(?::(\d+))?", authority)
            url_host, url_port = (match.group(1), match.group(2)) if match else (authority, None)
            if url_host and host is not None and url_host != host or \
                    url_port and port is not None and int(url_port) != int(port):
                raise ValueError(f"Store.create: host={host!r}, port={port!r} disagree with the "
                                 f"namenode in {prefix!r}; give it in one place")
            host, port = url_host or host, url_port or port
            if host in (None, "", "default"):
                raise ValueError(f"Store.create: port={port!r} without a host; pass host=... or "
                                 f"write hdfs://<namenode>:<port>/path")
            prefix = f"hdfs://{host}{f':{port}' if port else ''}/{path}"
        options.update(hdfs)
    if notes:
        from sparktrain.errors import IgnoredParamWarning

        warnings.warn("Store.create: Horovod keyword(s) accepted but without effect here:\n  - "
                      + "\n  - ".join(notes), IgnoredParamWarning, stacklevel=3)
    return prefix, options or storage_options


class StoredBytes:
    """Bytes the client writes to the store once and each task reads when it first needs
    them (``.value``, like a broadcast's): how a fit ships its pickled model, optimizer and
    loss to the ranks on any session (Spark Connect has no broadcast, and its plans are
    capped at 128 MiB). Pickles as its URL only.

    Example::

        payload = StoredBytes.put(store.path("runs", run_id, "payload.pkl"), data)
        payload.value      # on an executor: the bytes, read from the store

    ``value`` is read on each access and not kept: a rank unpickles it once, and a copy kept
    for the whole fit would cost as much memory as the model.
    """

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.url = url
        self._storage_options = dict(storage_options or {})

    @classmethod
    def put(cls, url: str, data: bytes,
            storage_options: Optional[Dict[str, Any]] = None) -> "StoredBytes":
        fs, path = filesystem(url, storage_options)
        put_file(fs, path, data)
        return cls(url, storage_options)

    @property
    def value(self) -> bytes:
        fs, path = filesystem(self.url, self._storage_options)
        return fs.cat_file(path)

    def delete(self) -> None:
        fs, path = filesystem(self.url, self._storage_options)
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass

    def __getstate__(self) -> Dict[str, Any]:
        return {"url": self.url, "_storage_options": self._storage_options}

    def __repr__(self) -> str:
        return f"StoredBytes({self.url!r})"
