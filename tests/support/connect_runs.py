"""One client process for several tests: it runs their scenarios one after the other and each
test waits for its own part (tests/test_connect.py).

The process (``argv``, run from the repository's root without ``SPARK_REMOTE`` and the other
variables that would put it in one mode or the other) prints, after each part, an end mark on
stderr (``end_mark.format(name)``) and then ``{<key>: name, "found": {...}}`` on stdout; a part's
stderr is what came between the previous part's end mark and its own.

Example::

    run = PartsRun([sys.executable, CLIENT, "readme,faults", url, workdir], "scenario",
                   connect_client.END_MARK)
    found, stderr = run.part("readme", timeout=540)
    run.close()
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def client_env(**more: str) -> Dict[str, str]:
    """This process's environment without what would choose the client's session for it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    env.update(more)
    return env


class PartsRun:
    """The process and the parts it has finished; ``explain()`` (optional) adds text to a
    failure's message (e.g. the Connect server's log)."""

    def __init__(self, argv: List[str], key: str, end_mark: str,
                 explain: Optional[Callable[[], str]] = None) -> None:
        self.key, self.end_mark, self.explain = key, end_mark, explain or (lambda: "")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=client_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.found: Dict[str, Any] = {}
        self.stderr: Dict[str, str] = {}
        self.stdout_tail: List[str] = []
        self.stderr_lines: List[str] = []  # since the last end mark
        self.all_stderr: List[str] = []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.stdout_tail = (self.stdout_tail + [line])[-40:]
                if line.startswith("{"):
                    try:
                        part = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(part, dict) and self.key in part:
                        self.found[part[self.key]] = part["found"]
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.changed:
                self.all_stderr.append(line)
                self.stderr_lines.append(line)
                for name in self._names_ended(line):
                    self.stderr[name] = "".join(self.stderr_lines)
                    self.stderr_lines = []
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _names_ended(self, line: str) -> List[str]:
        prefix, _, suffix = self.end_mark.partition("{}")
        text = line.rstrip("\n")
        if text.startswith(prefix) and text.endswith(suffix):
            return [text[len(prefix):len(text) - len(suffix)]]
        return []

    def part(self, name: str, timeout: float) -> Tuple[Dict[str, Any], str]:
        """``name``'s findings and its stderr, once the process has given both (within
        ``timeout`` seconds of this call); a failure shows where the process ended or hung."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not (name in self.found and name in self.stderr):
                ended = self.proc.poll() is not None and \
                    not any(reader.is_alive() for reader in self.readers)
                left = deadline - time.monotonic()
                if ended or left <= 0:
                    break
                self.changed.wait(min(left, 1.0))
            done = name in self.found and name in self.stderr
        if not done:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"part {name!r} did not end within {timeout:.0f}s (exit status "
                f"{self.proc.returncode}):\n" + "".join(self.stdout_tail)[-3000:] +
                "".join(self.all_stderr)[-12000:] + self.explain())
        return self.found[name], self.stderr[name]

    def close(self) -> None:
        """Wait a little for the process to end by itself (after its last part), then end it."""
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
