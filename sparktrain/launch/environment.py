"""``backend_env``: environment variables set in a rank's process while it trains.

Spark reuses its Python workers across tasks, so the variables are set for the rank's run only
and the previous values come back afterwards. Child processes started meanwhile (the Keras
worker of the ``tensorflow``/``tfos`` backends) inherit them. A variable that a library reads
once, when it is imported (e.g. ``OMP_NUM_THREADS`` for torch), takes effect in the torch rank
only when Spark starts a fresh Python worker; the Keras worker is always a fresh process.

Example (executor side)::

    with rank_environment({"NCCL_DEBUG": "INFO"}):
        train(...)
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Iterator, Optional


@contextmanager
def rank_environment(env: Optional[Dict[str, str]]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration of the block, then restore."""
    env = dict(env or {})
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
