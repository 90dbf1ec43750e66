"""The driver's live view of a fit: one progress bar fed by rank 0's events.

Rank 0 sends ``{"event": "start", "epochs", "steps", "first"}`` (``first``: epochs already done
by a resumed run; a retried attempt sends it again), ``{"event": "step", "epoch", "step",
"loss"}`` (at most a few per second) and ``{"event": "epoch", "epoch", "logs"}``; this turns
them into a tqdm bar (``tqdm.auto``: a widget in Jupyter, text in a terminal). Log lines are
written through ``tqdm.write`` so they do not tear the bar.

Example::

    with FitProgress(verbose=1) as progress:
        run_barrier(spark, 2, task, on_progress=progress.update)
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Dict, Optional


class TqdmLogHandler(logging.Handler):
    """A logging handler that prints above an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)  # logs go to stderr, like the bar
        except Exception:  # logging must never break training
            self.handleError(record)


class FitProgress:
    """One bar per fit over all epochs' steps; quiet when ``verbose == 0``."""

    def __init__(self, verbose: int = 1) -> None:
        self.verbose = verbose
        self._bar: Optional[Any] = None
        self._lock = threading.Lock()
        self._epochs = 0
        self._steps = 0

    def update(self, event: Dict[str, Any]) -> None:
        if self.verbose < 1:
            return
        with self._lock:
            kind = event.get("event")
            if kind == "start":
                from tqdm.auto import tqdm

                self._epochs, self._steps = int(event["epochs"]), int(event["steps"])
                first = int(event.get("first", 0))
                if self._bar is not None:  # a retried attempt starts over from its checkpoint
                    self._bar.close()
                self._bar = tqdm(total=self._epochs * self._steps, initial=first * self._steps,
                                 unit="step", desc=f"epoch {first + 1}/{self._epochs}",
                                 leave=True, dynamic_ncols=True)
            elif self._bar is None:
                return
            elif kind == "step":
                done = int(event["epoch"]) * self._steps + int(event["step"])
                self._bar.update(max(0, done - self._bar.n))
                self._bar.set_description(f"epoch {int(event['epoch']) + 1}/{self._epochs}",
                                          refresh=False)
                self._bar.set_postfix(loss=f"{event['loss']:.4g}", refresh=True)
            elif kind == "epoch":
                done = (int(event["epoch"]) + 1) * self._steps
                self._bar.update(max(0, done - self._bar.n))
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in event["logs"].items()},
                                      refresh=True)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> "FitProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
