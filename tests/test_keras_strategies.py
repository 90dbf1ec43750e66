"""Keras strategies without Spark or TensorFlow: the registry, driver-side checks, task roles,
TF_CONFIG, the spec's JSON round trip, and a strategy of the user's own (seconds)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from sparktrain.launch.tf_multiworker import TFTask, cluster_config, tf_config
from sparktrain.options.spec import KerasTrainSpec, RowsPlan
from sparktrain.strategies import KERAS_STRATEGIES, load_strategy, register_keras_strategy
from sparktrain.strategies.keras_mirrored import MultiWorkerMirrored
from sparktrain.strategies.keras_ps import ParameterServer, task_role
from sparktrain.strategies.keras_strategy import KerasStrategy


def _spec(**changes) -> KerasTrainSpec:
    spec = KerasTrainSpec(rows=RowsPlan(root="/tmp/d", layouts={"train": [["a.parquet", 10]]}),
                          columns=[{"name": "x"}], feature_cols=["x"], label_cols=["y"],
                          sample_weight_col=None, batch_size=8, val_batch_size=8, epochs=2,
                          shuffle=True, seed=1, verbose=1, backend="tensorflow",
                          strategy="multi_worker_mirrored")
    return replace(spec, **changes)


def test_registry_resolves_both_strategies():
    assert load_strategy(KERAS_STRATEGIES, "multi_worker_mirrored") is MultiWorkerMirrored
    assert load_strategy(KERAS_STRATEGIES, "parameter_server") is ParameterServer
    assert issubclass(ParameterServer, KerasStrategy)


def test_mirrored_checks():
    assert MultiWorkerMirrored.check("multi_worker_mirrored", "tfos", 2, {"num_ps": None}) == {}
    with pytest.raises(ValueError, match=r"num_ps=1 needs strategy='parameter_server' \(got "
                                         r"strategy='multi_worker_mirrored', which has no "
                                         r"parameter servers\)"):
        MultiWorkerMirrored.check("multi_worker_mirrored", "tensorflow", 2, {"num_ps": 1})


@pytest.mark.parametrize("backend, num_proc, num_ps, message", [
    ("tfos", 3, None, "needs backend='tensorflow', got backend='tfos': TensorFlowOnSpark"),
    ("tensorflow", 2, 1, "at most 0 parameter server"),
    ("tensorflow", 3, 2, "raise num_proc to at least 4"),
])
def test_parameter_server_checks(backend, num_proc, num_ps, message):
    with pytest.raises(ValueError, match=message):
        ParameterServer.check("parameter_server", backend, num_proc, {"num_ps": num_ps})


def test_parameter_server_options_default_to_one_server():
    assert ParameterServer.check("parameter_server", "tensorflow", 3, {"num_ps": None}) == \
        {"num_ps": 1}
    assert ParameterServer.check("parameter_server", "tensorflow", 5, {"num_ps": 2}) == \
        {"num_ps": 2}


def test_roles_and_tf_config():
    assert [task_role(r, 2) for r in range(5)] == \
        [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    ps = ParameterServer(_spec(strategy_options={"num_ps": 1}))
    roles = ps.roles(4)
    addresses = ["h0:1", "h1:2", "h2:3", "h3:4"]
    assert json.loads(cluster_config(addresses, roles, 3)) == {
        "cluster": {"chief": ["h0:1"], "ps": ["h1:2"], "worker": ["h2:3", "h3:4"]},
        "task": {"type": "worker", "index": 1}}
    mirrored = MultiWorkerMirrored(_spec())
    assert cluster_config(addresses[:2], mirrored.roles(2), 1) == tf_config(addresses[:2], 1)
    assert json.loads(tf_config(addresses[:2], 1)) == {
        "cluster": {"worker": ["h0:1", "h1:2"]}, "task": {"type": "worker", "index": 1}}


def test_parameter_server_steps_per_epoch():
    shards = [{"rows": 30}, {"rows": 11}]
    ps = ParameterServer(_spec(strategy_options={"num_ps": 1}, launch_info={"shards": shards}))
    assert ps.steps_per_epoch(reader_steps=99) == 6  # ceil(41 / 8): as many rows as mirrored
    ps = ParameterServer(_spec(train_steps=3, launch_info={"shards": shards}))
    assert ps.steps_per_epoch(99) == 6  # train_steps per worker
    assert MultiWorkerMirrored(_spec()).steps_per_epoch(7) == 7
    assert MultiWorkerMirrored(_spec(train_steps=2)).steps_per_epoch(7) == 2


def test_spec_json_round_trip():
    spec = _spec(strategy_options={"num_ps": 2}, role="ps", launch_info={"shards": [{"rows": 1}]},
                 deadline=12.5, best_model={"monitor": "val_loss"})
    assert KerasTrainSpec.from_json(spec.to_json()) == spec


def test_default_run_task_trains_and_a_user_strategy_registers():
    class Recorded(MultiWorkerMirrored):
        def run_task(self, task):
            return ("mine", super().run_task(task))

    class FakeTask:
        def train(self):
            return {"model": b""}

    register_keras_strategy("recorded", Recorded)
    try:
        assert load_strategy(KERAS_STRATEGIES, "recorded") is Recorded
        assert Recorded(_spec()).run_task(FakeTask()) == ("mine", {"model": b""})
        from sparktrain import KerasEstimator

        assert KerasEstimator(strategy="recorded").getStrategy() == "recorded"
    finally:
        KERAS_STRATEGIES.pop("recorded")
    assert TFTask.train.__doc__


def test_rank_side_modules_import_neither_tensorflow_nor_pyspark_ml():
    code = ("import sys\n"
            "import sparktrain.loop.keras_loop, sparktrain.strategies.keras_ps\n"
            "import sparktrain.strategies.keras_mirrored, sparktrain.launch.tf_parameter_server\n"
            "bad = [m for m in ('tensorflow', 'keras', 'pyspark.ml') if m in sys.modules]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
