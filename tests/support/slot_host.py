"""One long-lived Python process holding one ``local[4]`` SparkSession (the slot host), for the
scenarios that need more task slots than the test session's ``local[2]``, or a Spark driver
process other than the test worker's: they run in it one after the other instead of each
starting a driver JVM of its own.

A scenario is a module-level function ``fn(spark, *args, **kwargs)`` returning something JSON
can carry; the tests name it ``"module:function"`` (modules under ``tests/`` or
``tests/support/``)::

    def test_x(slot_host, tmp_path):  # the fixture (tests/conftest.py imports it)
        result = slot_host.call("support.ps_scenarios:run", "fit", str(tmp_path))
        pending = slot_host.submit("test_concurrency:fit_generated", ...)  # runs meanwhile
        pending.result(timeout=400)

4 slots serve the scenarios that need 1 or 3 by asking for fewer ranks (``num_proc``); one that
must see slots missing asks for more than 4 (``spark.sparktrain.slotWaitSeconds`` is 1 here, as
in the test session). Calls run one at a time, in the order they come; a scenario that fails
raises :class:`ScenarioError` with its traceback and leaves the host running; one that outlives
its timeout stops the host (the next call starts a new one). The process exits when the test
worker closes its stdin (at the end of the session, or when the worker dies), and its JVM with
it. Every test file that uses the fixture shares the same process within a pytest worker.

Run by hand: ``python tests/support/slot_host.py`` reads JSON requests from stdin.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Any, Optional

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
MASTER = "local[4]"
CONF = {
    "spark.ui.enabled": "false",
    "spark.sparktrain.slotWaitSeconds": "1",  # as the test session: a missing slot fails at once
    "spark.default.parallelism": "4",
    "spark.stage.maxConsecutiveAttempts": "3",  # Spark retries a failed training stage
}


class ScenarioError(AssertionError):
    """A scenario raised in the slot host; the message holds its traceback."""


# -- the host process ------------------------------------------------------------------------

def serve() -> None:
    """Start the session, say ``{"ready": pid}``, then answer one JSON request per line of
    stdin (``{"target": "module:function", "args": [...], "kwargs": {...}}``) with one JSON
    line (``{"ok": true, "result": ...}`` or ``{"ok": false, "error": traceback}``) until
    stdin closes."""
    # the answers get this process's stdout to themselves: what the scenarios, Spark's JVM and
    # the ranks print goes to stderr (fd 1 is taken over before the JVM starts and inherits it)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.path[:0] = [ROOT, TESTS]
    from sparktrain import local_spark

    spark = local_spark(MASTER, app_name="sparktrain-slot-host", conf=CONF)
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            try:
                module, name = request["target"].split(":")
                function = getattr(importlib.import_module(module), name)
                answer = {"ok": True, "result": function(spark, *request.get("args", []),
                                                         **request.get("kwargs", {}))}
                answer = json.loads(json.dumps(answer))  # not JSON: an error, below
            except BaseException:  # noqa: BLE001 - a scenario's failure goes to the test
                answer = {"ok": False, "error": traceback.format_exc()}
            answers.write(json.dumps(answer) + "\n")
    finally:
        spark.stop()


# -- the test worker's side ------------------------------------------------------------------

class SlotHost:
    """The client of one slot host process (see the module's docstring)."""

    def __init__(self, start_timeout: float = 240.0) -> None:
        self.log_path = tempfile.mkstemp(prefix="sparktrain-slot-host-", suffix=".log")[1]
        self._lock = threading.Lock()
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], cwd=ROOT, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS])))
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(start_timeout)

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close(remove_log=False)
            raise AssertionError(f"the slot host gave no answer in {timeout:.0f}s; "
                                 f"its log ({self.log_path}):\n{self.log_tail()}") from None
        if line is None:
            self.close(remove_log=False)
            raise AssertionError(f"the slot host exited ({self.process.poll()}); "
                                 f"its log ({self.log_path}):\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except FileNotFoundError:
            return "(removed)"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, target: str, *args: Any, timeout: float = 600.0, **kwargs: Any) -> Any:
        """Run ``target(spark, *args, **kwargs)`` in the host; its result, or ScenarioError."""
        with self._lock:
            if not self.alive:
                raise AssertionError(f"the slot host is not running; its log:\n"
                                     f"{self.log_tail()}")
            self.process.stdin.write(json.dumps({"target": target, "args": list(args),
                                                 "kwargs": kwargs}) + "\n")
            self.process.stdin.flush()
            answer = self._answer(timeout)
        if not answer["ok"]:
            raise ScenarioError(f"{target} failed in the slot host:\n{answer['error']}")
        return answer["result"]

    def submit(self, target: str, *args: Any, timeout: float = 600.0,
               **kwargs: Any) -> "concurrent.futures.Future":
        """:meth:`call` in a thread of this process: the test goes on while the host runs it."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.call(target, *args, timeout=timeout, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return future

    def close(self, timeout: float = 60.0, remove_log: bool = True) -> None:
        """Close its stdin (it stops its session and exits); kill it if it does not. Its log
        goes with it, unless it failed (then the log stays for whoever reads the error)."""
        if self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if remove_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)


_HOST: Optional[SlotHost] = None


def shared_host() -> SlotHost:
    """This pytest process's slot host, started on first use (again if the last one died)."""
    global _HOST
    if _HOST is None or not _HOST.alive:
        _HOST = SlotHost()
        atexit.register(_HOST.close)
    return _HOST


@pytest.fixture(scope="session")
def slot_host() -> SlotHost:
    """The worker's slot host (a fixture of every test file: tests/conftest.py imports it),
    one process for every file that uses it, closed when pytest exits."""
    return shared_host()


if __name__ == "__main__":
    serve()
