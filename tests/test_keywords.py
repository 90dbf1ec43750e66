"""The estimators' constructor keywords (sparktrain.options.keywords), without Spark: the
signature users see, the Params behind it, and what an unknown keyword does."""
import inspect

import pytest

from sparktrain import KerasEstimator, TorchEstimator


@pytest.mark.parametrize("cls", [TorchEstimator, KerasEstimator])
def test_every_keyword_is_an_explicit_keyword_only_param(cls):
    parameters = inspect.signature(cls).parameters
    assert len(parameters) > 50
    for name, parameter in parameters.items():
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
        assert parameter.annotation is not inspect.Parameter.empty, name
        assert cls().hasParam(name), f"{cls.__name__}({name}=...) sets no Param"
    assert "batch_size: Optional[int] = None" in str(inspect.signature(cls))


def test_own_keywords_stay_with_their_framework():
    torch_keywords = inspect.signature(TorchEstimator).parameters
    keras_keywords = inspect.signature(KerasEstimator).parameters
    assert "fsdp_wrap" in torch_keywords and "fsdp_wrap" not in keras_keywords
    assert "num_ps" in keras_keywords and "num_ps" not in torch_keywords


def test_keywords_set_params_and_unknown_or_positional_ones_are_refused():
    est = TorchEstimator(num_proc=2, batch_size=8, fsdp_wrap=None)
    assert est.getNumProc() == 2 and est.getBatchSize() == 8
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_ps'"):
        TorchEstimator(num_ps=1)
    with pytest.raises(TypeError, match="forces keyword arguments"):
        KerasEstimator(2)
