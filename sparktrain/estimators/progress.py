"""The driver's live view of a fit: a progress bar, or progress lines off a terminal.

Rank 0 sends ``{"event": "start", "epochs", "steps", "first"}`` (``first``: epochs already done
by a resumed run; a retried attempt sends it again), ``{"event": "step", "epoch", "step",
"loss"}`` (at most a few per second) and ``{"event": "epoch", "epoch", "logs"}``. In Jupyter
and on a terminal this turns them into a tqdm bar (``tqdm.auto``: a widget in Jupyter, text in
a terminal); log lines are written through ``tqdm.write`` so they do not tear the bar.

When stderr is not a terminal (``spark-submit`` on YARN, output sent to a file) a bar's
carriage-return redraws would pile up in the log, so there is no bar: rank 0's ``[rank 0] epoch
k/N ...`` lines say how each epoch went, and during an epoch longer than the interval
(``spark.sparktrain.progressIntervalSeconds``, default 60; 0 turns them off) a line such as
``epoch 2/6  step 120/230 (52%)  loss=0.1234  4.1 steps/s  epoch ETA 27s`` goes to the
``sparktrain`` logger.

Rank 0 sends ``start`` and ``epoch`` events whatever ``verbose`` is; ``listeners`` (e.g.
:mod:`sparktrain.mlflow`'s tracker) get every event, even with ``verbose=0``, and can never
fail the fit.

Example::

    with FitProgress(verbose=1, listeners=[print]) as progress:
        run_barrier(spark, 2, task, on_progress=progress.update)
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from pyspark.sql import SparkSession

from sparktrain.session.spark_api import conf_value

log = logging.getLogger(__name__)

INTERVAL_CONF = "spark.sparktrain.progressIntervalSeconds"
DEFAULT_INTERVAL_SECONDS = 60.0


def interval_from_conf(spark: SparkSession) -> float:
    """Seconds between progress lines within an epoch when stderr is not a terminal
    (:data:`INTERVAL_CONF`; 0 or less: none)."""
    value = conf_value(spark, INTERVAL_CONF, None)
    if value is None or value == "":
        return DEFAULT_INTERVAL_SECONDS
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{INTERVAL_CONF}={value!r}; expected a number of seconds "
                         f"(0 turns the periodic progress lines off)") from None


def draws_bar(stream: Optional[TextIO] = None) -> bool:
    """Whether a live bar suits ``stream`` (default ``sys.stderr``): in Jupyter (tqdm's widget;
    the same test ``tqdm.autonotebook`` makes) or on a terminal."""
    if "ipykernel.zmqshell" in sys.modules:
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class TqdmLogHandler(logging.Handler):
    """A logging handler that prints above an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)  # logs go to stderr, like the bar
        except Exception:  # logging must never break training
            self.handleError(record)


class FitProgress:
    """One bar per fit over all epochs' steps, or progress lines when ``stream`` (default
    stderr) is not a terminal and this is not Jupyter (see the module docstring); quiet when
    ``verbose == 0``. ``interval``: seconds between progress lines within an epoch."""

    def __init__(self, verbose: int = 1, stream: Optional[TextIO] = None,
                 interval: float = DEFAULT_INTERVAL_SECONDS,
                 listeners: Sequence[Callable[[Dict[str, Any]], None]] = ()) -> None:
        self.verbose = verbose
        self.listeners: List[Callable[[Dict[str, Any]], None]] = list(listeners)
        self.lines = not draws_bar(stream)  # line-based progress instead of a bar
        self.interval = interval
        self._stream = stream
        self._bar: Optional[Any] = None
        self._lock = threading.Lock()
        self._epochs = 0
        self._steps = 0
        self._epoch = -1  # line mode: the epoch running, when it started, the last line's time
        self._epoch_started = self._last_line = 0.0

    def update(self, event: Dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener never fails or stops training
                log.debug("progress listener %r failed", listener, exc_info=True)
        if self.verbose < 1:
            return
        with self._lock:
            if self.lines:
                self._line_update(event)
                return
            kind = event.get("event")
            if kind == "start":
                from tqdm.auto import tqdm

                self._epochs, self._steps = int(event["epochs"]), int(event["steps"])
                first = int(event.get("first", 0))
                if self._bar is not None:  # a retried attempt starts over from its checkpoint
                    self._bar.close()
                where = {} if self._stream is None else {"file": self._stream}
                self._bar = tqdm(total=self._epochs * self._steps, initial=first * self._steps,
                                 unit="step", desc=f"epoch {first + 1}/{self._epochs}",
                                 leave=True, dynamic_ncols=True, **where)
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

    def _line_update(self, event: Dict[str, Any]) -> None:
        """Line mode: follow the epochs; during one, log a line every ``interval`` seconds."""
        kind, now = event.get("event"), time.monotonic()
        if kind == "start":  # also a retried attempt's, resuming at epoch `first`
            self._epochs, self._steps = int(event["epochs"]), int(event["steps"])
            self._epoch, self._epoch_started = int(event.get("first", 0)), now
            self._last_line = now
        elif kind == "epoch":
            self._epoch, self._epoch_started = int(event["epoch"]) + 1, now
            self._last_line = now
        elif kind == "step" and self._steps:
            epoch, step = int(event["epoch"]), int(event["step"])
            if epoch != self._epoch:  # its start was missed: count from here
                self._epoch, self._epoch_started, self._last_line = epoch, now, now
                return
            if self.interval <= 0 or now - self._last_line < self.interval:
                return
            self._last_line = now
            rate = step / max(now - self._epoch_started, 1e-9)
            eta = _duration((self._steps - step) / rate) if rate > 0 else "?"
            log.info("epoch %d/%d  step %d/%d (%d%%)  loss=%.4g  %.3g steps/s  epoch ETA %s",
                     epoch + 1, self._epochs, step, self._steps, 100 * step // self._steps,
                     float(event.get("loss", float("nan"))), rate, eta)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> "FitProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
