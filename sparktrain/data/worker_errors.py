"""The errors a :class:`~sparktrain.data.workers.DecodePool` raises, and what they say.

:class:`TransformationFailed`: the user's function raised in a worker (the worker's traceback
travels with it). :class:`DecodeWorkerError`: a worker died or could not return its result;
:func:`worker_ended` words the death (exit code or signal, the batch it had, the likely cause).

Example::

    worker_ended(1, 4242, "transformation_fn", -9, "batch 3 of epoch 0")
    # DecodeWorkerError('decode worker 1 (pid 4242) of transformation_fn was killed by SIGKILL
    #                    while batch 3 of epoch 0 was assigned to it. Likely causes: ...')
"""
from __future__ import annotations

import signal
from typing import Any, Optional

#: signals a native crash raises (rather than the OOM killer's or a user's SIGKILL/SIGTERM)
_CRASH_SIGNALS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE"}


class DecodeWorkerError(RuntimeError):
    """A decode worker process died (killed by a signal / OOM killer, segfault in a native
    decoder), or could not place its result in shared memory.

    Example::

        try:
            next(pool.map(batches))
        except DecodeWorkerError as exc:
            print(exc)   # decode worker 1 (pid 4242) of transformation_fn was killed by SIGKILL...
    """


class TransformationFailed(RuntimeError):
    """``transformation_fn`` raised inside a worker; ``remote_traceback`` holds the worker's
    formatted traceback and ``exc_type`` the exception's class name.

    Example::

        except TransformationFailed as exc:
            exc.exc_type            # 'ValueError'
            exc.remote_traceback    # 'Traceback (most recent call last): ...'
    """

    def __init__(self, message: str, remote_traceback: str = "", exc_type: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type

    def __reduce__(self) -> Any:
        # keep the traceback (and attributes set later, such as fault marks) when Spark pickles
        # the exception on its way from the executor to the driver
        return type(self), (self.args[0], self.remote_traceback, self.exc_type), self.__dict__


def worker_ended(worker: int, pid: Optional[int], name: str, code: Optional[int],
                 doing: Optional[str]) -> DecodeWorkerError:
    """The error for decode worker ``worker`` of the function ``name`` that ended with exit code
    ``code`` (``None``: it closed its connection) while ``doing`` a batch (``None``: idle)."""
    while_ = f" while {doing} was assigned to it" if doing else " while idle"
    if code is None:
        how = "closed its connection"
    elif code < 0:
        how = f"was killed by {_signal_name(-code)}"
    else:
        how = f"exited with code {code}"
    signal_name = _signal_name(-code) if code is not None and code < 0 else ""
    if code is not None and code >= 0:
        hint = ("It ended by itself (os._exit or sys.exit outside the function, or it could "
                "not start); its traceback, if any, is in this process's stderr (the "
                "executor's log).")
    elif signal_name in _CRASH_SIGNALS:
        hint = ("Likely cause: a crash in a native decoder (a corrupt image, a bug in a C "
                "extension the function calls); the worker's Python stack at the crash is "
                "in this process's stderr (the executor's log)"
                + ("; SIGBUS also when /dev/shm is full (Docker: --shm-size)."
                   if signal_name == "SIGBUS" else "."))
    else:
        hint = ("Likely causes: the kernel's OOM killer (the executor ran out of memory: "
                "lower the number of decode workers or the batch size, or give executors "
                "more memory), or a crash in a native decoder (a corrupt image, a bug in a "
                "C extension the function calls).")
    return DecodeWorkerError(
        f"decode worker {worker} (pid {pid}) of {name} {how}{while_}. {hint}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
