"""What a rank knows of its place in a launch (executor side), apart from how it got there:
its :class:`RankContext` (what a training function receives), the :class:`Place` it is made
from, and the :class:`LaunchSite` every rank of a launch shares.

Example::

    def train(ctx: RankContext) -> float:
        ctx.log(f"rank {ctx.rank} of {ctx.world_size} on {ctx.hosts[ctx.rank]}")
        return 0.0
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional

from sparktrain.launch.events import RankEvents


class LaunchSite(NamedTuple):
    """Where a launch's ranks report and meet, the same for all of them."""

    folder: str  # the launch's folder in the store: events, the gather server's address
    storage_options: Optional[Dict[str, Any]]
    mirror: bool  # also keep the rank's output in the executor's own log
    attempts: Optional[int] = None  # the most attempts Spark may start (max_attempts)


@dataclass
class RankContext:
    """What a training function learns about its place in the job (executor side)."""

    rank: int
    world_size: int
    hosts: List[str]
    cpus: int
    resources: Dict[str, List[str]]
    barrier: Any = field(repr=False)  # the pyspark BarrierTaskContext (None: a local rank)
    client: Optional[RankEvents] = field(default=None, repr=False)
    attempt: int = 0  # 0 on the first run of the stage, n on Spark's n-th retry
    generation: Any = None  # an elastic fit's generation (sparktrain.launch.elastic)
    # rows its barrier task took (run_barrier's ``stage_input``): a data.sources.contract.TaskInput
    task_input: Any = field(default=None, repr=False)
    # the ranks' own gather (rank_gather.RankGather); None: Spark's allGather
    gather: Any = field(default=None, repr=False)
    # several ranks in one task (one per GPU, :mod:`.local_ranks`): this one's place there
    local_rank: int = 0
    local_size: int = 1

    def log(self, text: str) -> None:
        """Send ``text`` to the client's log as ``[rank N] text``."""
        if self.client is not None:
            self.client.log(text)

    def progress(self, **event: Any) -> None:
        """Send a progress event (plain JSON values) to the client's progress display."""
        if self.client is not None:
            self.client.progress(event)

    def all_gather(self, message: str) -> List[str]:
        """Every rank's ``message``, in rank order: through rank 0's gather server (a few ms),
        or Spark's ``allGather`` (about 1 s: :mod:`sparktrain.launch.rank_gather`) where there
        is none."""
        if self.gather is not None:
            return self.gather(message)
        if self.barrier is None:
            raise RuntimeError("the ranks of a task with several GPUs exchange messages through "
                               "rank 0's gather server, which could not start (see rank 0's "
                               "log)")
        return list(self.barrier.allGather(message))


@dataclass(frozen=True)
class Place:
    """Where a rank sits in the job, decided before its :class:`RankContext` exists: by its
    barrier task (:func:`barrier_place`) or, for a local rank, by its task's process
    (:mod:`.local_ranks`)."""

    rank: int
    world_size: int
    hosts: List[str]  # every rank's executor host, in rank order
    cpus: int
    resources: Dict[str, List[str]]
    stage: int  # the barrier stage's id: names the stage's gather-server file
    local_rank: int = 0
    local_size: int = 1


def barrier_place(barrier: Any) -> Place:
    """The place of the rank that its barrier task runs itself (one rank per task)."""
    infos = barrier.getTaskInfos()
    hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    resources = {name: list(info.addresses) for name, info in barrier.resources().items()}
    return Place(barrier.partitionId(), len(infos), hosts, int(barrier.cpus()), resources,
                 barrier.stageId())


def rank_context(place: Place, barrier: Any = None,
                 client: Optional[RankEvents] = None) -> RankContext:
    return RankContext(rank=place.rank, world_size=place.world_size, hosts=list(place.hosts),
                       cpus=place.cpus, resources=dict(place.resources), barrier=barrier,
                       client=client, local_rank=place.local_rank, local_size=place.local_size)
