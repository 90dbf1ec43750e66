"""A bounded window of arrived rows that batches are drawn from at random (the shuffle of rows
that arrive while the ranks train: tf.data's shuffle buffer, Ray Data's local shuffle buffer).

The rows are shard positions (a cached split: the batch is then read from the rank cache) or
decoded columns (``{name: array}``); a drawn row's place is filled from the end, so a draw
costs its batch, not the window.

Example::

    window = ShuffleWindow(capacity=4096)
    window.add(np.arange(1000))                  # positions that arrived
    batch = window.draw(256, np.random.default_rng(0))
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np


class ShuffleWindow:
    """Arrived rows awaiting their batch (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: Dict[str, np.ndarray] = {}
        self.positions = False
        self.size = 0

    def add(self, rows: Any) -> None:
        self.positions = not isinstance(rows, dict)
        rows = {"": rows} if self.positions else rows
        count = row_count(rows)
        if not self.data or self.size + count > len(next(iter(self.data.values()))):
            room = max(self.capacity, 2 * (self.size + count))
            self.data = {n: _grown(self.data.get(n), v, room, self.size) for n, v in rows.items()}
        for name, values in rows.items():
            self.data[name][self.size:self.size + count] = values
        self.size += count

    def draw(self, count: int, rng: Optional[np.random.Generator]) -> Any:
        if rng is None:  # in arrival order (shuffle=False): what is left moves up
            rows = {n: v[:count].copy() for n, v in self.data.items()}
            for values in self.data.values():
                values[:self.size - count] = values[count:self.size].copy()
        else:
            picked = np.sort(rng.choice(self.size, count, replace=False))
            rows = {n: v[picked] for n, v in self.data.items()}
            tail = np.arange(self.size - count, self.size)
            holes = picked[picked < self.size - count]
            movers = tail[~np.isin(tail, picked)]
            for values in self.data.values():
                values[holes] = values[movers]
        self.size -= count
        return rows[""] if self.positions else rows


def _grown(old: Optional[np.ndarray], like: np.ndarray, room: int, keep: int) -> np.ndarray:
    array = np.empty((room,) + like.shape[1:], dtype=like.dtype)
    if old is not None:
        array[:keep] = old[:keep]
    return array


def taken_rows(rows: Any, index: np.ndarray) -> Any:
    return {n: v[index] for n, v in rows.items()} if isinstance(rows, dict) else rows[index]


def joined_rows(first: Any, second: Any) -> Any:
    if first is None:
        return second
    if isinstance(first, dict):
        return {n: np.concatenate([v, second[n]]) for n, v in first.items()}
    return np.concatenate([first, second])


def row_count(rows: Any) -> int:
    return len(next(iter(rows.values()))) if isinstance(rows, dict) else len(rows)
