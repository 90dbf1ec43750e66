"""The loop each decode worker process runs, and the protocol it speaks with its pool.

A worker (started by :class:`sparktrain.data.workers.DecodePool`) loads the pickled function
once, then answers tasks until its task pipe closes. Each task is two messages: :data:`HEADER`
(task id, epoch, batch number) and the pickled batch. Each answer is one tuple:

* ``("ok", task, block, layout, extra, nbytes)``: the result, its arrays in shared memory
  block ``block`` (see :mod:`sparktrain.data.shm_blocks`), the rest pickled in ``extra``;
* ``("skip", task)``: the map that sent it was abandoned (task below the pool's floor);
* ``("error", task, exception type, text, traceback)``: the function raised;
* ``("fatal", task, message)``: the result could not be placed in shared memory.

Before each call the worker seeds ``random``, ``numpy.random`` and (if the function imported
it) torch from ``(seed, epoch, batch number)``: the same batches whatever the number of workers.
``TOKENIZERS_PARALLELISM`` is ``false`` in a worker unless its environment sets it: a Hugging
Face tokenizer encodes on one thread there, the workers being the parallelism.

Example (what the pool does)::

    ctx.Process(target=work, args=(index, fn_bytes, seed, prefix, task_r, result_w, floor))
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import random
import signal
import struct
import sys
import traceback
from typing import Any, Callable, Dict, Tuple

import cloudpickle
import numpy as np

from sparktrain.data.shm_blocks import ShmFull, discard_block, pack

Batch = Dict[str, Any]

HEADER = struct.Struct("<qqq")  # task, epoch, batch number: sent before each pickled batch


def work(index: int, fn_bytes: bytes, seed: int, prefix: str, tasks: Any, results: Any,
         floor: Any) -> None:
    """A decode worker's loop: read a task, run ``fn``, answer; until the pipe closes.

    ``tasks``/``results``: this worker's ends of its two pipes; ``floor``: a shared integer,
    tasks below it are skipped; ``prefix``: the pool's shared memory block name prefix.
    """
    # Ctrl-C reaches the whole process group; the parent decides what stops, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a segfault in a native decoder then prints the Python stack that called it
    faulthandler.enable()
    # Hugging Face tokenizers encode a batch on a Rust thread pool as wide as the machine; in
    # every worker of every rank that is workers x ranks pools fighting each other (and the
    # training threads) for the same cores: the pool of processes is the parallelism here.
    # Set before the function is loaded (tokenizers reads it on each call); a value in the
    # environment the workers start from (the rank's backend_env, say) wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fn, load_error = None, None
    try:
        fn = cloudpickle.loads(fn_bytes)
    except BaseException as exc:  # reported with each batch, which names the function
        load_error = (_type_name(exc), f"cannot load the function in decode worker {index}: "
                      f"{_text(exc)}", traceback.format_exc())
    del fn_bytes
    while True:
        try:
            header = tasks.recv_bytes()
            body = tasks.recv_bytes()
        except (EOFError, OSError):  # the pool closed, or the parent is gone
            return
        task, epoch, number = HEADER.unpack(header)
        if task < floor.value:  # the map that sent it was abandoned
            answer: Tuple[Any, ...] = ("skip", task)
        elif load_error is not None:
            answer = ("error", task) + load_error
        else:
            assert fn is not None  # loaded: load_error is None
            answer = _run(fn, body, task, epoch, number, seed, f"{prefix}{task:x}")
        del body
        try:
            results.send(answer)
        except (OSError, ValueError):  # the parent is gone: nobody will unlink the block
            if answer[0] == "ok" and answer[2] is not None:
                discard_block(answer[2])
            return


def _run(fn: Callable[[Batch], Any], body: bytes, task: int, epoch: int, number: int,
         seed: int, block: str) -> Tuple[Any, ...]:
    try:
        batch = pickle.loads(body)
        _seed(seed, epoch, number)
        out = fn(batch)
        del batch
        return ("ok", task) + pack(out, block)
    except ShmFull as exc:
        return ("fatal", task, str(exc))
    except BaseException as exc:  # SystemExit from the function included: report, live on
        return ("error", task, _type_name(exc), _text(exc), traceback.format_exc())


def _seed(seed: int, epoch: int, number: int) -> None:
    """Seed the global RNGs for batch ``number`` of ``epoch``: the same whichever worker."""
    state = np.random.SeedSequence([seed, epoch % (1 << 64), number]).generate_state(4)
    np.random.seed(state)
    random.seed(int.from_bytes(state.tobytes(), "little"))
    torch = sys.modules.get("torch")  # only if fn imported it: workers never import torch
    if torch is not None:
        torch.manual_seed(int.from_bytes(state[:2].tobytes(), "little") >> 1)


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    module = getattr(cls, "__module__", "")
    return cls.__qualname__ if module in ("builtins", "__main__", None, "") \
        else f"{module}.{cls.__qualname__}"


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the error itself
        return f"<{type(exc).__name__}: str() failed>"
