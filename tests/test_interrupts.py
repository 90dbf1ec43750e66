"""Ctrl-C (a real SIGINT) at many points of a fit and during a prediction, in a process of its
own (tests/support/interrupt_client.py, checked by tests/support/interrupts.py), on a classic
session; over Spark Connect in test_connect.py.
Each interrupt reaches the caller within seconds, the ranks stop, and a fit with the same
run_id right after takes the run (its lock was released) and resumes from the last
checkpoint."""
from __future__ import annotations

import os
import sys

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
