"""The estimators' constructor keywords, made from the option declarations.

``TorchEstimator`` and ``KerasEstimator`` take every option of theirs as a keyword
(:data:`~sparktrain.options.declarations.COMMON` plus the framework's own).
:func:`keyword_params` gives the constructor that signature:

* ``help()``, ``inspect.signature`` and Jupyter show every keyword with its type, default
  ``None`` (not set), as an explicit ``def __init__(self, *, num_proc=None, ...)`` would;
* an unknown keyword is a ``TypeError``, as with an explicit signature (Params alone would
  accept any Param's name).

Example::

    class TorchEstimator(EstimatorBase, TorchParams):
        @keyword_params(COMMON + TORCH)
        def __init__(self, **params: Any) -> None:
            ...                        # self._input_kwargs: the keywords given
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence, TypeVar

from pyspark import keyword_only

from sparktrain.options.declarations import Option

F = TypeVar("F", bound=Callable[..., Any])


def keyword_params(options: Sequence[Option]) -> Callable[[F], F]:
    """``pyspark.keyword_only`` for a constructor ``(self, **params)`` whose keywords are the
    names of ``options``, each defaulting to ``None`` and annotated with its ``hint``."""
    hints = {option.name: option.hint for option in options}
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
