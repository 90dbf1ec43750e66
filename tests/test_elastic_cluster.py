"""Elastic fits on a real Spark standalone cluster on loopback that gains and loses Workers
(tests/support/elastic_cluster.py, in a process of its own): one run, the findings checked here.
Only this file grows a fit into a machine that joins and shrinks it after a machine is lost for
good (a SIGKILLed Worker and its executor, as Spark's own slot count sees it), for every engine."""
from __future__ import annotations

import math
import os

import pytest

from support.helpers import run_reporting_script
from support.servers import restore

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def found(standalone, tmp_path_factory):
    """One run on the worker's shared cluster (tests/support/servers.py): the script adds and
    kills Workers of its own beside the two it finds, and the cluster is restored after."""
    workdir = str(tmp_path_factory.mktemp("elastic"))
    script = os.path.join(HERE, "support", "elastic_cluster.py")
    argv = [script, workdir, standalone.url, str(standalone.workdir)]
    code = (f"import sys; sys.argv = {argv!r}; __file__ = {script!r}; "
            f"exec(compile(open({script!r}).read(), {script!r}, 'exec'))")
    try:
        result, _ = run_reporting_script(code, timeout=540)
    finally:
        restore(standalone)
    print(result)
    return result


def _sane_across_changes(history):
    """Every epoch after a membership change is about as good as the one before it."""
    loss, ranks = history["loss"], history["num_proc"]
    for epoch in range(1, len(loss)):
        if ranks[epoch] != ranks[epoch - 1]:
            assert loss[epoch] <= 1.5 * loss[epoch - 1], (epoch, history)
    assert all(math.isfinite(v) for v in loss) and loss[-1] < 0.2 * loss[0], history


def test_a_fit_starts_with_the_free_slots_grows_and_survives_a_lost_machine(found):
    ddp = found["ddp"]
    ranks = ddp["history"]["num_proc"]
    assert len(ranks) == 60
    # started on the 2 Workers there were, grew to 3 when the third came, shrank to 2 after
    # its Worker was SIGKILLed: each change at an epoch boundary
    changes = [(a, b) for a, b in zip(ranks, ranks[1:], strict=False) if a != b]
    assert ranks[0] == 2 and changes == [(2, 3), (3, 2)], ranks
    assert [a["ranks"] for a in ddp["attempts"]] == [2, 3, 2], ddp["attempts"]
    _sane_across_changes(ddp["history"])
    # well inside Spark's ~10 minutes of barrier slot checks
    assert ddp["to_next_generation"] < 60 and ddp["to_training"] < 90, ddp
    assert ddp["predicted"] == 20


def test_fewer_slots_than_min_num_proc_fail_fast(found):
    failure = found["too_few"]
    assert "min_num_proc=3 needs 3 task slots" in failure["error"], failure
    assert "the cluster has 2" in failure["error"] and failure["seconds"] < 30, failure


# stream: ddp, rows streamed again
@pytest.mark.parametrize("engine", ["horovod", "fsdp", "keras", "stream"])
def test_each_engine_survives_a_shrink(found, engine):
    outcome = found[engine]
    if "skipped" in outcome:
        pytest.skip(outcome["skipped"])
    assert outcome["history"]["num_proc"] == [3, 2, 2], outcome
    _sane_across_changes(outcome["history"])
    assert outcome["to_training"] < 90 and outcome["predicted"] == 20, outcome


def test_a_shrink_inside_an_epoch_trains_each_of_its_rows_exactly_once(found):
    """Rows shuffled into the training stage, a Worker killed inside epoch 2: the 3 ranks'
    rows before the checkpoint and the 2 ranks' after it are every row, none twice."""
    ids = found["stream"]["ids"]
    assert ids["step"] > 0 and ids["stages"][0] == 3 and ids["stages"][-1] == 2, ids["stages"]
    before, after = set(ids["before"]), set(ids["after"])
    assert len(ids["before"]) == len(before)  # nothing twice before the checkpoint
    assert not before & after and before | after == set(range(3000))
