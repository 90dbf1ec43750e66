"""Value converters of sparktrain's options: each checks one value and says what was expected
(the ``typeConverter`` of the option's ``pyspark.ml.param.Param``), so a bad value fails when
it is set, before any fit.

Plain Python, no ``pyspark.ml``: the declarations that name them are read on the ranks too.
The basic ones (:func:`to_int`, :func:`to_bool`, ...) accept what ``pyspark.ml.param.
TypeConverters`` accepts, with the same messages, and any NumPy number (pyspark's refuse
``float32`` and ``int32``). The others word their errors one way, ``<option> must be ...,
got <value>``: a ``TypeError`` for a value of the wrong kind (pyspark prefixes it with
``Invalid param value given for param "<option>".``), a ``ValueError`` for one out of range.

Example::

    to_count("epochs", 1)(0)        # ValueError: epochs must be an integer >= 1, got 0
    to_shapes("input_shapes")([[-1, 1, 8, 8]])     # [[-1, 1, 8, 8]]
    to_shapes("input_shapes")([-1, 8])             # TypeError: ... wrap it as [[-1, 8]]
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence

from sparktrain.options.horovod import compression_name
from sparktrain.plugins import load

MIXED_PRECISION = ("bf16", "fp16")
READER_POOL_TYPES = ("thread", "process", "dummy")
MP_START_METHODS = ("fork", "spawn", "forkserver")
#: ``elastic_batch`` values (:mod:`sparktrain.launch.elastic`)
BATCH_RULES = ("global", "rank")
#: ``lr_scheduler_interval`` values: when ``lr_scheduler`` steps
INTERVALS = ("step", "epoch")
#: ``input_mode`` values: how the rows reach the ranks
INPUT_MODES = ("store", "stream")
# The strategy registries, named (not imported): the registry module sits in a higher layer
# and the converters run only on the driver (sparktrain.plugins).
_TORCH_STRATEGIES = "sparktrain.strategies:TORCH_STRATEGIES"
_KERAS_STRATEGIES = "sparktrain.strategies:KERAS_STRATEGIES"


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def to_int(value: Any) -> int:
    """An int (or an integral float/NumPy number); bools are refused."""
    if _is_number(value) and float(value).is_integer():
        return int(value)
    raise TypeError(f"Could not convert {value} to int")


def to_float(value: Any) -> float:
    """A float from any real number but a bool."""
    if _is_number(value):
        return float(value)
    raise TypeError(f"Could not convert {value} to float")


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"Boolean Param requires value of type bool. Found {type(value)}.")


def to_string(value: Any) -> str:
    if isinstance(value, str):  # numpy.str_ too
        return str(value)
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"Could not convert {type(value)} to string type")


def _to_list(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple, range)) or type(value).__name__ == "ndarray":
        return list(value)
    raise TypeError(f"Could not convert {value} to list")


def to_list_string(value: Any) -> List[str]:
    """A list of strings (from a list, tuple or array of them)."""
    items = _to_list(value)
    if all(isinstance(v, (str, bytes)) for v in items):
        return [to_string(v) for v in items]
    raise TypeError(f"Could not convert {value} to list of strings")


def to_list_float(value: Any) -> List[float]:
    items = _to_list(value)
    if all(_is_number(v) for v in items):
        return [float(v) for v in items]
    raise TypeError(f"Could not convert {value} to list of floats")


def to_strategy(value: Any) -> str:
    """A registered torch strategy (see :mod:`sparktrain.strategies`)."""
    TORCH_STRATEGIES, KERAS_STRATEGIES = load(_TORCH_STRATEGIES), load(_KERAS_STRATEGIES)
    value = to_string(value)
    if value not in TORCH_STRATEGIES:
        hint = f" ({value!r} is a KerasEstimator strategy; TorchEstimator replicates the " \
               f"model with 'ddp' or shards parameters and optimizer state across ranks " \
               f"with 'fsdp')" if value in KERAS_STRATEGIES else ""
        raise ValueError(f"strategy must be one of {sorted(TORCH_STRATEGIES)}, got "
                         f"{value!r}{hint}; register your own with "
                         f"sparktrain.strategies.register_torch_strategy")
    return value


def to_module_classes(name: str, allow: type) -> Callable[[Any], Any]:
    """Converter for params taking module classes (or one ``allow``-typed value instead)."""
    def convert(value: Any) -> Any:
        if value is None or (isinstance(value, allow)
                             and (allow is bool or not isinstance(value, bool))):
            if allow is int and isinstance(value, int) and value < 1:
                raise ValueError(f"{name} must be a minimum parameter count >= 1 or a list of "
                                 f"torch.nn.Module subclasses, got {value}")
            return value
        items = list(value) if isinstance(value, (list, tuple, set)) else [value]
        if not items or not all(isinstance(c, type) for c in items):
            kinds = "True, " if allow is bool else "a minimum parameter count, "
            raise TypeError(f"{name} must be {kinds}or a list of torch.nn.Module subclasses "
                            f"(e.g. [TransformerBlock]), got {value!r}")
        return items
    return convert


def to_validation(value: Any) -> Any:
    """``validation`` is a fraction in [0, 1) or the name of a boolean column."""
    if value is None or isinstance(value, str):
        return value
    expected = "validation must be a fraction in [0, 1) or the name of a boolean column"
    if not _is_number(value):
        raise TypeError(f"{expected}, got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{expected}, got {value!r}")
    return float(value)


def to_optional_bool(value: Any) -> Optional[bool]:
    """``None`` (the default decides) or a bool."""
    return None if value is None else to_bool(value)


def to_resource_profile(value: Any) -> Any:
    """``None`` or a ``pyspark.resource.ResourceProfile``."""
    from pyspark.resource import ResourceProfile

    if value is not None and not isinstance(value, ResourceProfile):
        raise TypeError(f"resource_profile must be a pyspark.resource.ResourceProfile (from "
                        f"ResourceProfileBuilder().require(...).build), got "
                        f"{type(value).__name__}")
    return value


def to_mixed_precision(value: Any) -> Optional[str]:
    """``None`` (off) or one of :data:`MIXED_PRECISION`."""
    if value is None:
        return None
    if value not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got {value!r}")
    return value


def to_backend_name(value: Any) -> str:
    """``backend`` names the engine; Horovod's ``Backend`` objects have no place here."""
    if isinstance(value, str):
        return value
    ranks = getattr(value, "num_processes", None)
    hint = ""
    if callable(ranks):
        try:
            hint = f" (num_proc={int(ranks())} for this one)"
        except Exception:  # noqa: BLE001 - only a hint
            hint = ""
    raise TypeError(f"backend must be the name of the distributed engine ('torch' or "
                    f"'horovod' for TorchEstimator, 'tensorflow' or 'tfos' for "
                    f"KerasEstimator), got a {type(value).__name__} object. Horovod's Backend "
                    f"objects are not used: ranks are Spark barrier tasks, set their number "
                    f"with num_proc=N{hint}")


def to_shapes(name: str) -> Any:
    """Converter for ``name`` (``input_shapes``, ``label_shapes``): one shape per column."""
    def convert(value: Any) -> List[List[int]]:
        example = "[[-1, 1, 8, 8]]" if name == "input_shapes" else "[[-1]]"
        expected = (f"{name} must be a list with one shape per column, each a list of ints "
                    f"(-1 for the batch dimension), e.g. {example}")
        if not isinstance(value, (list, tuple)) or not value:
            raise TypeError(f"{expected}, got {value!r}")
        if all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            raise TypeError(f"{expected}, got the single shape {list(value)!r}: wrap it as "
                            f"[{list(value)!r}]")
        shapes = []
        for shape in value:
            if not isinstance(shape, (list, tuple)) or not shape or \
                    not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise TypeError(f"{expected}, got {value!r}")
            if any(d == 0 or d < -1 for d in shape) or list(shape).count(-1) > 1:
                raise TypeError(f"{expected}, got {list(shape)!r} (dimensions are >= 1, and at "
                                f"most one is -1)")
            shapes.append([int(d) for d in shape])
        return shapes
    return convert


def to_loss_weights(value: Any) -> List[float]:
    """One number per label column."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise TypeError(f"loss_weights must be a list with one number per label column, e.g. "
                        f"[1.0, 0.5], got the single number {value!r}")
    try:
        weights = to_list_float(value)
    except TypeError:
        raise TypeError(f"loss_weights must be a list with one number per label column, e.g. "
                        f"[1.0, 0.5], got {value!r}") from None
    return weights


class EnvVars(dict):
    """``backend_env``'s value: a plain dict whose ``repr`` hides the values (they may be
    tokens), so that param dumps (``explainParams``, MLflow's ``pyspark.ml`` autologging, which
    logs ``str(value)`` of every param) never show them."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: '***'" for k in self) + "}"

    __str__ = __repr__


def to_env(value: Any) -> Dict[str, str]:
    """Environment variables (name -> str or number) as :class:`EnvVars`."""
    if not isinstance(value, dict):
        raise TypeError(f"backend_env must be a dict of environment variables (name -> value), "
                        f"got {type(value).__name__}")
    env = EnvVars()
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or \
                not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise TypeError(f"backend_env must map variable names (str, no '=') to str or "
                            f"number values, got {key!r}: {item!r}")
        env[key] = str(item)
    return env


def to_choice(name: str, choices: Sequence[str]) -> Any:
    """Converter for ``name``, whose value is one of ``choices``."""
    def convert(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value
    return convert


def to_count(name: str, minimum: int = 0, optional: bool = False) -> Any:
    """Converter for ``name``, an integer >= ``minimum`` (an integral float or NumPy integer
    too); ``None`` is a value only when ``optional``, refused otherwise even where pyspark
    skips the converter (its ``checks_none``, see :mod:`.params`).

    Example::

        to_count("num_proc", 1)(2.0)            # 2
        to_count("num_proc", 1)(0)     # ValueError: num_proc must be an integer >= 1, got 0
        to_count("val_batch_size", 1, optional=True)(None)   # None
    """
    expected = f"{name} must be {'None or ' if optional else ''}an integer >= {minimum}"

    def convert(value: Any) -> Optional[int]:
        if value is None and optional:
            return None
        if not (_is_number(value) and float(value).is_integer()):
            raise TypeError(f"{expected}, got {value!r}")
        if value < minimum:
            raise ValueError(f"{expected}, got {int(value)}")
        return int(value)
    convert.checks_none = not optional  # type: ignore[attr-defined]
    return convert


def to_seconds(name: str) -> Any:
    """Converter for ``name``: ``None`` or a number of seconds > 0."""
    expected = f"{name} must be None or a number of seconds > 0"

    def convert(value: Any) -> Optional[float]:
        if value is None:
            return None
        if not _is_number(value):
            raise TypeError(f"{expected}, got {value!r}")
        if not value > 0:  # NaN too
            raise ValueError(f"{expected}, got {value!r}")
        return float(value)
    return convert


_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def to_cache_limit(value: Any) -> Optional[float]:
    """``cache_limit``: ``None``, a fraction of the free local disk in ``(0, 1]``, or bytes
    (a number > 1, or a string such as ``"20g"``).

    Example::

        to_cache_limit(0.5)      # 0.5: half the free space
        to_cache_limit("2g")     # 2147483648.0
    """
    expected = ("cache_limit must be None, a fraction of the free local disk in (0, 1], or "
                "a size in bytes (a number > 1, or a string such as '20g')")
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower().rstrip("ib").rstrip("b")
        factor = _SIZE_SUFFIXES.get(text[-1:], 1) if text else 1
        try:
            value = float(text[:-1] if factor > 1 else text) * factor
        except ValueError:
            raise ValueError(f"{expected}, got {value!r}") from None
    if not _is_number(value):
        raise TypeError(f"{expected}, got {value!r}")
    if not value > 0:
        raise ValueError(f"{expected}, got {value!r}")
    return float(value)


def to_function(name: str, contract: str) -> Any:
    """Converter for ``name``: ``None`` or a callable (``contract`` says what it takes and
    returns, for the error)."""
    def convert(value: Any) -> Any:
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a function {contract}, got {type(value).__name__}")
        return value
    return convert


def to_compression(value: Any) -> Any:
    """``gradient_compression``: Horovod's ``Compression.fp16``/``Compression.none``, ``'fp16'``,
    ``'none'`` or ``None``, kept as given (see
    :func:`~sparktrain.options.horovod.compression_name`)."""
    compression_name(value)
    return value


def to_keras_strategy(value: Any) -> str:
    """A registered Keras strategy (see :mod:`sparktrain.strategies`)."""
    TORCH_STRATEGIES, KERAS_STRATEGIES = load(_TORCH_STRATEGIES), load(_KERAS_STRATEGIES)
    value = to_string(value)
    if value not in KERAS_STRATEGIES:
        hint = " (TorchEstimator's strategies; Keras trains data parallel with " \
               "'multi_worker_mirrored')" if value in TORCH_STRATEGIES else ""
        raise ValueError(f"strategy must be one of {sorted(KERAS_STRATEGIES)}, got "
                         f"{value!r}{hint}")
    return value
