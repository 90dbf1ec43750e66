"""A rank's streamed rows as they arrive from the feeding tasks (``input_mode="stream"``).

Every rank knows from the driver's plan (each input partition's row count per split) how many
rows it will get and where each partition's rows go in its shard (:mod:`.fed_wire` deals them),
so all ranks run the same steps without counting or talking: ``ceil(most rows of any rank /
batch_size)``, a rank short of the most repeating some of its rows.

Two ways to hold the rows, chosen per split:

* **cached** (fixed-shape numeric columns, and the shard fits ``cache_limit`` and the local
  disk): arriving rows are written straight into the rank-local cache
  (:class:`~sparktrain.data.rank_cache.RankCache`) at their place in the shard. The first
  epoch trains on them as they arrive, shuffled within a window of
  :data:`~.fed_shard.WINDOW_BYTES`; every later epoch is a permutation of the whole shard
  (exact and repeatable: a resumed epoch skips exactly the batches it had trained). One
  decoded copy on the local disk, nothing else.
* **re-read** (anything else): rows are kept only in a bounded in-memory window, and every
  epoch asks the driver to feed the DataFrame again (read again from its source), as
  TensorFlowOnSpark's InputMode.SPARK and Ray Data's ``streaming_split`` do. A resumed epoch
  skips as many rows as it had trained (the same count, not necessarily the same rows).

Example (on a rank)::

    rows = FedRows(spec, rank=0, world_size=2, all_gather=ctx.all_gather)   # spec.rows: "fed"
    for batch in rows.readers["train"].epoch(0):
        batch["features"].shape      # (batch_size, 32)
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from sparktrain.data.columns import ColumnSpec
from sparktrain.data.rank_cache import row_bytes
from sparktrain.data.sources.fed_shard import FedShard
from sparktrain.data.sources.fed_wire import FeedFolder, Receiver, Targets, host_targets, share
from sparktrain.faults import mark_user_error
from sparktrain.options.spec import LoopSpec

log = logging.getLogger("sparktrain")


class FeedFailed(RuntimeError):
    """The driver could not feed the rows (the DataFrame's computation failed)."""


class FedRows:
    """This rank's receiver and its readers (``readers[split]``, each a :class:`FedShard`):
    rows dealt to it by the feeding tasks, planned from the counts in ``spec.rows``.
    :class:`~.own_partition.OwnRows` is the same with the task's own partition instead."""

    def __init__(self, spec: LoopSpec, rank: int, world_size: int,
                 all_gather: Optional[Callable[[str], List[str]]],
                 say: Optional[Callable[[str], None]] = None, hosts: Sequence[str] = ()) -> None:
        plan = spec.rows
        self.rank, self.world_size, self.chunk = rank, world_size, plan.chunk
        # where and how the receiver listens: this rank's executor address, the fit's secret
        self.host, self.plan_secret = (hosts[rank] if hosts else ""), plan.secret
        self.say = say
        # each partition's ranks: one host's where the ranks span several (fed_wire)
        rows = [sum(c) for c in zip(*plan.counts.values(), strict=True)]
        self.targets: Optional[Targets] = host_targets(hosts, rows, plan.chunk, plan.homes) \
            if len(hosts) == world_size else None
        self.folder = FeedFolder(plan.feed_dir, spec.storage_options) if plan.feed_dir else None
        columns = [ColumnSpec.from_json(c) for c in spec.columns]
        self.error: Optional[BaseException] = None
        options = {"train": (spec.batch_size, spec.shuffle), "val": (spec.val_batch_size, False)}
        self.readers: Dict[str, FedShard] = {}
        for split, counts in plan.counts.items():
            shares = self._shares(counts, rank, plan.chunk)
            most = max(sum(self._shares(counts, r, plan.chunk)) for r in range(world_size))
            if not most:
                continue
            if not sum(shares):
                raise ValueError(
                    f"input_mode='stream': rank {rank} of {world_size} gets no "
                    f"{'training' if split == 'train' else 'validation'} rows: the DataFrame "
                    f"has too few rows for num_proc={world_size}; use fewer ranks or "
                    f"input_mode='store'")
            size, shuffle = options[split]
            self.readers[split] = FedShard(self, split, columns, counts, shares, most, size,
                                           shuffle, spec.seed, plan.cache_limit)
        if "train" not in self.readers:
            raise ValueError("input_mode='stream': the DataFrame reached the ranks without rows")
        for reader in self.readers.values():
            if say is not None and (rank == 0 or not reader.cached):
                held = "kept in the local cache" if reader.cached else (
                    "no room in the local cache (or over cache_limit): read again from the "
                    "DataFrame every epoch")
                say(f"{reader.split} rows: {reader.rows} on this rank "
                    f"({reader.rows * row_bytes(columns) / 2**20:.1f} MiB decoded), {held}")
        self.requested: set = set()
        self._start(all_gather)

    def _start(self, all_gather: Optional[Callable[[str], List[str]]]) -> None:
        """Listen for the feeders and agree with the other ranks on where each listens."""
        if all_gather is None:
            raise RuntimeError("rows fed beside the ranks need the ranks' all_gather")
        self.receiver = Receiver(self._on_batch, self._on_error, self.host,
                                 secret=self.plan_secret)
        mine = {"address": self.receiver.address, "token": uuid.uuid4().hex[:12],
                "re_read": any(not r.cached for r in self.readers.values())}
        everyone = [json.loads(text) for text in all_gather(json.dumps(mine))]
        self.addresses = [e["address"] for e in everyone]
        self.token = everyone[0]["token"]
        self.re_read = any(e["re_read"] for e in everyone)

    def _ranks_of(self, partition: int) -> List[int]:
        """The ranks ``partition``'s rows are dealt to (:func:`.fed_wire.host_targets`)."""
        if self.targets is None:
            return list(range(self.world_size))
        return self.targets[partition]

    def _shares(self, counts: List[int], rank: int, chunk: int) -> List[int]:
        """Rank ``rank``'s rows of each partition, as they are dealt (:func:`.fed_wire.share`)."""
        found = []
        for p, c in enumerate(counts):
            ranks = self._ranks_of(p)
            found.append(share(c, p, len(ranks), ranks.index(rank), chunk)
                         if rank in ranks else 0)
        return found

    def offsets(self, partition: int, index: np.ndarray) -> np.ndarray:
        """The offsets in ``partition`` of this rank's rows ``index`` of it (dealt in turns of
        ``chunk`` rows among the partition's ranks: :func:`.fed_wire.dealt`)."""
        ranks = self._ranks_of(partition)
        turn, within = np.divmod(index, self.chunk)
        first = (ranks.index(self.rank) - partition) % len(ranks) if self.rank in ranks else 0
        return (first + turn * len(ranks)) * self.chunk + within

    def owners(self, partition: int, offsets: np.ndarray, world_size: int) -> np.ndarray:
        """The rank each of ``partition``'s rows at ``offsets`` is dealt to (``world_size``:
        this generation's, the ranks' own)."""
        ranks = np.asarray(self._ranks_of(partition))
        return ranks[(offsets // self.chunk + partition) % len(ranks)]

    def _on_batch(self, header: Dict[str, Any], start: int, batch: Any) -> None:
        reader = self.readers.get(header.get("split", "train"))
        if reader is not None:
            reader.put(int(header["epoch"]), int(header["partition"]), start, batch)

    def _on_error(self, exc: BaseException) -> None:
        self.error = exc

    def request(self, epoch: int) -> None:
        """Ask the driver to feed ``epoch`` (rank 0 asks for all; once per epoch, and only
        the first unless a rank re-reads its rows every epoch)."""
        if epoch in self.requested or (self.requested and not self.re_read):
            return
        self.requested.add(epoch)
        if self.rank == 0 and self.folder is not None:
            self.folder.ask(self.token, epoch, self.addresses, self.targets)

    def fed_all(self, epoch: int) -> bool:
        """Whether every row of ``epoch`` was sent."""
        return self.folder is not None and self.folder.done(self.token, epoch)

    def check(self) -> None:
        """Raise what went wrong with the feed, if anything did."""
        if self.error is not None:
            raise self.error
        text = self.folder.failure() if self.folder is not None else None
        if text is None:
            return
        # the DataFrame's own computation, or no slot to feed from: a new attempt of the
        # ranks would fail the same way
        raise mark_user_error(FeedFailed(
            f"input_mode='stream': feeding the rows failed on the driver's side (not "
            f"retried):\n{text}"), "the feeding job (on the driver's side)")

    def close(self) -> None:
        if self.say is not None:
            self.say(f"row feed: {self.receiver.traffic()}")
        self.receiver.close()
        for reader in self.readers.values():
            reader.drop()
