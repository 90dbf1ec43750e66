"""Per-epoch checkpoints of a training run, kept in the run's directory in the store.

Layout under ``<store>/runs/<run_id>/checkpoints/``::

    epoch-000003.ckpt    the framework's bytes (torch: model + optimizer state; Keras: .keras)
    epoch-000003.json    {"epochs_done": 3, "history": {...}, "attempts": [...]}: written last

A checkpoint exists only once its ``.json`` does. Both files are written under a temporary name
and renamed into place (atomic on local disks and HDFS; an S3 object appears whole or not at
all), so a crash while writing leaves at most a stray temporary file, never a corrupt latest
checkpoint. The ``keep`` most recent checkpoints are kept, older ones deleted.

Example::

    ckpts = Checkpoints(store.run_path("my-run"))
    ckpts.write(3, model_bytes, {"history": history})
    latest = ckpts.latest()            # Checkpoint(epochs_done=3, meta={...}, ...) or None
    model_bytes = ckpts.read(latest)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from sparktrain.fs import filesystem, put_file

_NAME = re.compile(r"epoch-(\d{6})\.json$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the state after ``epochs_done`` epochs."""

    epochs_done: int
    meta: Dict[str, Any]
    payload_path: str


class Checkpoints:
    """The checkpoints of one run (``run_path`` is a store URL or local path)."""

    def __init__(self, run_path: str, storage_options: Optional[Dict[str, Any]] = None,
                 keep: int = 2) -> None:
        self.fs, self.root = filesystem(run_path.rstrip("/") + "/checkpoints", storage_options)
        self.keep = keep

    def _path(self, epochs_done: int, suffix: str) -> str:
        return f"{self.root}/epoch-{epochs_done:06d}.{suffix}"

    def _done(self) -> List[int]:
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = (_NAME.search(str(name)) for name in names)
        return sorted(int(match.group(1)) for match in found if match)

    def latest(self) -> Optional[Checkpoint]:
        """The most recent complete checkpoint, or ``None``."""
        for epochs_done in reversed(self._done()):
            try:
                return self.at(epochs_done)
            except (FileNotFoundError, ValueError):
                continue  # deleted meanwhile, or unreadable: try the one before
        return None

    def at(self, epochs_done: int) -> Checkpoint:
        """The checkpoint after ``epochs_done`` epochs (``FileNotFoundError`` if it is gone)."""
        meta = json.loads(self.fs.cat_file(self._path(epochs_done, "json")))
        return Checkpoint(epochs_done, meta, self._path(epochs_done, "ckpt"))

    def read(self, checkpoint: Checkpoint) -> bytes:
        return self.fs.cat_file(checkpoint.payload_path)

    def write(self, epochs_done: int, payload: bytes, meta: Dict[str, Any]) -> Checkpoint:
        """Write the checkpoint after ``epochs_done`` epochs, then prune old ones."""
        self.fs.makedirs(self.root, exist_ok=True)
        meta = dict(meta, epochs_done=epochs_done)
        put_file(self.fs, self._path(epochs_done, "ckpt"), payload)
        put_file(self.fs, self._path(epochs_done, "json"), json.dumps(meta).encode())
        for old in self._done()[:-self.keep]:
            for suffix in ("json", "ckpt"):  # the marker first: never a marker without data
                try:
                    self.fs.rm_file(self._path(old, suffix))
                except FileNotFoundError:
                    pass
        return Checkpoint(epochs_done, meta, self._path(epochs_done, "ckpt"))
