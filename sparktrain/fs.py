"""File-system access for every layer: URLs in their Hadoop and fsspec forms, the fsspec
filesystem of a URL (errors scrubbed of credentials), and small whole-file JSON writes and reads.

The one home of these helpers (issue #26): the store, leases, dataset commits, checkpoints,
the launch's events and results all come here, so this module imports nothing of sparktrain
but its errors and its fork hooks (installed with the first filesystem: :mod:`.fork_safety`).

Example::

    fs, path = filesystem("s3a://bucket/st/runs/r1", {"anon": False})   # s3fs, "bucket/st/..."
    put_file(fs, f"{path}/meta.json", b'{"epochs": 3}')   # readers see all of it or nothing
    read_json(fs, f"{path}/meta.json")                      # {'epochs': 3}
"""
from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from typing import Any, Dict, List, Optional, Tuple

from sparktrain import fork_safety
from sparktrain.errors import StoreFullError

# Hadoop scheme -> fsspec protocol, where the two differ.
_SPARK_TO_FSSPEC = {"s3a": "s3", "s3n": "s3", "wasbs": "abfs", "abfss": "abfs"}
_FSSPEC_TO_SPARK = {"s3": "s3a"}

#: fsspec protocols whose filesystems cache listings (``use_listings_cache``, fsspec's DirCache)
_LISTED_FRESH = ("s3", "gs", "gcs", "abfs", "az", "adl")

#: the store when none is given (a local folder: suits local masters), and where launches
#: keep their events when the caller names no folder
DEFAULT_LOCAL_STORE = os.path.join(tempfile.gettempdir(), "sparktrain-store")
DEFAULT_LAUNCH_DIR = posixpath.join(DEFAULT_LOCAL_STORE, "launches")


def split_scheme(url: str) -> Tuple[str, str]:
    """``(scheme, rest)`` of a URL, the scheme lower-cased (``""`` for a plain path)."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    if url.startswith(("file:", "dbfs:")):
        scheme, rest = url.split(":", 1)
        return scheme.lower(), rest
    return "", url


def to_fsspec_url(url: str) -> str:
    """The fsspec form of a Hadoop or fsspec URL (``file:/x`` -> ``/x``, ``s3a://`` -> ``s3://``)."""
    scheme, rest = split_scheme(url)
    if scheme in ("", "file"):
        return "/" + rest.lstrip("/") if scheme else os.path.abspath(rest)
    if scheme == "dbfs":  # Databricks mounts DBFS at /dbfs on every node (FUSE)
        return "/dbfs/" + rest.lstrip("/")
    return f"{_SPARK_TO_FSSPEC.get(scheme, scheme)}://{rest}"


def to_spark_url(url: str) -> str:
    """The Hadoop form of a URL (``/x`` -> ``file:///x``, ``s3://`` -> ``s3a://``)."""
    scheme, rest = split_scheme(url)
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


#: where fsspec's hdfs:// is pyarrow's HadoopFileSystem and libhdfs cannot be loaded
HDFS_CLIENT_HELP = (
    "no HDFS client could start on this machine: install hdfs-native (`pip install "
    "sparktrain[hdfs]`, a native client: no JVM or libhdfs.so needed) on the driver and in the "
    "executors' Python, or give pyarrow's client libhdfs.so (ARROW_LIBHDFS_DIR, HADOOP_HOME) "
    "and Hadoop's jars (CLASSPATH=$(hadoop classpath --glob)), as Hadoop's own nodes have them")


def client_package(url: str) -> Optional[str]:
    """The package of the filesystem this process opens ``url`` with, where it is not fsspec
    itself: every rank needs it as well (``hdfs_native`` for ``hdfs://`` where hdfs-native is
    installed, ``s3fs`` for ``s3://``/``s3a://``, ``gcsfs``, ``adlfs``). ``None`` for local
    paths and fsspec's own filesystems. Nothing is opened or connected.

    Example: ``client_package("s3a://bucket/store") == "s3fs"``
    """
    import fsspec
    from fsspec.registry import known_implementations

    protocol = split_scheme(to_fsspec_url(url))[0]
    if protocol in ("", "file"):
        return None
    try:
        package = fsspec.get_filesystem_class(protocol).__module__.split(".")[0]
    except (ImportError, ValueError):  # not installed here either: what fsspec would import
        known = known_implementations.get(protocol)
        package = known["class"].split(".")[0] if known else "fsspec"
    return None if package == "fsspec" else package


def filesystem(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for any URL this module understands.

    A filesystem that fails to start may quote its options in the error (e.g. a token taken
    for a file name): such an error is raised again, same type where possible, with every
    option value replaced by ``***`` and without the original attached.
    """
    import fsspec

    fork_safety.install()  # before any client with threads of its own exists here
    options = dict(storage_options or {})
    if split_scheme(to_fsspec_url(url))[0] in _LISTED_FRESH:
        # fsspec's object stores cache directory listings for the life of the instance, and
        # fsspec reuses an instance per process: a Python worker that listed a run's
        # checkpoints in one fit (none yet) saw none in the next, and a driver polling a
        # folder of events never saw a new one. Every listing is asked for again.
        options.setdefault("use_listings_cache", False)
    try:
        return fsspec.core.url_to_fs(to_fsspec_url(url), **options)
    except Exception as exc:  # noqa: BLE001 - re-raised below, redacted if it quotes a secret
        text = str(exc)
        if split_scheme(url)[0] in ("hdfs", "viewfs") and ("libhdfs" in text or "libjvm" in text):
            raise RuntimeError(f"cannot open the store {url!r}: {HDFS_CLIENT_HELP} ({text})"
                               ) from None
        cleaned = redact(text, options)
        if cleaned == text:
            raise
        error = _same_kind(exc, f"cannot open the store {to_fsspec_url(url)!r}: {cleaned}")
    raise error  # outside the except block: the original (with the secret) is not chained


#: where Spark's Hadoop client gets the filesystem of a scheme it lacks (Maven coordinates)
_SPARK_FS_JARS = {"s3a": "org.apache.hadoop:hadoop-aws (with the AWS SDK bundle it depends on)",
                  "gs": "com.google.cloud.bigdataoss:gcs-connector",
                  "abfs": "org.apache.hadoop:hadoop-azure",
                  "abfss": "org.apache.hadoop:hadoop-azure",
                  "wasbs": "org.apache.hadoop:hadoop-azure"}
_MISSING_HADOOP_FS = re.compile(r"No FileSystem for scheme|ClassNotFoundException: Class "
                                r"org\.apache\.hadoop\.fs\.\S*FileSystem not found")


def spark_filesystem_missing(exc: BaseException, url: str) -> Optional[str]:
    """What to do when Spark's own Hadoop client failed on ``url`` for want of its filesystem
    class (``None`` for any other error): sparktrain reaches the store through fsspec, but a
    dataset Spark writes goes through Spark's jars."""
    said = [line for line in str(exc).splitlines() if _MISSING_HADOOP_FS.search(line)]
    if not said:
        return None
    scheme = split_scheme(url)[0] or "file"
    jar = _SPARK_FS_JARS.get(scheme, f"the Hadoop filesystem of {scheme}://")
    why = said[-1].strip()[:200]
    return (f"Spark's Hadoop client has no filesystem for {scheme}:// ({why}): add "
            f"{jar} to Spark's jars, in the version of the Hadoop client inside them (e.g. "
            f"spark.jars.packages, or the cluster's own), or fit with input_mode=\"stream\": "
            f"then only sparktrain writes to the store, through fsspec")


def _same_kind(exc: Exception, message: str) -> Exception:
    try:
        error = type(exc)(message)
        if str(error) == message:
            return error
    except Exception:  # noqa: BLE001 - the type needs other arguments
        pass
    return RuntimeError(f"{type(exc).__name__}: {message}")


def put_file(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see all of it or nothing.

    It goes to a hidden temporary name first and is then moved into place: atomic where the
    filesystem renames atomically (local disks, HDFS); on object stores one PUT/copy is atomic
    by itself. Listings that skip dot-names (:func:`list_json`) never see the temporary file.
    """
    directory, name = posixpath.split(path)
    temporary = f"{directory}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fs.makedirs(directory, exist_ok=True)
        try:
            fs.pipe_file(temporary, data)
        except FileNotFoundError:  # an empty directory removed meanwhile (remove_empty)
            fs.makedirs(directory, exist_ok=True)
            fs.pipe_file(temporary, data)
        try:
            fs.mv(temporary, path)
        except FileExistsError:  # HDFS renames onto a name only when told to (hdfs-native)
            fs.mv(temporary, path, overwrite=True)
    except Exception as exc:
        try:
            fs.rm(temporary)  # a half-written temporary file would keep the space
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        if out_of_space(exc):
            raise store_full(fs, path, len(data), exc) from None
        raise


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or the text of a Java error) says a filesystem is full."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return bool(_NO_SPACE.search(str(exc)))


_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|DiskSpaceQuotaExceeded|"
                       r"NSQuotaExceeded|ENOSPC")


def store_full(fs: Any, path: str, needed: Optional[int], exc: BaseException,
               what: str = "", note: str = "") -> StoreFullError:
    """The error for a write of ``needed`` bytes (``what``) to ``path`` that found no room."""
    free = free_bytes(fs, path)
    room = f"; {free / 2**20:.1f} MiB free there now" if free is not None else ""
    size = f" needed {needed / 2**20:.1f} MiB" if needed is not None else ""
    text = (f"the store is out of space: writing {what or path}{size}{room}{note}. Make room "
            f"there (or use another store) and fit again: the run's earlier checkpoints and "
            f"datasets are intact. ({_first_line(exc)})")
    return StoreFullError(text, path, needed)


def free_bytes(fs: Any, path: str) -> Optional[int]:
    """Free bytes of the local filesystem holding ``path`` (``None`` for remote stores)."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return None
    path = path.split("://", 1)[-1]
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or "/").free
    except OSError:
        return None


def _first_line(exc: BaseException) -> str:
    """The line of ``exc``'s text that says what was full (Java's ``Caused by:`` dropped)."""
    for line in str(exc).splitlines():
        if _NO_SPACE.search(line):
            return line.strip().removeprefix("Caused by: ")[:300]
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def read_json(fs: Any, path: str) -> Optional[Dict[str, Any]]:
    """The JSON object at ``path``, or ``None`` if it is missing or not (yet) complete."""
    try:
        value = json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def list_json(fs: Any, directory: str) -> List[str]:
    """Paths of the visible ``*.json`` files in ``directory`` (sorted by name), ``[]`` if none."""
    try:
        fs.invalidate_cache(directory)
        names = fs.ls(directory, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(p for p in names if p.endswith(".json")
                  and not posixpath.basename(p).startswith("."))
