"""Run ``transformation_fn`` on every batch in worker processes, results in input order.

A training rank reads compressed batches (JPEG/PNG bytes, text, variable-length arrays) in its
own process; decoding them is CPU work that one Python thread cannot spread over cores.
:class:`DecodePool` runs the user's function in ``workers`` processes, started once (lazily, on
the first :meth:`DecodePool.map`) and kept for every epoch until :meth:`DecodePool.close`.

How a batch travels:

* **In**: the parent pickles the batch (compressed, so small) and a feeder thread per worker
  writes it to that worker's pipe, so a busy worker never blocks the training loop.
* **Out**: the worker packs every numeric output array into one POSIX shared memory block and
  sends only ``(task, block name, [(key, dtype, shape, offset)])``; the parent copies each array
  out (one memcpy: the consumer owns the result) and unlinks the block at once. Other outputs
  (object arrays, lists, scalars) are pickled; the caller checks types later
  (:mod:`sparktrain.data.shm_blocks`).
* **Bounded**: batches dispatched but not yet consumed are limited so that their decoded bytes
  (measured on recent results) stay under ``max_bytes``; at least 1 and at most
  ``2 * workers`` are in flight, and the input iterator is read only as batches are dispatched.
* **Deterministic**: before each call the worker seeds ``random`` and ``numpy.random`` (and
  torch's RNG, if the function imported torch) from ``(seed, epoch, batch number)``, so random
  augmentations give the same batches whatever the number of workers (the worker's loop and
  the messages it exchanges with this pool: :mod:`sparktrain.data.decode_worker`).

Workers start with ``forkserver`` on Linux (the server preloads numpy and the worker's module, so a
worker starts in milliseconds) and ``spawn`` elsewhere, never ``fork``: the training process
holds Spark's and torch's threads, and a forked copy of a held lock deadlocks. As with any
``spawn``/``forkserver`` pool, each worker imports the parent's ``__main__`` module again (as
``__mp_main__``): a script's work belongs under ``if __name__ == "__main__":``.

Failures (:mod:`sparktrain.data.worker_errors`): an exception in the function raises
:class:`TransformationFailed` (with the worker's traceback) when its batch's turn comes; a worker
that dies (OOM killer, segfault in a native decoder) raises :class:`DecodeWorkerError` as soon as
the parent sees its process end. Either closes the pool. A consumer that stops early (closes the
generator) only discards the batches in flight: the pool stays usable for the next ``map``.

Example::

    def decode(batch):
        images = [np.asarray(PIL.Image.open(io.BytesIO(b))) for b in batch["image"]]
        return {"image": np.stack(images), "label": batch["label"]}

    with DecodePool(decode, workers=4, seed=7) as pool:
        for epoch in range(3):
            for batch in pool.map(reader.epoch(epoch), epoch):
                batch["image"].shape   # (256, 224, 224, 3)
"""
from __future__ import annotations

import multiprocessing
import operator
import os
import pickle
import queue
import secrets
import sys
import threading
import time
from collections import deque
from multiprocessing import connection
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    NoReturn,
    Optional,
    Tuple,
    Union,
    cast,
)

from sparktrain.data.decode_worker import HEADER, work
from sparktrain.data.shm_blocks import SHM_PREFIX, discard_block, unpack
from sparktrain.data.worker_errors import DecodeWorkerError, TransformationFailed, worker_ended
from sparktrain.pickling import dumps_code

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

Batch = Dict[str, Any]

_RECENT = 8  # results whose sizes estimate the next ones (the largest of them is used)
_POLL_SECONDS = 1.0  # longest wait between checks that every worker is still alive
_STOP_SECONDS = 5.0  # how long close() lets idle workers exit before terminating them


class DecodePool:
    """``fn`` applied to batches in ``workers`` processes; see the module docstring.

    ``seed``: with ``None`` a random seed is drawn once per pool (augmentations still do not
    depend on the number of workers). ``max_bytes``: bound on decoded bytes in flight or waiting
    in the parent. ``start_method``: ``"forkserver"`` or ``"spawn"``; ``None`` (or ``"fork"``,
    which is never used) picks ``forkserver`` on Linux, ``spawn`` elsewhere. ``name`` names
    ``fn`` in error messages. Not thread-safe. One ``map`` at a time: starting a map while an
    earlier one is unfinished drops the earlier one's batches in flight (resuming it raises).

    Example::

        pool = DecodePool(lambda b: {"x": b["x"] * 2}, workers=2, seed=0)
        try:
            [b["x"] for b in pool.map([{"x": np.arange(3)}])]   # [array([0, 2, 4])]
        finally:
            pool.close()
    """

    def __init__(self, fn: Callable[[Batch], Batch], workers: int, seed: Optional[int] = None,
                 max_bytes: int = 256 << 20, start_method: Optional[str] = None,
                 name: str = "transformation_fn") -> None:
        workers = operator.index(workers)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.fn = fn
        self.workers = workers
        self.max_bytes = int(max_bytes)
        self.name = name
        self.start_method = _start_method(start_method)
        # SeedSequence takes non-negative integers: fold any int into 64 bits
        self.seed = (secrets.randbits(64) if seed is None else int(seed)) % (1 << 64)
        self._prefix = f"{SHM_PREFIX}{os.getpid():x}_{secrets.token_hex(2)}_"
        self._procs: List[Any] = []
        self._results: List[Any] = []  # per worker: the parent's end of its result pipe
        self._senders: List[_Sender] = []
        self._floor: Any = None  # shared: tasks below it are skipped (an abandoned map's)
        self._owner: Dict[int, Tuple[int, int, int]] = {}  # task -> (worker, epoch, batch no.)
        self._load: List[int] = []  # tasks sent to each worker and not answered yet
        self._ready: Dict[int, Tuple[Any, int]] = {}  # task -> (result or _Failure, bytes)
        self._ready_bytes = 0
        self._sizes: Deque[int] = deque(maxlen=_RECENT)
        self._next_task = 0  # task ids grow over the pool's life: block names never repeat
        self._mapping = False  # a map generator has started and not finished
        self._generation = 0  # maps started: an unfinished map sees a later one took over
        self._closed = False
        self._broken: Optional[BaseException] = None  # the error that closed the pool

    # ---------------------------------------------------------------- public

    def map(self, batches: Iterable[Batch], epoch: int = 0) -> Iterator[Batch]:
        """``fn`` applied to every batch, yielded IN INPUT ORDER.

        Example::

            for batch in pool.map(reader.epoch(epoch), epoch):
                train_step(batch)
        """
        if self._closed:
            self._raise_closed()
        if not -(1 << 63) <= epoch < (1 << 63):
            raise ValueError(f"epoch {epoch} does not fit in 64 bits")
        if self._mapping:  # an earlier map left unfinished (and not yet collected): drop it
            self._abandon()
        self._start()
        self._mapping = True
        self._generation += 1
        generation = self._generation
        source = iter(batches)
        first = want = self._next_task
        exhausted = False
        batch: Optional[Batch]  # dropped once dispatched
        try:
            while True:
                if self._generation != generation:
                    raise RuntimeError("DecodePool.map: a later map on this pool took over "
                                       "from this one; its remaining batches were dropped")
                if self._closed:  # close() called while the consumer held this generator
                    self._raise_closed()
                while not exhausted and self._room(self._next_task - want):
                    try:
                        batch = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    self._dispatch(batch, epoch, self._next_task - first)
                    batch = None  # the worker has its own copy
                if want in self._ready:
                    result, nbytes = self._ready.pop(want)
                    self._ready_bytes -= nbytes
                    want += 1
                    if isinstance(result, _Failure):
                        self._fail(result.error)
                    yield result
                    result = None  # the consumer owns it now; do not pin it while waiting
                elif exhausted and want == self._next_task:
                    return
                else:
                    self._collect()
        except BaseException as exc:
            if not self._closed and self._generation == generation:
                if isinstance(exc, (GeneratorExit, Exception)):
                    self._abandon()  # stopped early, or the input raised: the pool lives on
                else:  # KeyboardInterrupt, SystemExit: stop everything now
                    self.close()
            raise
        finally:
            if self._generation == generation:
                self._mapping = False

    def close(self) -> None:
        """Stop and join the workers and unlink every shared memory block (idempotent)."""
        if self._closed:
            return
        self._closed = True
        procs, self._procs = self._procs, []
        try:
            for sender in self._senders:
                sender.stop()  # the worker reads end-of-file once the sender closes its pipe
            if not self._owner:  # idle workers exit on their own: give them a moment
                deadline = time.monotonic() + _STOP_SECONDS
                for proc in procs:
                    proc.join(max(0.0, deadline - time.monotonic()))
            for proc in procs:  # busy (results would be discarded anyway), hung, or dead
                if proc.exitcode is None:
                    proc.terminate()
            for proc in procs:
                proc.join(2.0)
                if proc.exitcode is None:
                    proc.kill()
                    proc.join()
            for sender in self._senders:
                sender.thread.join(1.0)  # a dead reader turns a blocked write into EPIPE
        finally:
            # answers never read: a worker may have created the block before it stopped
            for task in self._owner:
                discard_block(self._prefix + f"{task:x}")
            self._owner.clear()
            self._ready.clear()
            self._ready_bytes = 0
            for conn in self._results:
                conn.close()
            self._results, self._senders, self._load = [], [], []
            for proc in procs:
                try:
                    proc.close()
                except ValueError:  # still running after kill(): leave it to the OS
                    pass

    def __enter__(self) -> "DecodePool":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # a pool dropped without close(): stop its workers rather than leave them idle
        try:
            if self._procs and not self._closed:
                self.close()
        except Exception:
            pass

    # --------------------------------------------------------------- parent side

    def _start(self) -> None:
        """Start the workers (once)."""
        if self._procs:
            return
        try:
            fn_bytes = dumps_code(self.fn)
        except Exception as exc:
            raise TypeError(f"{self.name} cannot be sent to decode worker processes (it is "
                            f"pickled with cloudpickle): {type(exc).__name__}: {exc}") from exc
        # typeshed: a BaseContext for a str; _start_method gives "forkserver" or "spawn"
        ctx = cast("Union[ForkServerContext, SpawnContext]",
                   multiprocessing.get_context(self.start_method))
        if self.start_method == "forkserver":
            # imported once in the server, so each forked worker starts without importing them
            # (no effect when this process's fork server is already running)
            ctx.set_forkserver_preload(["sparktrain.data.decode_worker", "numpy", "cloudpickle"])
        self._floor = ctx.RawValue("q", 0)
        try:
            for index in range(self.workers):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=work, name=f"sparktrain-decode-{index}", daemon=True,
                                   args=(index, fn_bytes, self.seed, self._prefix, task_r,
                                         result_w, self._floor))
                try:
                    proc.start()
                finally:
                    # only the worker may hold these ends, so that either side sees
                    # end-of-file when the other goes
                    task_r.close()
                    result_w.close()
                self._procs.append(proc)
                self._results.append(result_r)
                self._senders.append(_Sender(task_w, f"sparktrain-decode-feed-{index}"))
                self._load.append(0)
        except BaseException:
            self.close()
            raise

    def _room(self, outstanding: int) -> bool:
        """Whether one more batch may be dispatched with ``outstanding`` not yet consumed."""
        if outstanding == 0:
            return True
        if outstanding >= 2 * self.workers or not self._sizes:
            return False  # no size measured yet: one batch until the first result tells
        unreceived = outstanding - len(self._ready)
        return self._ready_bytes + max(self._sizes) * (unreceived + 1) <= self.max_bytes

    def _dispatch(self, batch: Batch, epoch: int, number: int) -> None:
        """Send ``batch`` to the least loaded worker (pickled here, so errors surface here)."""
        body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        task = self._next_task
        worker = min(range(self.workers), key=self._load.__getitem__)
        self._owner[task] = (worker, epoch, number)
        self._load[worker] += 1
        self._next_task += 1
        self._senders[worker].put(HEADER.pack(task, epoch, number), body)

    def _collect(self) -> None:
        """Wait for one answer from any worker and file it; a dead worker raises."""
        if self._closed:
            self._raise_closed()
        readers = {conn: i for i, conn in enumerate(self._results)}
        sentinels = {proc.sentinel: i for i, proc in enumerate(self._procs)}
        while True:
            ready = connection.wait(list(readers) + list(sentinels), timeout=_POLL_SECONDS)
            for item in ready:
                if item in readers:
                    index = readers[item]
                    try:
                        # typeshed: wait() returns any of the kinds it takes; these are Pipe ends
                        message = cast(connection.Connection, item).recv()
                    except (EOFError, OSError):  # the worker's end closed: it is gone
                        self._lost(index)
                    self._file(index, message)
                    return
            # an ended worker whose pipe holds nothing more to read; checked on every timeout
            # too, in case a sentinel was missed
            for index, proc in enumerate(self._procs):
                if proc.exitcode is not None and not self._results[index].poll():
                    self._lost(index)

    def _file(self, worker: int, message: Tuple[Any, ...]) -> None:
        """Record a worker's answer: copy a result out of its block into ``_ready``."""
        kind, task = message[0], message[1]
        _, epoch, number = self._owner.pop(task)
        self._load[worker] -= 1
        discard = task < self._floor.value  # an abandoned map's
        if kind == "ok":
            _, _, block, layout, extra, nbytes = message
            if discard:
                if block is not None:
                    discard_block(block)
                return
            self._ready[task] = (unpack(block, layout, extra), nbytes)
            self._ready_bytes += nbytes
            self._sizes.append(nbytes)
        elif discard or kind == "skip":
            return
        elif kind == "error":
            _, _, exc_type, text, remote = message
            where = self._where(worker, epoch, number)
            error: BaseException = TransformationFailed(
                f"{self.name} raised {exc_type}: {text} ({where})\n\n"
                f"Traceback in the decode worker:\n{remote}", remote, exc_type)
            self._ready[task] = (_Failure(error), 0)
        else:  # "fatal": the worker could not deliver the result
            self._ready[task] = (_Failure(DecodeWorkerError(
                f"decode worker {worker} of {self.name} could not return batch {number} of "
                f"epoch {epoch}: {message[2]}")), 0)

    def _where(self, worker: int, epoch: int, number: int) -> str:
        pid = self._procs[worker].pid if worker < len(self._procs) else "?"
        return f"decode worker {worker}, pid {pid}, batch {number} of epoch {epoch}"

    def _lost(self, worker: int) -> NoReturn:
        """Raise :class:`DecodeWorkerError` for a worker that ended (and close the pool)."""
        proc = self._procs[worker]
        proc.join(1.0)  # the pipe closes a moment before the exit status is there
        doing = [f"batch {number} of epoch {epoch}"
                 for _, (w, epoch, number) in sorted(self._owner.items()) if w == worker]
        self._fail(worker_ended(worker, proc.pid, self.name, proc.exitcode,
                                doing[0] if doing else None))

    def _fail(self, error: BaseException) -> NoReturn:
        self._broken = error
        self.close()
        raise error

    def _raise_closed(self) -> NoReturn:
        if self._broken is not None:
            raise type(self._broken)(f"the decode pool was closed after an error: "
                                     f"{self._broken}")
        raise RuntimeError(f"the decode pool of {self.name} is closed")

    def _abandon(self) -> None:
        """Discard the batches in flight (workers skip those not started) and their blocks."""
        if self._floor is not None:
            self._floor.value = self._next_task
        try:
            while self._owner:
                self._collect()
        except (DecodeWorkerError, RuntimeError):
            pass  # the pool closed itself; the next map reports why
        self._ready.clear()
        self._ready_bytes = 0
        self._mapping = False


class _Failure:
    """An error standing in a batch's place until its turn comes."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Sender:
    """Feeds one worker's task pipe from a thread: a worker busy on a batch would otherwise
    block the parent in the middle of writing the next one (pipes hold 64 KB)."""

    def __init__(self, conn: Any, name: str) -> None:
        self.conn = conn
        self.items: "queue.SimpleQueue[Optional[Tuple[bytes, bytes]]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, header: bytes, body: bytes) -> None:
        self.items.put((header, body))

    def stop(self) -> None:
        while True:  # unsent tasks are dropped: their results would be discarded
            try:
                self.items.get_nowait()
            except queue.Empty:
                break
        self.items.put(None)

    def _run(self) -> None:
        try:
            while True:
                item = self.items.get()
                if item is None:
                    return
                self.conn.send_bytes(item[0])
                self.conn.send_bytes(item[1])
        except OSError:
            pass  # the worker is gone; the parent learns it from the process sentinel
        finally:
            self.conn.close()


def _start_method(method: Optional[str]) -> str:
    if method not in (None, "fork", "forkserver", "spawn"):
        raise ValueError(f"start_method={method!r}; expected 'forkserver' or 'spawn'")
    if method in (None, "fork"):  # fork copies the parent's held locks: never
        return "forkserver" if sys.platform.startswith("linux") else "spawn"
    return method
