"""sparktrain from a Spark Connect client (a real server in its own JVM, clients in their own
processes): what only Connect can break, a client with no SparkContext, py4j or listening
socket whose executors cannot call it back, errors and interrupts over gRPC, models over the
128 MiB message cap, and saving and loading through the server.

Driver logic that classic and Connect sessions share (max_time, the slot refusal, an elastic
start, a resumed run_id) is tested on a classic session (tests/test_fault_tolerance.py,
tests/test_torch_estimator.py, tests/test_keras_estimator.py); here one client process runs
every scenario below in turn (tests/support/connect_client.py), another every interrupt."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from support.connect_runs import PartsRun
from support.interrupts import check_interrupts
from support.servers import connect_log_tail

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "support", "connect_client.py")
INTERRUPTS = os.path.join(HERE, "support", "interrupt_client.py")
PART_S = 540  # one scenario (the client dumps its stacks at 420 s: connect_client.HANG_SECONDS)

pytest.importorskip("pyspark.sql.connect.client", reason="needs pyspark[connect] (Spark 4)")
pytest.importorskip("grpc_status", reason="needs pyspark[connect]: grpcio-status")

from support.connect_client import END_MARK, README_EPOCHS  # noqa: E402 - after the skips
from support.interrupt_client import END_MARK as INTERRUPTS_END_MARK  # noqa: E402

#: the client scenario of each test (test_more_engines_over_connect: its ``scenario`` param)
SCENARIOS = {"test_readme_flow_over_connect": "readme",
             "test_faults_over_connect_without_executors_reaching_the_client": "faults",
             "test_a_model_over_the_message_cap_fits_predicts_saves_and_loads_over_connect":
                 "big_model"}
#: what a scenario needs installed beyond the test extras (its test skips without it)
NEEDS = {"horovod": "horovod.torch", "huggingface": "transformers"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


def _wanted(request, fixture: str, param: str, names: dict) -> list:
    """The parts this run's selected tests of this module ask ``fixture`` for, in their order."""
    wanted = []
    for item in request.session.items:
        if item.module is not request.module or fixture not in item.fixturenames:
            continue
        callspec = getattr(item, "callspec", None)
        name = callspec.params[param] if callspec and param in callspec.params else \
            names.get(item.originalname)
        if name and name not in wanted:
            wanted.append(name)
    return wanted


@pytest.fixture(scope="module")
def connect_client(request, connect_server, tmp_path_factory):
    """One client process running the selected tests' scenarios in turn; ``.part(name)``."""
    names = [n for n in _wanted(request, "connect_client", "scenario", SCENARIOS)
             if _installed(NEEDS.get(n, "torch"))]
    if not names:
        pytest.skip("no scenario to run")
    run = PartsRun([sys.executable, CLIENT, ",".join(names), connect_server.url,
                    str(tmp_path_factory.mktemp("connect"))], "scenario", END_MARK,
                   lambda: connect_log_tail(connect_server))
    yield run
    run.close()


def _scenario(connect_client, name: str):
    """The scenario's findings and stderr; it ran without an error, and the client had no
    listening socket, no JVM, no SparkContext and no py4j gateway meanwhile."""
    found, stderr = connect_client.part(name, PART_S)
    assert "error" not in found, found["error"] + stderr[-6000:]
    client = found["client_side"]
    assert client["listening"] == [], f"the client opened a listening socket: {client}"
    assert not any("java" in child for child in client["children"]), client
    assert not client["spark_context"] and not client["py4j_gateway"], client
    return found, stderr


@pytest.mark.full
def test_readme_flow_over_connect(connect_client):
    found, stderr = _scenario(connect_client, "readme")
    print({k: v for k, v in found.items() if k != "history"})
    assert found["torch_accuracy"] >= 0.9, found
    assert found["reloaded_is_torch_model"]
    assert found["reloaded_accuracy"] == found["torch_accuracy"]
    assert found["estimator_reloaded"] == [True, README_EPOCHS, True]
    assert found["bare_model_accuracy"] >= 0.9
    assert len(found["history"]["val_loss"]) == README_EPOCHS
    low, high = found["cv_metrics"]
    assert high < low, found["cv_metrics"]  # more epochs, lower RMSE
    assert found["keras_accuracy"] >= 0.9, found
    assert found["keras_reloaded_accuracy"] == found["keras_accuracy"]
    # progress and rank logs reached the client through the store
    assert f"[rank 0] epoch {README_EPOCHS}/{README_EPOCHS}" in stderr
    assert "\r" not in stderr  # stderr is a pipe: progress is lines, not a redrawn bar


@pytest.mark.full
def test_faults_over_connect_without_executors_reaching_the_client(connect_client):
    """A killed rank and a rank's error reach the client as gRPC errors and are still told
    apart (retried and resumed, or not); TFoS, which needs a SparkContext, is refused at once.
    (Classic covers max_time, the slot refusal, an elastic start and a resumed run_id; a
    Ctrl-C and the fit after it: test_interrupts_over_connect.)"""
    found, stderr = _scenario(connect_client, "faults")
    print(found)
    assert found["killed"], "the fault was not injected"
    history = found["resumed_history"]
    assert len(history) == 4 and history[-1] < history[0]
    assert "failed on attempt 1 of 3" in stderr  # the retry was announced, live
    user = found["user_error"]
    assert user["rank"] == 1 and user["attempts"] == 1
    assert "ValueError: user error on rank one, over Spark Connect" in user["message"]
    assert "Traceback from rank 1" in user["message"]
    tfos = found["tfos"]
    assert "backend='tensorflow'" in tfos["message"] and "Spark Connect" in tfos["message"]
    assert tfos["seconds"] < 10


@pytest.mark.full
@pytest.mark.parametrize("scenario,module,epochs,more", [
    ("horovod", "horovod.torch", 3, {}),
    # a Hugging Face model as it is; a causal LM's generation in transform, saved and loaded,
    # and answers typed by a responseSchema
    ("huggingface", "transformers", 2, {"predicted": 50, "width": 2, "generated_exact": 20,
                                        "generated_reloaded": True, "schema_parsed": 6,
                                        "schema_types": [["ok", "boolean"], ["n", "tinyint"]]}),
    # input_mode="stream": the barrier stage takes the rows, no dataset in the store
    ("stream", "torch", 3, {"datasets": 0, "predicted": 1000}),
], ids=["horovod", "huggingface", "stream"])
def test_more_engines_over_connect(connect_client, scenario, module, epochs, more):
    pytest.importorskip(module)
    found, _ = _scenario(connect_client, scenario)
    history = found["history"]
    assert len(history) == epochs and history[-1] < history[0]
    assert {key: found[key] for key in more} == more, found
    if scenario == "stream":  # a feed whose slot another job took fails, saying why, at once
        failed = found["no_slot"]
        assert "got no task slot in 10s" in (failed["message"] or ""), failed
        assert "a Spark Connect client cannot see them" in failed["message"], failed
        assert "not retried" in failed["message"] and failed["seconds"] < 60, failed


@pytest.mark.full
def test_a_model_over_the_message_cap_fits_predicts_saves_and_loads_over_connect(
        connect_client):
    """Connect caps a message at 128 MiB: the weights must travel by file, not in the plan."""
    found, _ = _scenario(connect_client, "big_model")
    print({k: v for k, v in found.items() if not isinstance(v, list) or k.endswith("history")})
    assert found["model_mib"] > 128
    assert found["history"][-1] < found["history"][0]
    assert found["mse"] < 0.5 * found["label_var"]
    assert found["reloaded"] == found["first"] and len(found["first"]) == 40
    assert len(found["pipeline"]) == 40
    assert found["keras_mib"] > 128 and len(found["keras_history"]) == 2
    assert found["keras_reloaded"] == found["keras_first"] and len(found["keras_first"]) == 40


@pytest.fixture(scope="module")
def connect_interrupts(request, connect_server, tmp_path_factory):
    """One client process interrupting the selected frameworks' fits in turn (last in this
    module: it runs alone, as its timings want)."""
    names = [n for n in _wanted(request, "connect_interrupts", "framework", {})
             if _installed(n)]
    if not names:
        pytest.skip("no framework to interrupt")
    run = PartsRun([sys.executable, INTERRUPTS, connect_server.url,
                    str(tmp_path_factory.mktemp("interrupts")), ",".join(names)],
                   "framework", INTERRUPTS_END_MARK, lambda: connect_log_tail(connect_server))
    yield run
    run.close()


@pytest.mark.full
@pytest.mark.parametrize("framework,points", [("torch", 6), ("keras", 1)])
def test_interrupts_over_connect(connect_interrupts, framework, points):
    """Ctrl-C over Connect at each point of a fit, in a finalizer and during a prediction
    (tests/support/interrupts.py says what is checked)."""
    pytest.importorskip(framework)
    found, _ = connect_interrupts.part(framework, PART_S)
    check_interrupts(found, points)
