"""The estimators' constructor keywords, listed once.

``TorchEstimator`` and ``KerasEstimator`` take the same ~50 keyword params (their
:class:`~sparktrain.options.params.EstimatorParams`, plus ``strategy``) and a few of their own. The
shared ones are the ``TypedDict`` :class:`EstimatorKeywords`; each framework's adds its own
keys to it, and :func:`keyword_params` makes the constructor's signature from that:

* ``help()``, ``inspect.signature`` and Jupyter show every keyword with its type, default
  ``None`` (not set), as an explicit ``def __init__(self, *, num_proc=None, ...)`` did;
* type checkers and IDEs read the constructor's ``**params: Unpack[TorchKeywords]`` (PEP 692);
* an unknown keyword is a ``TypeError``, as with an explicit signature (Params alone would
  accept any Param's name).

Example::

    class TorchKeywords(EstimatorKeywords, total=False):
        input_shapes: Optional[List[List[int]]]

    class TorchEstimator(EstimatorBase, TorchParams):
        @keyword_params(TorchKeywords)
        def __init__(self, **params: Unpack[TorchKeywords]) -> None:
            ...                        # self._input_kwargs: the keywords given
"""
# no ``from __future__ import annotations``: the keys' types are read at run time
import functools
import inspect
import typing
from typing import Any, Callable, Dict, List, Optional, TypedDict, TypeVar

from pyspark import keyword_only

F = TypeVar("F", bound=Callable[..., Any])


class EstimatorKeywords(TypedDict, total=False):
    """The keyword params every estimator takes; each is documented by its Param
    (``sparktrain.options.params``) and the estimator's docstring."""

    num_proc: Optional[int]
    model: Any
    optimizer: Any
    loss: Any
    metrics: Optional[List[Any]]
    feature_cols: Optional[List[str]]
    label_cols: Optional[List[str]]
    sample_weight_col: Optional[str]
    validation: Any
    batch_size: Optional[int]
    val_batch_size: Optional[int]
    epochs: Optional[int]
    shuffle: Optional[bool]
    random_seed: Optional[int]
    store: Any
    run_id: Optional[str]
    verbose: Optional[int]
    callbacks: Optional[List[Any]]
    backend: Optional[str]
    use_gpu: Optional[bool]
    train_steps_per_epoch: Optional[int]
    validation_steps_per_epoch: Optional[int]
    transformation_fn: Optional[Callable]
    predict_transformation_fn: Optional[Callable]
    inmemory_cache_all: Optional[bool]
    backward_passes_per_step: Optional[int]
    scale_learning_rate: Optional[bool]
    mixed_precision: Optional[str]
    max_time: Optional[float]
    max_attempts: Optional[int]
    min_num_proc: Optional[int]
    elastic_batch: Optional[str]
    label_shapes: Optional[List[List[int]]]
    loss_weights: Optional[List[float]]
    gradient_compression: Any
    backend_env: Optional[Dict[str, str]]
    train_reader_num_workers: Optional[int]
    val_reader_num_workers: Optional[int]
    reader_pool_type: Optional[str]
    shuffle_buffer_size: Optional[int]
    partitions_per_process: Optional[int]
    mp_start_method: Optional[str]
    data_module: Any
    continuous_cols: Optional[List[str]]
    categorical_cols: Optional[List[str]]
    compress_sparse_cols: Optional[bool]
    transformation_edit_fields: Any
    transformation_removed_fields: Any
    strategy: Optional[str]
    mlflow_logging: Optional[bool]


def keyword_params(keywords: type) -> Callable[[F], F]:
    """``pyspark.keyword_only`` for a constructor ``(self, **params)`` whose keywords are the
    keys of the ``TypedDict`` ``keywords``, each defaulting to ``None`` (see the module)."""
    hints = typing.get_type_hints(keywords)  # resolves a subclass's postponed annotations
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hint)
           for name, hint in hints.items()], return_annotation=None)

    def decorate(method: F) -> F:
        checked = keyword_only(method)  # sets self._input_kwargs; refuses positional args

        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            unknown = [name for name in kwargs if name not in hints]
            if unknown:
                raise TypeError(f"{method.__qualname__}() got an unexpected keyword argument "
                                f"{unknown[0]!r}")
            return checked(self, *args, **kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]
    return decorate
