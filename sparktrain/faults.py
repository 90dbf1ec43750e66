"""Which failures Spark should retry: faults yes, bugs in the user's code no.

A lost process, a lost executor or a flaky store are *faults*: the training stage is re-run and
resumes from the last checkpoint. An exception raised by the user's own code (the model's
forward, the loss, metrics, callbacks, ``transformation_fn``, ``train_minibatch_fn``) is a
*bug*: re-running the stage fails the same way after the same wait, so it fails the fit at
once, with its traceback.

The training loops run user code inside :func:`user_code`, which marks an escaping exception
as the user's unless it is a fault seen through user code: a collective failing because a peer
went away ("Connection reset by peer" inside DDP's forward or backward) is a fault wherever it
surfaces.

Example (executor side)::

    with user_code("the model's forward"):
        outputs = model(*features)
    ...
    except BaseException as exc:
        retry = not is_user_error(exc)
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional

_MARK = "_sparktrain_user_code"

# Exception classes (by name, so no framework is imported here) raised when a peer, the network
# or the distributed runtime fails: torch.distributed's DistError family (torch >= 2.1) and the
# TensorFlow status errors its collectives raise when a worker goes away.
_FAULT_CLASSES = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
                  "UnavailableError", "AbortedError", "CancelledError",
                  "DeadlineExceededError", "HorovodInternalError"}
# ... and the texts Gloo, NCCL and the OS use for the same (Gloo raises a plain RuntimeError).
_FAULT_TEXT = re.compile(r"Connection (reset|closed|refused) by peer|Broken pipe|"
                         r"\[[^\]]*gloo[^\]]*\]|NCCL (error|communicator)|"
                         r"Socket Timeout|timed out|Timeout waiting|Collective ops is aborted|"
                         r"[Ff]ailed to connect|Socket closed|unreachable", re.I)


def is_fault(exc: BaseException) -> bool:
    """True when ``exc`` says a peer, the network or the distributed runtime failed."""
    if isinstance(exc, (ConnectionError, TimeoutError, EOFError)):
        return True
    if any(cls.__name__ in _FAULT_CLASSES for cls in type(exc).__mro__):
        return True
    return bool(_FAULT_TEXT.search(str(exc)))


def is_fault_text(traceback_text: str) -> bool:
    """:func:`is_fault` for a reported traceback (its last line names the exception)."""
    lines = traceback_text.strip().splitlines()
    last = lines[-1] if lines else ""
    name = last.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    return name in _FAULT_CLASSES or name in _FAULT_BUILTINS or bool(_FAULT_TEXT.search(last))


_FAULT_BUILTINS = {"ConnectionError", "ConnectionResetError", "ConnectionAbortedError",
                   "ConnectionRefusedError", "BrokenPipeError", "TimeoutError", "EOFError"}


_MEMORY_HINT = ("If memory is the cause, give the executors more (spark.executor.memory, "
                "spark.executor.memoryOverhead) or lower batch_size. It is a fault: Spark "
                "re-runs the ranks (max_attempts counts it).")


def lost_rank_text(rank: int, host: str) -> str:
    """What the fit says about a rank whose process ended without a Python error."""
    return (f"rank {rank}'s process on {host} ended without a Python error: it was killed by "
            f"a signal (SIGKILL, most often from the operating system's out-of-memory killer, "
            f"or its executor was lost: a killed container, a lost machine) or crashed in "
            f"native code. {_MEMORY_HINT}")


def killed_text(what: str, signal_number: int) -> str:
    """What the fit says about a process of a rank (``what``) killed by ``signal_number``."""
    import signal

    try:
        name = signal.Signals(signal_number).name
    except ValueError:
        name = f"signal {signal_number}"
    usual = " (most often from the operating system's out-of-memory killer)" \
        if signal_number == signal.SIGKILL else ""
    return f"{what} was killed by {name}{usual}. {_MEMORY_HINT}"


def mark_user_error(exc: BaseException, what: str) -> BaseException:
    """Mark ``exc`` as raised by the user's code (``what``: where), so it is not retried."""
    try:
        setattr(exc, _MARK, what)
    except (AttributeError, TypeError):  # exceptions without a __dict__: keep it a fault
        pass
    return exc


def user_error_source(exc: BaseException) -> Optional[str]:
    """Where the user's code raised ``exc`` (or an exception it was chained from), else None."""
    seen = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        what = getattr(cause, _MARK, None)
        if what is not None:
            return what
        cause = cause.__cause__ or cause.__context__
    return None


def is_user_error(exc: BaseException) -> bool:
    """True when ``exc`` came out of the user's code and is not a fault seen through it."""
    return user_error_source(exc) is not None


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the user's code: an ``Exception`` escaping it is marked as the user's (not retried)
    unless :func:`is_fault` says a peer or the network failed underneath."""
    try:
        yield
    except Exception as exc:
        if not is_fault(exc) and not hasattr(exc, _MARK):
            mark_user_error(exc, what)
        raise
