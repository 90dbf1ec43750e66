"""Ctrl-C during a fit: the fit's Spark jobs are cancelled and ``KeyboardInterrupt`` reaches
the caller, on classic sessions and over Spark Connect.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives
(Jupyter's "interrupt kernel" sends one). Two places lose it: a finalizer (``__del__``: an
exception there is printed as "Exception ignored in ..." and dropped; pyspark's Connect client
makes gRPC calls from some, e.g. ``CachedRemoteRelation.__del__``), and code that catches
``BaseException`` to clean up and then carries on. A lost interrupt left a fit running to its
end. So for the fit's duration SIGINT goes to :func:`interruptible`'s handler, which does not
rely on the exception alone:

1. it records the interrupt and, from a thread of its own, cancels every Spark job tagged with
   the fit's tag (``cancelJobsWithTag``, or ``interruptTag`` over Connect): the job the fit
   waits on ends within seconds, wherever the exception went;
2. it raises ``KeyboardInterrupt``; and the fit calls :func:`raise_if_interrupted` before it
   starts each Spark job and on its way out, so a lost one is raised again there.

The exception is not raised inside gRPC's own code (the Spark Connect client's calls): a
``KeyboardInterrupt`` there can leave one of the channel's locks held by the main thread, and
every later call over that channel then waits forever for an answer (seen: the next ``fit``
hung in its first job). While the main thread is in such code the handler only cancels: the
cancelled call fails within moments and its error, leaving the block, becomes the
``KeyboardInterrupt``; a call that ends normally meets :func:`raise_if_interrupted` next.

A second Ctrl-C while the first is being cleaned up exits at once, saying what may be left.

Example::

    with interruptible(spark, "sparktrain-fit-1234", "TorchEstimator.fit"):
        with job_tag(spark, "sparktrain-fit-1234"):
            ...  # Spark jobs; Ctrl-C cancels them and raises KeyboardInterrupt
"""
from __future__ import annotations

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


class _Scope:
    """One interruptible block: its tag, and when (if) it was interrupted."""

    def __init__(self, spark: Any, tag: str, what: str) -> None:
        self.spark, self.tag, self.what = spark, tag, what
        self.interrupted_at: Optional[float] = None

    def handle(self, signum: int, frame: Any) -> None:
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
        if in_unsafe_code(frame):  # raised later, out of gRPC (see the module docstring)
            log.info("interrupted inside a Spark Connect call: KeyboardInterrupt follows when "
                     "the cancelled call returns")
            return
        raise KeyboardInterrupt

    def _cancel(self) -> None:
        log.warning("interrupted: cancelling the Spark jobs of %s (tag %s)", self.what, self.tag)
        cancel_tag(self.spark, self.tag)


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
    scope = _Scope(spark, tag, what)
    previous = signal.signal(signal.SIGINT, scope.handle)
    _active = scope
    try:
        yield
        raise_if_interrupted()  # an interrupt lost on the way still stops the caller
    except KeyboardInterrupt:
        raise
    except BaseException:
        if scope.interrupted_at is not None:  # the cancelled job's error, after a lost one
            raise KeyboardInterrupt from None
        raise
    finally:
        _active = None
        signal.signal(signal.SIGINT, previous)


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when the current interruptible block was interrupted (its
    exception may have been lost: see the module docstring)."""
    scope = _active
    if scope is not None and scope.interrupted_at is not None and \
            threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt
