"""Decoded batches in POSIX shared memory: one block per batch, so that a decode worker hands
its arrays to the training process without pickling them through a pipe.

The worker packs every plain numeric array of its result into one new block (:func:`pack`) and
sends only the block's name and the arrays' layout; the parent copies each array out (one memcpy:
the consumer owns the result) and unlinks the block at once (:func:`unpack`). Everything else
(object arrays, lists, scalars) is pickled. A block nobody will read is unlinked with
:func:`discard_block`.

Example::

    block, layout, extra, nbytes = pack({"x": np.ones(3)}, f"{SHM_PREFIX}1f_ab12_0")   # worker
    unpack(block, layout, extra)    # parent: {"x": array([1., 1., 1.])}, the block unlinked
"""
from __future__ import annotations

import errno
import os
import pickle
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Any, List, Optional, Tuple

import cloudpickle
import numpy as np

#: shared memory blocks are named ``sptr<parent pid>_<pool token>_<task>`` (hex), short enough
#: for macOS's 31-character limit; a pool can find (and unlink) the block of any task it sent
SHM_PREFIX = "sptr"
_ALIGN = 64  # arrays start on cache-line boundaries inside a block


#: per output key: (key, dtype, shape, offset in the block), or (key, None, None, None) when the
#: value is pickled instead
Layout = List[Tuple[Any, ...]]


class ShmFull(Exception):
    """/dev/shm has no room for a result: reported as a
    :class:`~sparktrain.data.workers.DecodeWorkerError`."""


# ---------------------------------------------------------------- parent side: read and unlink

def _attach(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):  # registration balanced by hand in _release
        return shared_memory.SharedMemory(name=name, track=False)
    return shared_memory.SharedMemory(name=name)


def _release(shm: shared_memory.SharedMemory) -> None:
    """Close and unlink a block the parent attached to.

    The worker registered the block with the resource tracker when it created it; workers share
    the parent's tracker, whose registry is a set of names. Before 3.13 attaching registers the
    same name again (no change) and ``unlink`` unregisters it, which leaves the tracker clean;
    from 3.13 the block is attached untracked and the worker's registration is dropped here.
    Either way nothing is unlinked twice and the tracker has nothing to warn about at exit.
    """
    try:
        shm.close()
    except BufferError:  # a view survived (an error while copying): the mapping goes with it
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        return
    if sys.version_info >= (3, 13) and os.name == "posix":
        resource_tracker.unregister("/" + shm.name, "shared_memory")


def discard_block(name: str) -> None:
    """Unlink block ``name`` if it exists (a result never read, or never sent)."""
    try:
        shm = _attach(name)
    except FileNotFoundError:
        return
    except (OSError, ValueError):  # created but not yet sized when its worker stopped
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
        return
    _release(shm)


def unpack(block: Optional[str], layout: Optional[Layout], extra: Optional[bytes]) -> Any:
    """A worker's result: arrays copied out of ``block`` (then unlinked), the rest unpickled."""
    shm = _attach(block) if block is not None else None
    try:
        others = pickle.loads(extra) if extra is not None else {}
        if layout is None:  # fn returned something other than a dict: passed on as is
            return others
        out = {}
        for key, dtype, shape, offset in layout:
            if offset is None:
                out[key] = others[key]
            else:
                out[key] = _copy_out(shm, np.dtype(dtype), shape, offset)
        return out
    finally:
        if shm is not None:
            _release(shm)


def _copy_out(shm: Optional[shared_memory.SharedMemory], dtype: np.dtype,
              shape: Tuple[int, ...], offset: int) -> np.ndarray:
    if shm is None or 0 in shape:
        return np.empty(shape, dtype)
    # the view dies with this frame, before the block is closed
    return np.ndarray(shape, dtype, buffer=shm.buf, offset=offset).copy()


# ---------------------------------------------------------------- worker side: create and fill

def _shareable(value: Any) -> bool:
    """Arrays whose bytes are the whole story (no object pointers, no field names)."""
    return (type(value) is np.ndarray and not value.dtype.hasobject
            and value.dtype.fields is None)


def pack(out: Any, name: str) -> Tuple[Optional[str], Optional[Layout], Optional[bytes], int]:
    """``out``'s plain arrays copied into one new block ``name``; the rest pickled.

    Returns ``(block name or None, layout, pickled rest or None, bytes in all)``, what
    :func:`unpack` takes (and the size the pool bounds its memory with).
    """
    if not isinstance(out, dict):
        extra = cloudpickle.dumps(out)
        return None, None, extra, len(extra)
    layout: Layout = []
    others = {}
    total = 0
    for key, value in out.items():
        if _shareable(value):
            total = -(-total // _ALIGN) * _ALIGN
            layout.append((key, value.dtype.str, value.shape, total))
            total += value.nbytes
        else:
            layout.append((key, None, None, None))
            others[key] = value
    # cloudpickle: a local class's instances survive too
    extra = cloudpickle.dumps(others) if others else None
    block = None
    if total:
        shm = shared_memory.SharedMemory(name=name, create=True, size=total)
        try:
            _reserve(shm, total)
            for key, _dtype, _shape, offset in layout:
                if offset is not None:
                    _copy_in(shm, out[key], offset)
        except BaseException:
            _close_quietly(shm)
            shm.unlink()
            raise
        _close_quietly(shm)
        block = name
    return block, layout, extra, total + (len(extra) if extra else 0)


def _copy_in(shm: shared_memory.SharedMemory, value: np.ndarray, offset: int) -> None:
    if value.size:  # the view dies with this frame, before the block is closed
        np.ndarray(value.shape, value.dtype, buffer=shm.buf, offset=offset)[...] = value


def _close_quietly(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        pass


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Allocate the block's pages now: on a full /dev/shm writing into them would kill the
    worker with SIGBUS; this fails with a message instead."""
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            return  # not supported here: write and hope
        try:
            free = os.statvfs("/dev/shm")
            room = f" ({free.f_bavail * free.f_frsize >> 20} MiB free)"
        except OSError:
            room = ""
        raise ShmFull(f"shared memory is full: a decoded batch of {size >> 20} MiB does not "
                      f"fit in /dev/shm{room}. Give the container a larger /dev/shm (Docker: "
                      f"--shm-size; Kubernetes: an emptyDir volume with medium Memory mounted "
                      f"at /dev/shm), or lower the batch size or the number of workers") \
            from exc
