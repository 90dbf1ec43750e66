"""Options declared once (sparktrain.options): what each declaration makes, without Spark."""
import dataclasses
import inspect
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from pyspark.ml.param import TypeConverters

from sparktrain import KerasEstimator, KerasModel, TorchEstimator, TorchModel
from sparktrain.options import converters, docs
from sparktrain.options.declarations import COMMON, KERAS, MODEL, TORCH, TORCH_MODEL
from sparktrain.options.params import OBJECT_PARAMS, camel
from sparktrain.options.spec import KerasTrainSpec, TorchTrainSpec

USAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "usage.md"


def test_docs_table_is_current():
    text = USAGE.read_text()
    assert docs.replace_section(text) == text, \
        "docs/usage.md is stale: run python -m sparktrain.options.docs docs/usage.md"


@pytest.mark.parametrize("cls, groups", [(TorchEstimator, (COMMON, TORCH)),
                                         (KerasEstimator, (COMMON, KERAS)),
                                         (TorchModel, (MODEL, TORCH_MODEL)),
                                         (KerasModel, (MODEL,))])
def test_every_declared_option_is_a_param_with_accessors(cls, groups):
    instance = cls()
    for option in (o for group in groups for o in group):
        assert instance.hasParam(option.name), option.name
        assert instance.getParam(option.name).doc == option.doc
        for prefix in ("get", "set"):
            assert callable(getattr(instance, f"{prefix}{camel(option.name)}")), option.name
            if option.horovod_accessor:
                assert callable(getattr(instance, f"{prefix}{option.horovod_accessor}"))
    assert instance.getOrDefault("batch_size") == (1024 if issubclass(cls, (TorchModel, KerasModel))
                                                   else 32)


def test_rank_options_are_spec_fields_and_reach_the_spec():
    torch_fields = {f.name for f in dataclasses.fields(TorchTrainSpec)}
    keras_fields = {f.name for f in dataclasses.fields(KerasTrainSpec)}
    for option in COMMON:
        if option.spec_name:
            assert option.spec_name in torch_fields and option.spec_name in keras_fields
    assert {"strategy", "output_key", "lr_scheduler_interval"} <= torch_fields
    assert "output_key" not in keras_fields and "strategy" in keras_fields
    est = TorchEstimator(feature_cols=["x"], random_seed=7, train_steps_per_epoch=3,
                         backend_env={"TOKEN": "s3cret"}, lr_scheduler_interval="epoch")
    fields = est._spec_fields()
    assert (fields["seed"], fields["train_steps"], fields["val_batch_size"]) == (7, 3, 32)
    assert fields["lr_scheduler_interval"] == "epoch" and fields["backend"] == "torch"
    spec = TorchTrainSpec(**fields, use_gpu=False)
    assert "s3cret" not in repr(spec)  # hidden options stay out of reprs
    assert TorchTrainSpec.from_json(spec.to_json()) == spec


def test_object_params_are_the_python_object_options():
    assert {"model", "optimizer", "transformation_fn", "resource_profile", "lr_scheduler"} \
        <= OBJECT_PARAMS
    assert not {"batch_size", "feature_cols", "backend_env"} & OBJECT_PARAMS


def test_defaults_are_not_shared_between_instances():
    first, second = TorchEstimator(), TorchEstimator()
    first.getMetrics().append("metric")
    assert second.getMetrics() == []


@pytest.mark.parametrize("value", [3, 3.0, np.int64(3), np.float64(3.0), True, 3.5, "3",
                                   np.str_("3"), None])
def test_basic_converters_match_pysparks(value):
    for ours, theirs in ((converters.to_int, TypeConverters.toInt),
                         (converters.to_float, TypeConverters.toFloat),
                         (converters.to_bool, TypeConverters.toBoolean),
                         (converters.to_string, TypeConverters.toString)):
        try:
            expected = theirs(value)
        except TypeError:
            with pytest.raises(TypeError):
                ours(value)
        else:
            assert ours(value) == expected and type(ours(value)) in (int, float, bool, str)


def test_basic_converters_take_any_numpy_number():
    # pyspark's TypeConverters refuse np.float32 and np.int32 (not in their type list)
    assert converters.to_int(np.int32(4)) == 4 and converters.to_float(np.float32(0.5)) == 0.5


def test_list_converters():
    assert converters.to_list_string(("a", np.str_("b"))) == ["a", "b"]
    assert converters.to_list_float(np.array([1, 2])) == [1.0, 2.0]
    for bad in ("ab", [1, "a"], None):
        with pytest.raises(TypeError):
            converters.to_list_string(bad)


# An option added in one place: one row in the declarations' table (a scratch row, in a fresh
# process) makes the keyword, the Param and its accessors, the docs row and the spec field.
SCRATCH_OPTION = """
import inspect, dataclasses, typing
from sparktrain.options import declarations as d
from sparktrain.options.converters import to_count
d.TORCH = d.TORCH + (d.Option("warmup_steps", "optimizer steps of learning-rate warm-up", 0,
                              to_count("warmup_steps"), typing.Optional[int], rank=True),)
from sparktrain import TorchEstimator, KerasEstimator
from sparktrain.options.spec import TorchTrainSpec, KerasTrainSpec
from sparktrain.options.docs import options_markdown
signature = inspect.signature(TorchEstimator)
assert str(signature.parameters["warmup_steps"]) == "warmup_steps: Optional[int] = None"
assert "warmup_steps" not in inspect.signature(KerasEstimator).parameters
est = TorchEstimator(feature_cols=["x"], warmup_steps=5)
assert est.getWarmupSteps() == 5 and est.setWarmupSteps(6).getWarmupSteps() == 6
assert TorchEstimator().getWarmupSteps() == 0
try:
    est.setWarmupSteps(-1)
except ValueError as error:
    assert "warmup_steps must be an integer >= 0, got -1" in str(error)
else:
    raise AssertionError("the converter did not run")
assert "| `warmup_steps` | yes |  | `0` | `spec.warmup_steps` |" in options_markdown()
assert "warmup_steps" in {f.name for f in dataclasses.fields(TorchTrainSpec)}
assert "warmup_steps" not in {f.name for f in dataclasses.fields(KerasTrainSpec)}
assert est._train_spec().warmup_steps == 6
print("ok")
"""


def test_an_option_declared_once_is_everywhere():
    result = subprocess.run([sys.executable, "-c", SCRATCH_OPTION], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_keyword_signature_lists_the_declared_options_in_order():
    names = list(inspect.signature(TorchEstimator).parameters)
    assert names == [o.name for o in COMMON + TORCH]
