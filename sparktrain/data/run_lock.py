"""One fit per run at a time: a run directory's checkpoints and events belong to one writer.

A fit holds a lease (:mod:`sparktrain.data.lease`) in ``<store>/runs/<run_id>/_active`` while it
trains. A second fit with the same ``run_id`` (a user-given one, reused from two threads or two
notebooks) fails at once with :class:`RunInUseError` instead of interleaving its checkpoints
with the first's; once the first fit ends (or its driver dies and the lease expires), the run
can be resumed.

Example::

    with run_lock(store, "nightly", ttl=60):
        ...  # train, checkpoint under store.run_path("nightly")
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from sparktrain.data.lease import DEFAULT_TTL_SECONDS, Lease
from sparktrain.data.store import Store
from sparktrain.errors import RunInUseError


@contextmanager
def run_lock(store: Store, run_id: str, ttl: float = DEFAULT_TTL_SECONDS) -> Iterator[None]:
    """Hold the run ``run_id`` for the block; raise :class:`RunInUseError` if another fit
    holds it."""
    fs = store.fs
    lease = Lease.acquire(fs, f"{fs._strip_protocol(store.run_path(run_id))}/_active", ttl,
                          note=f"a fit of run {run_id!r}")
    try:
        if not lease.first():
            others = lease.others()
            holder = others[0].describe() if others else "another fit"
            if others:  # a driver that died on another host: say when its lock lapses
                left = max(0, round(others[0].expires - time.time()))
                holder += (f" (if that fit's driver is gone, its lock lapses in {left} s; "
                           f"spark.sparktrain.leaseSeconds={ttl:g})")
            raise RunInUseError(
                f"run_id={run_id!r} is in use by {holder}: two fits cannot share one run's "
                f"checkpoints. Pass another run_id (or none: each fit then gets its own), or "
                f"fit again with this run_id once that fit has ended to resume from its "
                f"checkpoint.")
        yield
    finally:
        lease.release()
