"""Ctrl-C during a fit or a prediction: the Spark jobs are cancelled and ``KeyboardInterrupt``
reaches the caller, on classic sessions and over Spark Connect.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives
(Jupyter's "interrupt kernel" sends one). Two places lose it: a finalizer (``__del__``: an
exception there is printed as "Exception ignored in ..." and dropped; pyspark's Connect client
makes gRPC calls from some, e.g. ``CachedRemoteRelation.__del__``), and code that catches
``BaseException`` to clean up and then carries on. A lost interrupt left a fit running to its
end. So for the fit's duration SIGINT goes to :func:`interruptible`'s handler, which does not
rely on the exception alone:

1. it records the interrupt and, from a thread of its own, cancels every Spark job tagged with
   the fit's tag (``cancelJobsWithTag``, or ``interruptTag`` over Connect), and again every
   second until the fit has stopped: a cancel that reaches the server before the job it meant
   (being submitted, or the next one) cancels nothing, and was once all there was;
2. it raises ``KeyboardInterrupt``; and the fit calls :func:`raise_if_interrupted` before it
   starts each Spark job and on its way out, so a lost one is raised again there.

The exception is not raised inside gRPC's own code (the Spark Connect client's calls): a
``KeyboardInterrupt`` there can leave one of the channel's locks held by the main thread, and
every later call over that channel then waits forever for an answer (seen: the next ``fit``
hung in its first job); nor inside a finalizer, where it would be dropped. There the handler
only records it: the call it landed in is a Spark job that the cancel ends (its error, leaving
the block, becomes the ``KeyboardInterrupt``) or a short call after which the fit reaches
:func:`raise_if_interrupted`. It is never delivered again asynchronously: an exception raised
while the cancelled call's error unwinds the fit would cut its clean-up short (seen: a run's
lock left behind, so the resuming fit was refused). The handler is set inside the block's
``try``, so that the one before it is always put back (a handler left behind would act on an
interrupt for a fit long over).

A prediction's action (``collect()`` on ``transform``'s output) runs outside sparktrain, with
Python's default handler: over Connect its main thread waits in the client, which runs
finalizers that make gRPC calls, and an interrupt that landed in one was dropped while the
prediction ran to its end. ``transform`` over Connect therefore replaces Python's default
handler (only that one) by :class:`_PredictionGuard`: the same ``KeyboardInterrupt``, delivered
again when it arrives in a finalizer (:func:`guard_predictions`).

A second Ctrl-C while the first is being cleaned up exits at once, saying what may be left.

Example::

    with interruptible(spark, "sparktrain-fit-1234", "TorchEstimator.fit"):
        with job_tag(spark, "sparktrain-fit-1234"):
            ...  # Spark jobs; Ctrl-C cancels them and raises KeyboardInterrupt
"""
from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from sparktrain.session.spark_api import cancel_tag

log = logging.getLogger("sparktrain")


# Code where an exception must not be raised asynchronously: gRPC's Python layer and the
# Connect client around it hold locks across statements (see the module docstring).
_UNSAFE_PARTS = (f"{os.sep}grpc{os.sep}", os.path.join("pyspark", "sql", "connect", "client", ""))


def in_unsafe_code(frame: Any) -> bool:
    """Whether ``frame`` or a caller of it runs gRPC's or the Connect client's code."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _UNSAFE_PARTS):
            return True
        frame = frame.f_back
    return False


def in_finalizer(frame: Any) -> bool:
    """Whether ``frame`` or a caller of it is a finalizer (``__del__``, a ``weakref.finalize``
    callback): Python prints an exception raised there and drops it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and
                                         code.co_filename.endswith(f"{os.sep}weakref.py")):
            return True
        frame = frame.f_back
    return False


_REDELIVER_S = 0.05  # how soon a deferred interrupt is delivered again


class _Deferred:
    """An interrupt that could not be raised where it arrived (a finalizer):
    ``_thread.interrupt_main`` hands it to the main thread again every ``_REDELIVER_S`` until
    it is raised (``raised``), so it cannot be lost. ``redelivery`` marks the signals it sent
    (not a second Ctrl-C)."""

    def __init__(self) -> None:
        self.raised, self.redelivery, self.scheduled = False, False, False

    def defer(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            threading.Timer(_REDELIVER_S, self._redeliver).start()

    def _redeliver(self) -> None:
        self.scheduled = False
        if self.raised:
            return
        self.redelivery = True
        _thread.interrupt_main(signal.SIGINT)  # runs the handler at the main thread's next step

    def take_redelivery(self) -> bool:
        was, self.redelivery = self.redelivery, False
        return was

    def raise_now(self) -> None:
        self.raised = True
        raise KeyboardInterrupt


class _Scope:
    """One interruptible block: its tag, and when (if) it was interrupted."""

    def __init__(self, spark: Any, tag: str, what: str, previous: Any) -> None:
        self.spark, self.tag, self.what, self.previous = spark, tag, what, previous
        self.interrupted_at: Optional[float] = None
        self.open = True  # until the block has ended
        self.raised = False  # its KeyboardInterrupt has been raised

    def handle(self, signum: int, frame: Any) -> None:
        if not self.open:  # left installed after its block: act as the handler before it
            _call_handler(self.previous, signum, frame)
            return
        if self.interrupted_at is not None:  # the second Ctrl-C: do not wait for anything
            sys.stderr.write(
                f"\nsparktrain: second interrupt: {self.what} stops without waiting for its "
                f"clean-up. Its Spark jobs (tag {self.tag}) were cancelled "
                f"{time.monotonic() - self.interrupted_at:.0f}s ago and end on their own; the "
                f"run's lock lapses by itself (spark.sparktrain.leaseSeconds); a half-written "
                f"dataset or checkpoint is never used.\n")
            raise KeyboardInterrupt
        self.interrupted_at = time.monotonic()
        threading.Thread(target=self._cancel, name="sparktrain-interrupt", daemon=True).start()
        self._raise_or_defer(frame)

    def _raise_or_defer(self, frame: Any) -> None:
        if in_unsafe_code(frame) or in_finalizer(frame):  # raised later (module docstring)
            log.info("interrupted inside a Spark Connect call or a finalizer: the cancelled "
                     "job's error or the fit's next step raises KeyboardInterrupt")
            return
        self.raised = True
        raise KeyboardInterrupt

    def _cancel(self) -> None:
        """Cancel the block's jobs, and again while the block runs on without raising: a cancel
        that reached the server before the job it meant (a job being submitted, or the next
        one) cancels nothing."""
        log.warning("interrupted: cancelling the Spark jobs of %s (tag %s)", self.what, self.tag)
        cancel_tag(self.spark, self.tag)
        while self.open and not self.raised:
            time.sleep(_RECANCEL_S)
            if self.open and not self.raised:
                cancel_tag(self.spark, self.tag)


_RECANCEL_S = 1.0  # how often an interrupted block's jobs are cancelled again until it stops


def _call_handler(handler: Any, signum: int, frame: Any) -> None:
    """What ``handler`` (a ``signal.getsignal`` value) does with a signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # SIG_DFL, or None (not set from Python): stop
        raise KeyboardInterrupt


_active: Optional[_Scope] = None  # the main thread's interruptible block, if any


@contextmanager
def interruptible(spark: Any, tag: str, what: str) -> Iterator[None]:
    """During the block, SIGINT cancels the Spark jobs tagged ``tag`` and raises
    ``KeyboardInterrupt`` (see the module docstring); an exception leaving the block after an
    interrupt becomes ``KeyboardInterrupt``. Only the main thread receives signals: elsewhere
    (a fit in a thread pool) the block changes nothing."""
    global _active
    if threading.current_thread() is not threading.main_thread() or _active is not None:
        yield
        return
    scope = _Scope(spark, tag, what, signal.getsignal(signal.SIGINT))
    try:  # the handler is set inside: whatever happens, the finally puts the previous back
        _active = scope
        signal.signal(signal.SIGINT, scope.handle)
        yield
        raise_if_interrupted()  # an interrupt lost on the way still stops the caller
    except KeyboardInterrupt:
        scope.raised = True
        raise
    except BaseException:
        if scope.interrupted_at is not None:  # the cancelled job's error, after a lost one
            scope.raised = True
            raise KeyboardInterrupt from None
        raise
    finally:
        scope.open = False
        _active = None
        signal.signal(signal.SIGINT, scope.previous if scope.previous is not None
                      else signal.default_int_handler)


class _PredictionGuard:
    """SIGINT between fits, in a process that predicts over Spark Connect: Python's default
    (``KeyboardInterrupt`` where the main thread is), except that an interrupt arriving in a
    finalizer, where Python would drop it, is delivered again as soon as the main thread has
    left the finalizer. A prediction's action (``collect()`` on ``transform``'s output) runs
    outside sparktrain, waiting in the Connect client, which makes gRPC calls from finalizers:
    there the interrupt was lost and the prediction ran to its end."""

    def __init__(self) -> None:
        self.deferred = _Deferred()

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.deferred.take_redelivery():
            self.deferred.raised = False  # a new interrupt
        if in_finalizer(frame):
            self.deferred.defer()
            return
        self.deferred.raise_now()


_GUARD: Optional[_PredictionGuard] = None


def guard_predictions() -> None:
    """Install :class:`_PredictionGuard` for this process (called by ``transform`` over Spark
    Connect): only from the main thread, and only in place of Python's own default handler
    (a handler of the user's, a notebook's or pyspark's stays). Idempotent."""
    global _GUARD
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _GUARD = _GUARD or _PredictionGuard()
        signal.signal(signal.SIGINT, _GUARD)


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when the current interruptible block was interrupted (its
    exception may have been lost: see the module docstring)."""
    scope = _active
    if scope is not None and scope.interrupted_at is not None and \
            threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt
