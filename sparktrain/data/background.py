"""Items produced ahead by a background thread (the readers' prefetch).

Example::

    for group in in_background(decode(g) for g in groups, depth=2):
        ...
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator


def in_background(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items``, produced by a background thread up to ``depth`` ahead (``depth <= 0``: in the
    caller's thread). An exception in the producer is raised in the caller; a caller that
    stops early stops the producer.

    Example::

        for chunk in in_background((read(piece) for piece in pieces), 2):
            train_on(chunk)
    """
    if depth <= 0:
        yield from items
        return
    slots: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                slots.put(item)
            slots.put(done)
        except BaseException as exc:  # handed to the consumer, raised there
            slots.put(exc)

    thread = threading.Thread(target=produce, name="sparktrain-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            del item  # do not hold a chunk while waiting for the next one
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(0.01)
