"""``checkpoint_callback``: which epoch's model ``KerasEstimator.fit`` returns.

Horovod's ``KerasEstimator`` runs the ``keras.callbacks.ModelCheckpoint`` given as
``checkpoint_callback`` on rank 0 with its ``filepath`` replaced by the run's checkpoint file,
and returns the model read back from that file (horovod/spark/keras/remote.py, 0.28.1): with
``save_best_only=True`` the best epoch's model by the callback's ``monitor`` and ``mode``, else
the last epoch's. sparktrain keeps that
meaning. It checkpoints every epoch to the store itself (for retries and resume), so the
callback's own file is not written: its settings are read on the driver
(:func:`checkpoint_settings`), and on rank 0 :class:`BestModel` keeps the best epoch's
``.keras`` file in the run's directory (``<run>/checkpoint_callback/best.keras``), where a
resumed run finds it again (the best value so far is recomputed from the run's history).

Example (worker side)::

    best = BestModel(settings, run_path, storage_options, history)
    ...  # after each epoch, on rank 0
    best.epoch_end(epoch, logs, model_file)
    final = best.model_bytes()      # None: return the last epoch's model
"""
from __future__ import annotations

import math
import posixpath
from typing import Any, Dict, List, Optional

_MAX_WORDS = ("acc", "auc", "precision", "recall", "f1", "iou")


def checkpoint_settings(callback: Any, validation: Any) -> Optional[Dict[str, Any]]:
    """Plain settings of a ``ModelCheckpoint`` (driver side), or ``None`` when the fitted
    model is simply the last epoch's (no callback, or ``save_best_only=False``).

    ``mode="auto"`` follows Keras: ``min`` for losses; ``max`` for accuracy-like names; any
    other name needs an explicit ``mode``. A ``val_`` monitor needs ``validation``.
    """
    if callback is None:
        return None
    import keras

    if not isinstance(callback, keras.callbacks.ModelCheckpoint):
        raise TypeError(f"checkpoint_callback must be a keras.callbacks.ModelCheckpoint, got "
                        f"{type(callback).__name__}")
    if not callback.save_best_only:
        return None
    monitor = str(callback.monitor)
    mode = getattr(callback, "mode", "auto")
    if mode not in ("min", "max"):
        name = monitor.removeprefix("val_")
        if name.endswith("loss") or name in ("mse", "mae", "mape", "msle"):
            mode = "min"
        elif any(word in name for word in _MAX_WORDS):
            mode = "max"
        else:
            raise ValueError(f"checkpoint_callback monitors {monitor!r} with mode='auto', and "
                             f"whether it should go up or down is unknown; pass mode='min' or "
                             f"mode='max' to the ModelCheckpoint")
    if monitor.startswith("val_") and validation is None:
        raise ValueError(f"checkpoint_callback monitors {monitor!r}, but there is no validation "
                         f"data: pass validation=<fraction or column>, or monitor 'loss'")
    baseline = getattr(callback, "best", None)
    if not (isinstance(baseline, (int, float)) and math.isfinite(baseline)):
        baseline = None
    return {"monitor": monitor, "mode": mode,
            "baseline": float(baseline) if baseline is not None else None}


class BestModel:
    """Rank 0's best-epoch model in the store, by the settings of :func:`checkpoint_settings`."""

    def __init__(self, settings: Dict[str, Any], run_path: str,
                 storage_options: Optional[Dict[str, Any]],
                 history: Dict[str, List[float]]) -> None:
        from sparktrain.fs import filesystem

        self.monitor, self.mode = settings["monitor"], settings["mode"]
        self.fs, root = filesystem(posixpath.join(run_path, "checkpoint_callback"),
                                   storage_options)
        self.path = posixpath.join(root, "best.keras")
        self.best = settings.get("baseline")
        for value in history.get(self.monitor, []):  # a resumed run: its epochs so far
            if self._better(value):
                self.best = value

    def _better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value < self.best if self.mode == "min" else value > self.best

    def epoch_end(self, epoch: int, logs: Dict[str, float], model_file: str) -> bool:
        """Keep ``model_file`` (the epoch's saved ``.keras``) if ``logs`` improve on the best;
        returns whether it did."""
        if self.monitor not in logs:
            raise ValueError(f"checkpoint_callback monitors {self.monitor!r}, which is not among "
                             f"this epoch's metrics {sorted(logs)}")
        value = float(logs[self.monitor])
        if not self._better(value):
            return False
        self.best = value
        self.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
        with open(model_file, "rb") as f:
            data = f.read()
        self.fs.pipe_file(self.path + ".tmp", data)
        self.fs.mv(self.path + ".tmp", self.path)
        return True

    def model_bytes(self) -> Optional[bytes]:
        """The best epoch's ``.keras`` file, or ``None`` if no epoch was kept."""
        if not self.fs.exists(self.path):
            return None
        return self.fs.cat_file(self.path)
