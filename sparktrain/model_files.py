"""Model files by reference: weights travel as a path, never inside a closure or a plan.

A :class:`ModelFile` names one file (a torch ``state_dict``, a ``.keras`` file) by URL, the
store's ``storage_options`` and a fingerprint taken when the reference was made (fsspec's
``ukey``: size and modification time, an object store's ETag). It pickles as those few
values, so a prediction UDF or a training task that holds one stays a few KiB whatever the
model's size (Spark Connect caps a plan at 128 MiB; a classic session broadcasts a closure
through the driver JVM's heap).

On an executor, :meth:`ModelFile.local_path` gives a local file to memory-map: the file itself
on a local or mounted filesystem, else a copy made once per host (every Python worker and task
after the first finds it; a lock file keeps two workers from copying at once).
The prediction UDF keeps what it loaded per Python worker, keyed by everything its factory
holds (this reference's URL and fingerprint among it), so a model re-fitted or re-saved under
the same path is loaded afresh, never served stale; a file that changed or disappeared since
the reference was made fails naming its path.

Example::

    ref = ModelFile.of("s3://bucket/st/runs/r1/model/weights.pt", {"anon": False})
    state = load_weights(ref.local_path())   # on an executor, once per Python worker
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shutil
import tempfile
import uuid
from typing import Any, Dict, Iterator, Optional

from sparktrain.fs import filesystem, out_of_space, store_full

#: where executors keep their copies of remote model files (one directory per file version)
LOCAL_COPIES = os.path.join(tempfile.gettempdir(), "sparktrain-models")
_CHUNK = 16 << 20


class ModelFileChanged(RuntimeError):
    """The file a model references was replaced or removed after the reference was made."""


class ModelFile:
    """A file in a store (or any fsspec/Hadoop URL) that executors read by path."""

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None,
                 fingerprint: str = "") -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fingerprint = fingerprint

    @classmethod
    def of(cls, url: str, storage_options: Optional[Dict[str, Any]] = None) -> "ModelFile":
        """A reference to the file at ``url`` as it is now (``FileNotFoundError`` if absent)."""
        fs, path = filesystem(url, storage_options)
        return cls(url, storage_options, _fingerprint(fs, path, url))

    @classmethod
    @contextlib.contextmanager
    def writing(cls, url: str, storage_options: Optional[Dict[str, Any]] = None
                ) -> Iterator[Any]:
        """A binary file object to write ``url`` through (streamed: no copy of the contents in
        memory); written under a temporary name and moved into place when complete."""
        fs, path = filesystem(url, storage_options)
        directory, name = posixpath.split(path)
        fs.makedirs(directory, exist_ok=True)
        temporary = f"{directory}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with fs.open(temporary, "wb") as out:
                yield out
            fs.mv(temporary, path)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                fs.rm(temporary)
            if out_of_space(exc):
                raise store_full(fs, path, None, exc, what=f"the model file {url}") from None
            raise

    @property
    def key(self) -> str:
        """What a cache of this file's contents is keyed by: URL and fingerprint."""
        return hashlib.sha1(f"{self.url}\0{self.fingerprint}".encode()).hexdigest()[:20]

    def _checked(self) -> "tuple[Any, str]":
        fs, path = filesystem(self.url, self.storage_options)
        now = _fingerprint(fs, path, self.url)
        if self.fingerprint and now != self.fingerprint:
            raise ModelFileChanged(
                f"the model file {self.url!r} was replaced after this model was fitted or "
                f"loaded (another fit or save wrote the same path); load the model again "
                f"from where it was saved")
        return fs, path

    def local_path(self) -> str:
        """A local path with this file's contents: the file itself when it is on a local (or
        mounted) filesystem, else a copy made once per host under :data:`LOCAL_COPIES`."""
        fs, path = self._checked()
        if _is_local(fs):
            return path
        directory = os.path.join(LOCAL_COPIES, self.key)
        target = os.path.join(directory, posixpath.basename(path))
        if os.path.exists(target):
            return target
        os.makedirs(directory, exist_ok=True)
        with _locked(os.path.join(directory, ".lock")):
            if not os.path.exists(target):  # another worker may have copied it meanwhile
                partial = f"{target}.{os.getpid()}.part"
                with fs.open(path, "rb") as source, open(partial, "wb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
                os.replace(partial, target)
        return target

    def read_bytes(self) -> bytes:
        fs, path = self._checked()
        return fs.cat_file(path)

    def copy_to(self, url: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        """Stream this file to ``url`` (e.g. into a saved model's directory)."""
        fs, path = self._checked()
        with fs.open(path, "rb") as source, ModelFile.writing(url, storage_options) as out:
            shutil.copyfileobj(source, out, _CHUNK)

    def delete(self) -> None:
        fs, path = filesystem(self.url, self.storage_options)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelFile) and (self.url, self.fingerprint) == \
            (other.url, other.fingerprint)

    def __hash__(self) -> int:
        return hash((self.url, self.fingerprint))

    def __repr__(self) -> str:
        return f"ModelFile({self.url!r})"


def _fingerprint(fs: Any, path: str, url: str) -> str:
    try:
        return str(fs.ukey(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the model file {url!r} does not exist (any more): it is removed with its store "
            f"or saved directory; save fitted models you keep with model.write().save(path)"
        ) from None


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
