"""An epoch's batches from any rank reader (a store shard or streamed rows): ``steps`` of them
across passes, from batch ``skip`` on (a resumed epoch).

Example::

    for batch in take_steps(reader, epoch=2, steps=None, skip=40):   # batches 40.. of epoch 3
        ...
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, Optional

import numpy as np

if TYPE_CHECKING:
    from sparktrain.data.sources.contract import RowReader

Batch = Dict[str, np.ndarray]


def take_steps(reader: "RowReader", epoch: int, steps: Optional[int], skip: int = 0,
               order: Optional[str] = None, trained: Optional[bytes] = None
               ) -> Iterator[Batch]:
    """``steps`` batches of ``reader`` for ``epoch`` (one whole pass when ``None``); more steps
    than a pass has continue into further passes, each shuffled afresh (Horovod's
    ``train_steps_per_epoch``). ``skip``: the first ``skip`` of them left out (an epoch
    resumed inside), the rest as they would have been; ``order``: the resumed epoch's
    ``reader.order`` (see :meth:`sparktrain.data.reader.ShardReader.epoch`); ``trained``: its
    position (every rank's rows trained before it), for a reader that knows rows by where
    they came from: the epoch is then the rows left, whatever their count (``steps`` unset).

    Example::

        for batch in take_steps(reader, epoch=2, steps=None, skip=40):   # batches 40.. of 2
            ...
    """
    def epoch_of(number: int, skipped: int) -> Iterator[Batch]:
        return reader.epoch(number, skip=skipped, order=order if skipped else None,
                            trained=trained if skipped else None)

    if steps is None:
        yield from epoch_of(epoch, skip)
        return
    per_pass = len(reader)
    done, extra = skip, skip // per_pass
    if done >= steps:
        return
    first = skip - extra * per_pass
    while True:
        batches = epoch_of(epoch + extra * 1_000_003, first)
        first = 0
        try:
            for batch in batches:
                yield batch
                done += 1
                if done == steps:
                    return
        finally:
            close = getattr(batches, "close", None)  # a generator: its reader's files go
            if close is not None:
                close()
        extra += 1
