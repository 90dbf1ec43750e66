"""Ctrl-C (a real SIGINT) on a classic session, where pyspark's own handler cancels the jobs:
only here a fit's interrupt meets both handlers (tests/support/interrupt_client.py, checked by
tests/support/interrupts.py; over Spark Connect in test_connect.py), and the handlers' rules
for where an interrupt may not be raised (gRPC's code, a finalizer) are checked in-process.
Each interrupt reaches the caller within seconds, the ranks stop, and a fit with the same
run_id right after takes the run (its lock was released) and resumes from the last
checkpoint."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from support.interrupts import check_interrupts, run_interrupts


@pytest.mark.full
def test_interrupts_of_torch_fits_and_a_prediction_on_a_classic_session(tmp_path):
    # three points where a classic session has Spark jobs to cancel (a write, the barrier
    # stage, the stage after a checkpoint); every point runs over Connect (test_connect.py),
    # whose client has more places to lose an interrupt in; the handler is the same code
    points = "materialization,mid_epoch,after_epoch"
    check_interrupts(run_interrupts("classic", tmp_path, "torch", points), points=3)

# KerasEstimator's interrupt goes through the same code (the fit's scope and tag): it is
# tested over Connect only (test_connect.py), to keep the suite's time.


def test_an_interrupt_is_not_raised_inside_grpc_code():
    """The handler's test for code where a KeyboardInterrupt could leave a gRPC lock held:
    any frame on the stack from grpc's or the Connect client's files."""
    from sparktrain.session.interrupts import in_unsafe_code

    def frame_in(filename: str):
        scope: dict = {}
        exec(compile("def call(get):\n    return get()\n", filename, "exec"), scope)
        return scope["call"](sys._getframe)  # the frame of ``call``, compiled as that file

    assert in_unsafe_code(frame_in(os.path.join("x", "site-packages", "grpc", "_channel.py")))
    assert in_unsafe_code(frame_in(os.path.join("pyspark", "sql", "connect", "client",
                                                "core.py")))
    assert not in_unsafe_code(frame_in(os.path.join("pyspark", "sql", "connect",
                                                    "dataframe.py")))
    assert not in_unsafe_code(sys._getframe())


class _FinalizerInterrupted:
    """A finalizer during which SIGINT arrives: Python drops an exception raised in it."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the handler runs here, inside __del__


def _wait_for_interrupt(seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one
def test_a_ctrl_c_in_a_finalizer_is_raised_once_the_finalizer_ends():
    """Python's own handler loses it (the lost Ctrl-C of a prediction over Connect);
    transform's guard delivers it again, out of the finalizer (a fit's handler raises it at the
    fit's next step instead)."""
    from sparktrain.session.interrupts import _PredictionGuard, in_finalizer

    assert not in_finalizer(sys._getframe())
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        started = time.monotonic()
        _FinalizerInterrupted()  # dropped at once: its __del__ runs here
        _wait_for_interrupt(1.0)  # Python's default: printed as ignored, never raised
        assert time.monotonic() - started >= 1.0
        signal.signal(signal.SIGINT, _PredictionGuard())
        with pytest.raises(KeyboardInterrupt):
            _FinalizerInterrupted()
            _wait_for_interrupt()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_fits_handler_never_outlives_its_block_and_waits_out_grpc_code():
    from sparktrain.session import interrupts

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.interruptible(None, "tag-1", "a fit"):
                assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
                os.kill(os.getpid(), signal.SIGINT)
                _wait_for_interrupt()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert interrupts._active is None
        # a handler left installed (a block that ended without its finally) acts as the one
        # before it, at once, instead of deferring an interrupt for a fit long over
        scope = interrupts._Scope(None, "tag-2", "a fit", signal.default_int_handler)
        scope.open = False
        with pytest.raises(KeyboardInterrupt):
            scope.handle(signal.SIGINT, sys._getframe())
        # inside gRPC's code the interrupt is only recorded: never raised there, nor later
        # from a timer (that could cut the fit's clean-up short); the fit's next step raises it
        scope = interrupts._Scope(None, "tag-3", "a fit", signal.default_int_handler)
        signal.signal(signal.SIGINT, scope.handle)
        scope.interrupted_at = time.monotonic()
        interrupts._active = scope
        in_grpc: dict = {}
        exec(compile("def call(get):\n    return get()\n",
                     os.path.join("x", "site-packages", "grpc", "_channel.py"), "exec"), in_grpc)
        in_grpc["call"](lambda: scope._raise_or_defer(sys._getframe()))  # no raise in there
        _wait_for_interrupt(0.5)  # nothing arrives asynchronously
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()
        scope.open = False
        interrupts._active = None
    finally:
        signal.signal(signal.SIGINT, previous)
