"""A rank's side of a launch: its output and errors sent to the client, its
:class:`~.rank_context.RankContext` made from its place in the job (its barrier task's, or a
local rank's: :mod:`.local_ranks`).

:func:`run_rank` runs in a barrier task (one rank per task) or in a local rank's process (one
per GPU of a task holding several); either way the rank's lines, progress and traceback reach
the client through the store (:mod:`.events`), and the ranks exchange small messages through
rank 0's gather server (:mod:`.rank_gather`).

Example (what :mod:`.barrier`'s tasks run)::

    rank, result = run_rank(task, where)      # task(RankContext) -> result
"""
from __future__ import annotations

import io
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

from sparktrain.faults import lost_rank_text, user_error_source
from sparktrain.fs import filesystem
from sparktrain.launch.events import RankEvents
from sparktrain.launch.rank_context import (
    LaunchSite,
    Place,
    RankContext,
    barrier_place,
    rank_context,
)
from sparktrain.launch.rank_gather import NO_SERVER, GatherServer, RankGather, connect, publish

FAILURE_TAG = "sparktrain-rank-failure"
# A peer's death makes rank 0's collective fail at once, and rank 0's gather server sees the
# death a moment later: within this, it is reported (events.CAUSE_SECONDS takes it as the cause).
SETTLE_SECONDS = 1.0


class _LineTee(io.TextIOBase):
    """Write-through stream that also sends complete lines to the client."""

    def __init__(self, original: Optional[Any], client: RankEvents) -> None:
        self._original = original
        self._client = client
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if self._original is not None:
            try:
                self._original.write(text)
            except (OSError, ValueError, AttributeError):
                pass
        with self._lock:
            self._buffer += text
            if "\n" in self._buffer:
                lines, self._buffer = self._buffer.rsplit("\n", 1)
                self._client.log(lines)
        return len(text)

    def flush(self) -> None:
        if self._original is not None:
            try:
                self._original.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def drain(self) -> None:
        with self._lock:
            if self._buffer:
                self._client.log(self._buffer)
                self._buffer = ""


@contextmanager
def _captured_output(client: RankEvents, mirror: bool) -> Iterator[None]:
    """Send the rank's stdout/stderr lines to the client; ``mirror`` also keeps them in the
    executor's own log (off in local mode, where that log is the console of Spark's driver)."""
    out, err = sys.stdout, sys.stderr
    tees = [_LineTee(out if mirror else None, client), _LineTee(err if mirror else None, client)]
    sys.stdout, sys.stderr = tees
    try:
        yield
    finally:
        for tee in tees:
            tee.drain()
        sys.stdout, sys.stderr = out, err


class _GaveUp(RuntimeError):
    """Spark started more attempts than ``max_attempts`` allows."""


def _give_up(client: RankEvents, rank: int, limit: int) -> None:
    """Stop a re-run beyond ``max_attempts``. The starts of every attempt are counted in the
    store (:meth:`RankEvents.start`), so this also bounds attempts that ended without any rank
    reporting an error: a rank SIGKILLed (the OOM killer), a lost executor."""
    text = (f"gave up after max_attempts={limit} attempt(s): none of them reported a Python "
            f"error, so a rank's process or executor was killed (SIGKILL, the OOM killer, a "
            f"lost node: see the executors' logs) or failed before it could report")
    client.error(text, fatal=True, attempts_failed=limit)
    raise _GaveUp(f"{FAILURE_TAG} rank={rank}\n{text}\n{FAILURE_TAG} end")


def run_rank(task: Callable[[RankContext], Any], where: Sequence[Any],
             task_input: Any = None, place: Optional[Place] = None
             ) -> Tuple[int, Any]:
    """Executor entry point: build the :class:`RankContext`, run ``task``, report failures.
    ``where`` is a :class:`~.rank_context.LaunchSite` (or the same
    values as a tuple); ``task_input``: the rows its task took
    (:class:`~sparktrain.data.sources.contract.TaskInput`), if any; ``place``: a
    local rank's place (default: the barrier task's own)."""
    barrier = None
    if place is None:
        from pyspark import BarrierTaskContext

        barrier = BarrierTaskContext.get()
        place = barrier_place(barrier)
    rank = place.rank
    site = LaunchSite(*where)
    client = RankEvents(f"{site.folder}/events", site.storage_options, rank)
    started = client.start()
    if client.stopped():  # an earlier attempt failed in user code: Spark's re-run is moot
        client.close()
        raise RuntimeError(f"{FAILURE_TAG} rank={rank}\nnot retried: an earlier attempt "
                           f"failed in the user's code\n{FAILURE_TAG} end")
    server = gather = None
    settle = 0.0  # on a fault, how long rank 0's server may take to see a peer's death
    try:
        with _captured_output(client, mirror=site.mirror):
            context = rank_context(place, barrier, client)
            context.task_input = task_input
            server, gather = _rank_gather(place.stage, context, site)
            context.gather = gather
            # every rank counted its own starts; agree on one number (the largest)
            context.attempt = max(int(a) for a in context.all_gather(str(started)))
            client.attempt = context.attempt
            if site.attempts is not None and context.attempt >= site.attempts:
                _give_up(client, rank, site.attempts)
            return rank, task(context)
    except _GaveUp:
        raise
    except BaseException as exc:
        remote = traceback.format_exc()
        source = user_error_source(exc)
        if source is not None:  # first: the traceback's last line stays the error's summary
            label = source if source.endswith(")") else f"{source} (user code)"
            remote = f"Raised by {label}: not retried.\n{remote}"
        if isinstance(exc, ModuleNotFoundError):
            remote += (f"\nThe executors' Python ({sys.executable}) cannot import {exc.name!r}: "
                       f"install it there, or point PYSPARK_PYTHON / spark.pyspark.python at a "
                       f"Python that has it.\n")
        client.error(remote, fatal=source is not None)
        settle = 0.0 if source is not None else SETTLE_SECONDS
        # Spark shows only the task's exception text: carry the traceback inside it, tagged.
        raise RuntimeError(f"{FAILURE_TAG} rank={rank}\n{remote}\n{FAILURE_TAG} end") from None
    finally:
        if gather is not None:
            gather.close()
        if server is not None:
            server.close(settle)
        client.close()


def _rank_gather(stage: int, context: RankContext, site: LaunchSite
                 ) -> Tuple[Optional[GatherServer], Optional[RankGather]]:
    """Rank 0's gather server (on rank 0) and this rank's connection to it, found through the
    launch folder (:mod:`.rank_gather`); no connection where rank 0 could not start a server
    (the ranks then use Spark's allGather)."""
    fs = filesystem(site.folder, site.storage_options)[0]
    path = f"{site.folder}/gather-{stage}"

    def on_lost(rank: int) -> None:  # a rank's process died without a word: say so
        if context.client is not None:
            context.client.error(lost_rank_text(rank, context.hosts[rank]), lost=rank)

    if context.rank != 0:
        return None, connect(fs, path, context.rank, on_lost=on_lost)
    try:
        server = GatherServer(context.world_size, context.hosts[0], on_lost=on_lost)
    except OSError as exc:
        context.log(f"no gather server ({exc}): the ranks exchange messages through Spark's "
                    f"allGather (about 1 s each)")
        publish(fs, path, NO_SERVER)
        return None, None
    publish(fs, path, server.address)
    return server, RankGather(server.address, 0)
