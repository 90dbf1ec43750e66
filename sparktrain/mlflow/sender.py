"""A background thread that sends one fit's MLflow calls in order, so that a slow or absent
tracking server never holds up training; the first failure stops it (the fit warns once).

Example::

    sender = Sender()
    sender.submit(lambda: client.log_batch(run_id, metrics=[...]))
    ok = sender.drain(grace=5.0)   # False: an error, or no answer at all within `grace`
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

_STOP = object()


class Sender:
    """Runs submitted calls one by one in a daemon thread until one fails."""

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self.reached = threading.Event()  # a call succeeded: the server answers
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sparktrain-mlflow", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], object]) -> None:
        if self.error is None:
            self._queue.put(call)

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is _STOP:
                return
            if self.error is not None:
                continue  # dropped: the first failure is reported, not one per call
            try:
                call()
                self.reached.set()
            except BaseException as error:  # noqa: BLE001 - reported by drain()
                self.error = error

    def drain(self, grace: float) -> bool:
        """Wait for the calls submitted so far; ``True`` when all of them succeeded. A server
        that answered none within ``grace`` seconds is given up (MLflow's HTTP client retries
        an unreachable server for minutes: ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``); the thread
        then ends on its own and sends nothing more."""
        self._queue.put(_STOP)
        self._thread.join(grace)
        while self._thread.is_alive() and self.reached.is_set() and self.error is None:
            self._thread.join(1.0)  # answering: its remaining calls go through
        if self._thread.is_alive() and self.error is None:
            self.error = TimeoutError(f"the tracking server did not answer within {grace:g}s")
        return self.error is None
