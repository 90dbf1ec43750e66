"""Columns that ``transformation_fn`` creates, and the DataFrame columns it reads to make them.

``feature_cols`` and ``label_cols`` may name columns the transformation adds (a tokenizer's
``input_ids`` and ``attention_mask``). Which DataFrame columns it needs is learned on the driver
from a few rows, never declared: the transformation runs once on every column it can be given,
recording the ones it looks at, then once without each of those no param names; a column whose
absence still leaves every wanted column produced is not needed. Only the needed columns are
materialized, and the fitted model reads the same ones from the DataFrame it predicts on.

Spark-free: :func:`sparktrain.estimators.preflight.transformation_columns` runs it on a few
rows of the DataFrame.

Example::

    inputs, made = learn_inputs(tokenize, {"text": ..., "id": ..., "label": ...},
                                wanted=["input_ids", "attention_mask", "label"],
                                keep=["label"])
    inputs   # ["text", "label"]: "id" was looked at (dict(batch)) but is not needed
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_keys, dict_values

#: columns looked at beyond which no column is tried without (each try is one call)
MAX_TRIES = 64


class _Reads(dict):
    """A batch that records which of its columns the transformation looks at (copying it,
    iterating it or ``in`` count as looking at every column named)."""

    def __init__(self, batch: Dict[str, Any]) -> None:
        super().__init__(batch)
        self.read: Set[str] = set()

    def _all(self) -> None:
        self.read.update(super().keys())

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        self._all()
        return super().__iter__()

    def keys(self) -> dict_keys[Any, Any]:
        self._all()
        return super().keys()

    def items(self) -> dict_items[Any, Any]:
        self._all()
        return super().items()

    def values(self) -> dict_values[Any, Any]:
        self._all()
        return super().values()

    def copy(self) -> Dict[str, Any]:
        self._all()
        return dict(super().items())


def _makes(fn: Callable, batch: Dict[str, Any], wanted: Sequence[str]) -> bool:
    """True when ``fn(batch)`` returns every wanted column (an error counts as no)."""
    try:
        out = fn(dict(batch))
    except Exception:  # noqa: BLE001 - a column it needs is missing, whatever it raises
        return False
    return isinstance(out, dict) and all(name in out for name in wanted)


def learn_inputs(fn: Callable, sample: Dict[str, Any], wanted: Sequence[str],
                 keep: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """``(inputs, produced)``: the columns of ``sample`` that ``fn`` needs to return every
    ``wanted`` column (``keep``: columns always kept, e.g. labels in the DataFrame), in
    ``sample``'s order, and the columns ``fn`` returned from all of ``sample``.

    Raises what ``fn`` raises on ``sample``, and ``ValueError`` naming the wanted columns
    ``fn`` does not return.
    """
    reads = _Reads(sample)
    out = fn(reads)
    if not isinstance(out, dict):
        raise TypeError(f"transformation_fn must return a dict of numpy arrays by column "
                        f"name, returned {type(out).__name__}")
    produced = list(out)
    missing = [name for name in wanted if name not in out]
    if missing:
        raise ValueError(f"column(s) {missing} are neither in the DataFrame nor produced by "
                         f"transformation_fn, which returned {produced} from the DataFrame's "
                         f"columns {list(sample)}; check feature_cols/label_cols and the "
                         f"transformation's output names")
    kept = set(keep) & set(sample)
    looked_at = [name for name in sample if name in reads.read and name not in kept]
    dropped: Set[str] = set()
    if len(looked_at) <= MAX_TRIES:
        for name in looked_at:
            trial = {k: v for k, v in sample.items() if k not in dropped and k != name}
            if _makes(fn, trial, wanted):
                dropped.add(name)
    inputs = [name for name in sample
              if name in kept or (name in reads.read and name not in dropped)]
    return inputs, produced
