"""A rank's batches on their way to the model: ``transformation_fn``, then the model checks.

Where ``transformation_fn`` runs depends on ``reader_pool``: ``"thread"`` and ``"dummy"`` run it
in the training thread; ``"process"`` in decode worker processes (:mod:`sparktrain.data.
workers`), started once per split and kept for the whole fit. Every batch then goes through
:func:`sparktrain.data.batch.model_ready`: what reaches the model is numeric, one shape per
column, or the fit fails on the first batch naming the column (not retried: the user's code
or data are wrong, see :mod:`sparktrain.faults`).

Example (rank side)::

    feed = BatchFeed(transform, ["image", "label"], reader_pool="process",
                     workers={"train": 2, "val": 1}, seed=7)
    try:
        for batch in feed(take_steps(reader, epoch, None), "train", epoch):
            ...
    finally:
        feed.close()
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence

from sparktrain.data.batch import Batch, model_ready
from sparktrain.faults import mark_user_error, user_code
from sparktrain.options.spec import LoopSpec

#: decoded bytes the queue between decode workers and the training loop may hold, per split
DECODE_QUEUE_BYTES = 256 << 20


class BatchFeed:
    """``transformation_fn`` and the model-input checks for one rank (see the module)."""

    def __init__(self, transform: Optional[Callable[[Batch], Batch]], names: Sequence[str],
                 reader_pool: str = "thread", workers: Optional[Dict[str, int]] = None,
                 seed: Optional[int] = None, start_method: Optional[str] = None,
                 queue_bytes: int = DECODE_QUEUE_BYTES) -> None:
        self.transform = transform
        self.names = list(names)
        self.processes = reader_pool == "process" and transform is not None
        self.workers = dict(workers or {})
        self.seed = seed
        self.start_method = start_method
        self.queue_bytes = queue_bytes
        self._pools: Dict[str, Any] = {}

    @classmethod
    def for_spec(cls, spec: LoopSpec, transform: Optional[Callable[[Batch], Batch]]
                 ) -> "BatchFeed":
        """The feed of ``spec``'s fit: its model columns, reader pool and decode workers."""
        return cls(transform, spec.model_columns(), spec.reader_pool,
                   {"train": spec.train_decode_workers, "val": spec.val_decode_workers},
                   spec.seed, spec.mp_start_method)

    def __call__(self, batches: Iterable[Batch], split: str = "train",
                 epoch: int = 0) -> Iterator[Batch]:
        transformed = self.transform is not None
        for batch in self._transformed(batches, split, epoch):
            with user_code("transformation_fn's output"):
                batch = model_ready(batch, self.names, transformed)
            yield batch

    def _transformed(self, batches: Iterable[Batch], split: str, epoch: int) -> Iterator[Batch]:
        if self.transform is None:
            yield from batches
        elif not self.processes:
            for batch in batches:
                with user_code("transformation_fn"):
                    result = self.transform(batch)
                yield result
        else:
            yield from self._decoded(self._pool(split).map(batches, epoch))

    @staticmethod
    def _decoded(results: Iterator[Batch]) -> Iterator[Batch]:
        from sparktrain.data.workers import DecodeWorkerError, TransformationFailed

        while True:
            try:
                batch = next(results)
            except StopIteration:
                return
            except TransformationFailed as exc:  # the user's function raised: not retried
                mark_user_error(exc, "transformation_fn (in a decode worker)")
                raise
            except DecodeWorkerError as exc:  # killed or crashed: it would die again
                mark_user_error(exc, "a decode worker of transformation_fn")
                raise
            yield batch

    def _pool(self, split: str) -> Any:
        pool = self._pools.get(split)
        if pool is None:
            from sparktrain.data.workers import DecodePool

            assert self.transform is not None  # pools only with processes, so a transform
            pool = self._pools[split] = DecodePool(
                self.transform, self.workers.get(split, 2), seed=self.seed,
                max_bytes=self.queue_bytes, start_method=self.start_method,
                name=f"transformation_fn ({split})")
        return pool

    def close(self) -> None:
        """Stop the decode workers (idempotent)."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
