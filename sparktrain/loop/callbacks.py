"""Epoch-end callbacks for :class:`~sparktrain.TorchEstimator` (Keras models take Keras callbacks).

The protocol is three optional methods, all run on every rank with the same values (the logs
are already averaged over ranks, so callbacks decide alike everywhere; if any rank asks to stop,
all stop after that epoch)::

    on_train_begin(model, history)   # the module (unwrapped) and the history so far (resumed)
    on_epoch_end(epoch, logs)        # 0-based epoch, {"loss": .., "val_loss": .., ...};
                                     # return True to stop training after this epoch
    on_train_end(model)

Example::

    est = TorchEstimator(..., validation=0.2,
                         callbacks=[EarlyStopping(monitor="val_loss", patience=3)])
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional


class Callback:
    """Base class with no-op hooks; subclass and override what you need."""

    def on_train_begin(self, model: Any, history: Dict[str, List[float]]) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> Optional[bool]:
        return None

    def on_train_end(self, model: Any) -> None:
        pass


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode`` is ``"min"``, ``"max"`` or ``"auto"`` (max for names containing ``acc``, else min),
    as in ``keras.callbacks.EarlyStopping``. After a resume the count continues from the
    run's history. ``restore_best_weights`` puts the best epoch's weights back at the end
    (best of the epochs trained since the last (re)start).
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto", restore_best_weights: bool = False) -> None:
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode={mode!r}; expected 'auto', 'min' or 'max'")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        self.monitor, self.patience, self.min_delta = monitor, patience, abs(min_delta)
        self.maximize = mode == "max" or (mode == "auto" and "acc" in monitor)
        self.restore_best_weights = restore_best_weights
        self.best = -math.inf if self.maximize else math.inf
        self.wait = 0
        self.stopped_epoch: Optional[int] = None
        self._model: Any = None
        self._best_state: Optional[Dict[str, Any]] = None

    def _improved(self, value: float) -> bool:
        if self.maximize:
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def _see(self, value: float) -> bool:
        if self._improved(value):
            self.best, self.wait = value, 0
            return True
        self.wait += 1
        return False

    def on_train_begin(self, model: Any, history: Dict[str, List[float]]) -> None:
        self._model = model
        self.best = -math.inf if self.maximize else math.inf
        self.wait, self.stopped_epoch, self._best_state = 0, None, None
        for value in history.get(self.monitor, []):
            self._see(value)

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> Optional[bool]:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, but the epoch logs have "
                           f"only {sorted(logs)} (validation metrics need validation=...)")
        if self._see(logs[self.monitor]):
            if self.restore_best_weights and self._model is not None:
                self._best_state = {k: v.detach().clone()
                                    for k, v in self._model.state_dict().items()}
            return None
        if self.wait >= max(self.patience, 1):
            self.stopped_epoch = epoch
            return True
        return None

    def on_train_end(self, model: Any) -> None:
        if self.restore_best_weights and self._best_state is not None:
            model.load_state_dict(self._best_state)
