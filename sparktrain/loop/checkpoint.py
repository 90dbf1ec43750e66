"""The checkpoints of a training run (after epochs and inside them), kept in the run's
directory in the store.

Layout under ``<store>/runs/<run_id>/checkpoints/``::

    epoch-000003.ckpt    the framework's bytes (torch: model + optimizer state; Keras: .keras)
    epoch-000003.json    {"epochs_done": 3, "history": {...}, "attempts": [...]}: written last
    epoch-000003-step-00000120.ckpt   inside epoch 4: 3 epochs done and 120 steps of the 4th
    epoch-000003-step-00000120.json   {"epochs_done": 3, "step": 120, ...}
    epoch-000003-step-00000120.rows-1 rank 1's position in epoch 4: the rows it had trained
                                      (streamed rows, sparktrain.data.sources.trained_rows)

Checkpoints order by ``(epochs_done, step)`` (an epoch's end is step 0 of the next), so
:meth:`Checkpoints.latest` and :meth:`Checkpoints.latest_intact` return the newest whichever
kind it is.

A checkpoint exists only once its ``.json`` does. Both files are written under a temporary name
and renamed into place (atomic on local disks and HDFS; an S3 object appears whole or not at
all), so a crash while writing leaves at most a stray temporary file, never a corrupt latest
checkpoint; a write that fails (a full disk) leaves the earlier checkpoints as they were. The
``keep`` most recent epoch-end checkpoints are kept, older ones deleted; a checkpoint inside an
epoch is deleted once a newer checkpoint of either kind is written.

A checkpoint damaged afterwards (a truncated or overwritten file, a disk error) is found by its
size and SHA-256, kept in the ``.json``: resuming takes the newest intact checkpoint, with a
warning naming the damaged ones, and fails with :class:`CheckpointError` naming every file when
none is intact (costing an epoch, not the run).

Example::

    ckpts = Checkpoints(store.run_path("my-run"))
    ckpts.write(3, model_bytes, {"history": history})
    ckpts.write(3, model_bytes, {"history": history}, step=120)   # 120 steps into epoch 4
    latest, model_bytes = ckpts.latest_intact(warn=print)   # (None, None) on a fresh run
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from sparktrain.errors import CheckpointError, StoreFullError
from sparktrain.faults import mark_user_error
from sparktrain.fs import filesystem, put_file, store_full

_NAME = re.compile(r"epoch-(\d{6})(?:-step-(\d{8}))?\.json$")
Key = Tuple[int, int]  # (epochs_done, step): the order of checkpoints


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the state after ``epochs_done`` epochs and ``step`` training
    steps of the next one (0: at the epoch's end)."""

    epochs_done: int
    meta: Dict[str, Any]
    payload_path: str
    step: int = 0


class Checkpoints:
    """The checkpoints of one run (``run_path`` is a store URL or local path)."""

    def __init__(self, run_path: str, storage_options: Optional[Dict[str, Any]] = None,
                 keep: int = 2) -> None:
        self.fs, self.root = filesystem(run_path.rstrip("/") + "/checkpoints", storage_options)
        self.keep = keep

    def _path(self, key: Key, suffix: str) -> str:
        epochs_done, step = key
        within = f"-step-{step:08d}" if step else ""
        return f"{self.root}/epoch-{epochs_done:06d}{within}.{suffix}"

    def _done(self) -> List[Key]:
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = (_NAME.search(str(name)) for name in names)
        return sorted((int(match.group(1)), int(match.group(2) or 0)) for match in found if match)

    def latest(self) -> Optional[Checkpoint]:
        """The most recent complete checkpoint (after an epoch or inside one), or ``None``."""
        for key in reversed(self._done()):
            try:
                return self.at(*key)
            except (FileNotFoundError, ValueError):
                continue  # deleted meanwhile, or unreadable: try the one before
        return None

    def at(self, epochs_done: int, step: int = 0) -> Checkpoint:
        """The checkpoint after ``epochs_done`` epochs and ``step`` steps of the next one
        (``FileNotFoundError`` if it is gone)."""
        key = (epochs_done, step)
        meta = json.loads(self.fs.cat_file(self._path(key, "json")))
        return Checkpoint(epochs_done, meta, self._path(key, "ckpt"), step)

    def read(self, checkpoint: Checkpoint) -> bytes:
        return self.fs.cat_file(checkpoint.payload_path)

    def latest_intact(self, warn: Callable[[str], None] = lambda text: None
                      ) -> Tuple[Optional[Checkpoint], Optional[bytes]]:
        """The newest checkpoint whose files are whole, and its bytes; ``(None, None)`` when
        the run has none. Damaged ones are skipped with ``warn``; when every one is damaged,
        :class:`CheckpointError` names them."""
        damaged: List[str] = []
        for key in reversed(self._done()):
            marker = self._path(key, "json")
            try:
                checkpoint = self.at(*key)
            except FileNotFoundError:
                continue  # removed meanwhile (pruned)
            except ValueError as exc:  # JSON that does not parse (UnicodeDecodeError too)
                damaged.append(f"{marker} (unreadable: {exc})")
                continue
            try:
                payload = self.read(checkpoint)
            except FileNotFoundError:
                damaged.append(f"{checkpoint.payload_path} (missing)")
                continue
            problem = _damage(payload, checkpoint.meta.get("payload"))
            if problem:
                damaged.append(f"{checkpoint.payload_path} ({problem})")
                continue
            if damaged:
                where = f" (step {key[1]} of epoch {key[0] + 1})" if key[1] else ""
                warn(f"damaged checkpoint(s) skipped: {'; '.join(damaged)}. Resuming from the "
                     f"intact checkpoint after epoch {key[0]}{where}")
            return checkpoint, payload
        if damaged:
            raise CheckpointError(
                f"no intact checkpoint to resume the run from in {self.root}: "
                f"{'; '.join(damaged)}. Remove them to start the run over from epoch 0, or "
                f"fit with a new run_id")
        return None, None

    def write_rows(self, epochs_done: int, step: int, rank: int, position: bytes) -> None:
        """Rank ``rank``'s position inside the epoch (the rows it trained), beside the
        checkpoint after ``epochs_done`` epochs and ``step`` steps; written before rank 0
        writes that checkpoint, so a checkpoint that exists has every rank's."""
        self.fs.makedirs(self.root, exist_ok=True)
        put_file(self.fs, self._path((epochs_done, step), f"rows-{rank}"), position)

    def read_rows(self, checkpoint: Checkpoint, ranks: int) -> List[bytes]:
        """The positions ranks ``0..ranks-1`` wrote beside ``checkpoint``
        (``FileNotFoundError`` when one is missing)."""
        key = (checkpoint.epochs_done, checkpoint.step)
        return [self.fs.cat_file(self._path(key, f"rows-{rank}")) for rank in range(ranks)]

    def write(self, epochs_done: int, payload: bytes, meta: Dict[str, Any], step: int = 0
              ) -> Checkpoint:
        """Write the checkpoint after ``epochs_done`` epochs and ``step`` steps of the next
        one (0: an epoch's end), then prune old ones."""
        key = (epochs_done, step)
        self.fs.makedirs(self.root, exist_ok=True)
        meta = dict(meta, epochs_done=epochs_done, step=step, payload=_fingerprint(payload))
        marker = json.dumps(meta).encode()
        try:
            put_file(self.fs, self._path(key, "ckpt"), payload)
            put_file(self.fs, self._path(key, "json"), marker)
        except StoreFullError as exc:  # retrying would fill the disk again: fail at once
            try:
                self.fs.rm_file(self._path(key, "ckpt"))  # no data without its marker
            except OSError:
                pass
            where = f" and step {step} of the next" if step else ""
            raise mark_user_error(store_full(
                self.fs, self.root, len(payload) + len(marker), exc,
                what=f"the checkpoint after epoch {epochs_done}{where} to {self.root}"),
                "the store (out of space)") from None
        done = self._done()
        ends = [old for old in done if not old[1]]
        for old in ends[:-self.keep] + [old for old in done if old[1] and old < key]:
            for suffix in ("json", "ckpt"):  # the marker first: never a marker without data
                try:
                    self.fs.rm_file(self._path(old, suffix))
                except FileNotFoundError:
                    pass
            if old[1]:  # a checkpoint inside an epoch: the ranks' positions too
                for path in self.fs.glob(self._path(old, "rows-*")):
                    try:
                        self.fs.rm_file(path)
                    except FileNotFoundError:
                        pass
        return Checkpoint(epochs_done, meta, self._path(key, "ckpt"), step)


def _fingerprint(payload: bytes) -> Dict[str, Any]:
    return {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}


def _damage(payload: bytes, expected: Optional[Dict[str, Any]]) -> str:
    """What is wrong with ``payload`` against its recorded fingerprint ("" when whole; older
    checkpoints without one are taken as they are)."""
    if not expected:
        return ""
    if len(payload) != expected.get("bytes"):
        return f"{len(payload)} bytes, written with {expected.get('bytes')}: truncated or changed"
    if hashlib.sha256(payload).hexdigest() != expected.get("sha256"):
        return "its SHA-256 differs from the one written: changed or corrupted"
    return ""
