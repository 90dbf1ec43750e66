"""sparktrain on a Spark Connect session: a real Connect server (its own JVM, local[2]) and
clients in their own processes, as a notebook or a laptop would use it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.interrupts import check_interrupts, run_interrupts
from support.servers import connect_log_tail

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLIENT = os.path.join(HERE, "support", "connect_client.py")

pytest.importorskip("pyspark.sql.connect.client", reason="needs pyspark[connect] (Spark 4)")
pytest.importorskip("grpc_status", reason="needs pyspark[connect]: grpcio-status")


def run_client(scenario: str, server, workdir, timeout: int = 540):
    """The scenario's findings and stderr, run against ``server`` (the worker's shared
    ``connect_server``, tests/support/servers.py); a client that hangs dumps its threads' stacks
    (connect_client.HANG_SECONDS), which the failure shows with the server's log."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    result = subprocess.run([sys.executable, CLIENT, scenario, server.url, str(workdir)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-12000:] + \
        connect_log_tail(server)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.full
def test_readme_flow_over_connect(connect_server, tmp_path):
    found, stderr = run_client("readme", connect_server, tmp_path)
    print(found)
    assert found["torch_accuracy"] >= 0.9, found
    assert found["reloaded_is_torch_model"]
    assert found["reloaded_accuracy"] == found["torch_accuracy"]
    assert found["estimator_reloaded"] == [True, 8, True]
    assert found["bare_model_accuracy"] >= 0.9
    assert len(found["history"]["val_loss"]) == 8
    low, high = found["cv_metrics"]
    assert high < low, found["cv_metrics"]  # more epochs, lower RMSE
    assert found["keras_accuracy"] >= 0.9, found
    assert found["keras_reloaded_accuracy"] == found["keras_accuracy"]
    # progress and rank logs reached the client through the store
    assert "[rank 0] epoch 8/8" in stderr
    assert "\r" not in stderr  # stderr is a pipe: progress is lines, not a redrawn bar


@pytest.mark.full
def test_faults_over_connect_without_executors_reaching_the_client(connect_server, tmp_path):
    found, stderr = run_client("faults", connect_server, tmp_path)
    print(found)
    assert found["listening"] == [], "the client opened a listening socket"
    assert found["killed"], "the fault was not injected"
    history = found["resumed_history"]
    assert len(history) == 4 and history[-1] < history[0]
    assert "failed on attempt 1 of 3" in stderr  # the retry was announced, live
    assert found["resumed_by_run_id"] == 3 and "resuming from it" in stderr
    assert 1 <= found["max_time_epochs"] < 50 and found["max_time_warning"]
    user = found["user_error"]
    assert user["rank"] == 1 and user["attempts"] == 1
    assert "ValueError: user error on rank one, over Spark Connect" in user["message"]
    assert "Traceback from rank 1" in user["message"]
    slots = found["slots"]
    assert "num_proc=3 needs 3 task slots" in slots["message"]
    assert "the cluster has 2" in slots["message"] and "local[3]" in slots["message"]
    assert slots["seconds"] < 10
    assert found["elastic_num_proc"] == [2, 2]
    tfos = found["tfos"]
    assert "backend='tensorflow'" in tfos["message"] and "Spark Connect" in tfos["message"]
    assert tfos["seconds"] < 10
    assert found["interrupted_after"] < 60
    assert found["after_interrupt"] == 1 and found["after_interrupt_seconds"] < 120


@pytest.mark.full
@pytest.mark.parametrize("framework,points", [("torch", 6), ("keras", 1)])
def test_interrupts_over_connect(connect_server, tmp_path, framework, points):
    """Ctrl-C over Connect at each point of a fit, in a finalizer and during a prediction
    (tests/support/interrupts.py says what is checked)."""
    pytest.importorskip(framework)
    check_interrupts(run_interrupts(connect_server.url, tmp_path, framework), points)


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
def test_more_engines_over_connect(connect_server, tmp_path, scenario, module, epochs, more):
    pytest.importorskip(module)
    found, _ = run_client(scenario, connect_server, tmp_path)
    history = found["history"]
    assert len(history) == epochs and history[-1] < history[0]
    assert {key: found[key] for key in more} == more, found
    if scenario == "stream":  # a feed whose slot another job took fails, saying why, at once
        failed = found["no_slot"]
        assert "got no task slot in 10s" in (failed["message"] or ""), failed
        assert "a Spark Connect client cannot see them" in failed["message"], failed
        assert "not retried" in failed["message"] and failed["seconds"] < 60, failed


@pytest.mark.full
def test_a_model_over_the_message_cap_fits_predicts_saves_and_loads_over_connect(connect_server,
                                                                                tmp_path):
    """Connect caps a message at 128 MiB: the weights must travel by file, not in the plan."""
    found, _ = run_client("big_model", connect_server, tmp_path)
    print({k: v for k, v in found.items() if not isinstance(v, list) or k.endswith("history")})
    assert found["model_mib"] > 128
    assert found["history"][-1] < found["history"][0]
    assert found["mse"] < 0.5 * found["label_var"]
    assert found["reloaded"] == found["first"] and len(found["first"]) == 40
    assert len(found["pipeline"]) == 40
    assert found["keras_mib"] > 128 and len(found["keras_history"]) == 2
    assert found["keras_reloaded"] == found["keras_first"] and len(found["keras_first"]) == 40
