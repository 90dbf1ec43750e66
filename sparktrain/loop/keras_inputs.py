"""How feature columns reach a Keras model: by name (a dict) or by position (a list).

The rule, in one place for the rank loop (:mod:`.keras_batch`, :mod:`.keras_loop`), the
driver's preflight (``KerasEstimator._check_on_batch``) and ``KerasModel.transform``'s predictor:
when the model's inputs have names and the set of ``feature_cols`` is the set of those names,
the model is called with ``{feature_col: tensor}``; otherwise with one tensor per feature column
in the order of ``feature_cols`` (a list, or the tensor itself for one column), as before.

An input's name is its key for a functional model built with a dict of inputs
(``keras.Model(inputs={"input_ids": ids, "attention_mask": mask}, ...)``), else the ``name`` of
its ``keras.Input`` (``keras.Input((16,), name="input_ids")``). A single input not given as a
dict is fed its tensor directly (the same call either way); a model whose inputs are unknown (a
subclassed model) is fed by position. Leaf module: Keras is never imported here.

Example::

    ids = keras.Input((16,), name="input_ids", dtype="int32")
    mask = keras.Input((16,), name="attention_mask", dtype="int32")
    net = keras.Model({"input_ids": ids, "attention_mask": mask}, ...)
    keras_inputs(net, ["attention_mask", "input_ids"], [m, i])
    # -> {"attention_mask": m, "input_ids": i}
    keras_inputs(net, ["mask", "ids"], [m, i])   # -> [m, i]: names differ, fed by position
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, TypeVar, Union, cast

T = TypeVar("T")


def _inputs(model: Any) -> Optional[List[Any]]:
    """The model's flat input tensors, ``None`` when unknown."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # subclassed, never built
        return None
    return list(inputs) if inputs else None


def _as_given(model: Any) -> Any:
    """The model's inputs in the structure it was built with (a functional model's
    ``model.input``: a dict, a list or a tensor); ``None`` when it has none."""
    try:
        return model.input
    except (AttributeError, ValueError):  # a Sequential or subclassed model never called
        return None


def input_names(model: Any) -> Optional[List[str]]:
    """The names of the model's inputs, in the order of ``model.inputs``: the dict's keys for a
    model built with a dict of inputs, else the inputs' ``name``; ``None`` when unknown."""
    inputs = _inputs(model)
    if inputs is None:
        return None
    struct = _as_given(model)
    if isinstance(struct, dict):
        key_of = {id(tensor): key for key, tensor in struct.items()}
        names = [key_of.get(id(tensor)) for tensor in inputs]
        # nested: unknown; the cast only narrows the list checked to hold str
        return cast(List[str], names) if all(isinstance(n, str) for n in names) else None
    names = [getattr(tensor, "name", None) for tensor in inputs]
    return cast(List[str], names) if all(isinstance(n, str) for n in names) else None


def fed_by_name(model: Any, feature_cols: Sequence[str]) -> bool:
    """Whether ``model`` takes its features as a dict keyed by column (see the module)."""
    names = input_names(model)
    if names is None or len(names) != len(feature_cols) or set(names) != set(feature_cols):
        return False
    return len(names) > 1 or isinstance(_as_given(model), dict)


def in_feature_order(model: Any, feature_cols: Sequence[str], per_input: List[T]) -> List[T]:
    """``per_input`` (one item per ``model.inputs``, say their shapes) in the order of
    ``feature_cols`` when the model takes them by name; as given otherwise."""
    if not fed_by_name(model, feature_cols):
        return per_input
    names = input_names(model) or []
    by_name = dict(zip(names, per_input, strict=True))
    return [by_name[c] for c in feature_cols]


def keras_inputs(model: Any, feature_cols: Sequence[str],
                 arrays: Sequence[T]) -> Union[Dict[str, T], List[T], T]:
    """What to call ``model`` with for ``arrays`` (one per feature column, in the order of
    ``feature_cols``): ``{column: array}`` when the model takes them by name, else the list,
    or the array itself for one column."""
    if fed_by_name(model, feature_cols):
        return dict(zip(feature_cols, arrays, strict=True))
    return list(arrays) if len(arrays) > 1 else arrays[0]
