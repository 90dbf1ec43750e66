"""Each rank takes its own partition (``input_mode="stream"`` where the ranks take every task
slot, the DataFrame has one partition a rank, the fit is not elastic and every column is
fixed-shape numeric): the training stage reads the DataFrame as it is partitioned, no
shuffle, and rank ``r`` trains on partition ``r``, written into its rank-local cache as the
rows come (:class:`~.fed_shard.FedShard`, as if fed): the first step comes with the first rows.
The rows can be read once only there, so the shard must fit the local disk (else
:class:`~sparktrain.errors.LocalDiskFullError`).

Example::

    stage = OwnPartitionStage(frame)            # driver: run_barrier(..., stage_input=stage)
    rows = OwnRows(spec, rank, world_size, batches, all_gather)   # on the rank
    rows.readers["train"].epoch(0)
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from sparktrain.data.columns import SPLIT_COL
from sparktrain.data.rank_cache import cache_root, disk_full, row_bytes
from sparktrain.data.sources.fed_rank import FedRows
from sparktrain.options.spec import LoopSpec


class OwnPartitionStage:
    """The stage input (:class:`~sparktrain.data.sources.contract.StageInput`): the DataFrame in
    its own partitions, one a task."""

    def __init__(self, frame: Any) -> None:
        self.frame_ = frame

    def frame(self, tasks: int) -> Any:
        return self.frame_

    def taker(self) -> Callable[[Iterator[Any]], "OwnPartition"]:
        return OwnPartition


class OwnPartition:
    """The rows one training task took: its own partition, as Arrow record batches (a
    :class:`~sparktrain.data.sources.contract.TaskInput`)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches

    def readers(self, spec: LoopSpec, rank: int, world_size: int,
                all_gather: Callable[[str], List[str]],
                say: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
        return dict(OwnRows(spec, rank, world_size, self.batches, say).readers)

    def for_local_ranks(self, folder: str, ranks: int,
                        all_gather: Callable[[str], List[str]]) -> List[Any]:
        raise RuntimeError("each rank's own partition is chosen for tasks of one rank only")

    def for_child(self, spec: Any, world_size: int,
                  all_gather: Callable[[str], List[str]]) -> Any:
        raise RuntimeError("each rank's own partition is read in the task's process only")


class OwnRows(FedRows):
    """:class:`~.fed_rank.FedRows` whose rows are partition ``rank``, taken from the task's
    input on a thread instead of received."""

    def __init__(self, spec: LoopSpec, rank: int, world_size: int, batches: Iterator[Any],
                 say: Optional[Callable[[str], None]] = None) -> None:
        self.batches = batches
        self.taken = False  # the task's input is all read
        super().__init__(spec, rank, world_size, None, say)

    def _shares(self, counts: List[int], rank: int, chunk: int) -> List[int]:
        return [c if p == rank else 0 for p, c in enumerate(counts)]

    def offsets(self, partition: int, index: np.ndarray) -> np.ndarray:
        return np.asarray(index, np.int64)  # the whole partition, in its order

    def owners(self, partition: int, offsets: np.ndarray, world_size: int) -> np.ndarray:
        return np.full(len(offsets), partition, np.int64)  # partition r is rank r's

    def _start(self, all_gather: Optional[Callable[[str], List[str]]]) -> None:
        """Take the partition into the cache on a thread; it can be read once only, so
        every split must fit the cache."""
        for reader in self.readers.values():
            if not reader.cached:
                need = reader.rows * row_bytes(reader.columns)
                raise disk_full(cache_root() + "/x", f"making room for the rank's "
                                f"{need / 2**20:.1f} MiB of {reader.split} rows", OSError(
                                    28, "not enough free space (or over cache_limit)"))
        threading.Thread(target=self._take, name="sparktrain-own-rows", daemon=True).start()

    def _take(self) -> None:
        import pyarrow.compute as pc

        starts: Dict[str, int] = {}
        try:
            for batch in self.batches:
                for split, reader in self.readers.items():
                    part = batch.filter(pc.equal(batch.column(SPLIT_COL), split))
                    if part.num_rows:
                        reader.put(0, self.rank, starts.get(split, 0), part)
                        starts[split] = starts.get(split, 0) + part.num_rows
        except BaseException as exc:  # noqa: BLE001 - the training thread raises it
            self.error = exc
        finally:
            self.taken = True
            for reader in self.readers.values():
                with reader.lock:
                    reader.lock.notify_all()

    def request(self, epoch: int) -> None:
        """Nothing to ask for: the task reads its partition once."""

    def fed_all(self, epoch: int) -> bool:
        return self.taken

    def close(self) -> None:
        for reader in self.readers.values():
            reader.drop()
