"""Python child processes forked from a template that has already imported TensorFlow.

Every Keras rank trains in a child process of its barrier task (TensorFlow's distributed runtime
cannot start twice in one process, :mod:`.tf_multiworker`). A fresh ``python`` spends ~9 CPU-s
importing TensorFlow and Keras before its first step (measured on a 2-core machine), and every
fit of a ``CrossValidator``, every elastic generation and every retried stage paid it again,
for each rank. Instead, the task's Python worker keeps a *template* process (a "zygote", as
Android and Chromium call theirs) that imported them once; each rank is ``fork()``-ed from it
in milliseconds, with the environment, working directory and output the caller gives.

Why forking it is safe: ``fork()`` copies only the calling thread, so a process must not fork
while other threads hold state. The template imports modules and runs nothing else: no
TensorFlow op, context, thread pool, session or gRPC channel exists yet (TensorFlow creates
them at the first op); the only other threads are OpenBLAS's and jemalloc's, which both
re-initialize after ``fork`` (``pthread_atfork``). The template is single-threaded Python: it
waits in a ``select`` loop. GPU ranks start fresh processes (CUDA is never initialized in the
template, but this was not verified on a GPU machine).

Lifetimes: the template exits when its creator's end of the control socket closes (the Python
worker exited or was killed) or after ``IDLE_SECONDS`` without children; a child is killed when
its requester's socket closes (the task died) and dies with the template
(``PR_SET_PDEATHSIG``). ``SPARKTRAIN_FORK_TEMPLATE=0`` in the executors' environment turns
templates off (every child is a fresh ``python -m``).

Example (what :func:`~.tf_multiworker.start_tf_child` does)::

    child = start_python("sparktrain.estimators.keras_worker", [workdir], env,
                         preload=("tensorflow", "keras"), stdout=subprocess.PIPE)
    for line in child.stdout: ...
    code = child.wait()
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union

IDLE_SECONDS = 300.0
SWITCH = "SPARKTRAIN_FORK_TEMPLATE"
# Variables read when TensorFlow, Keras, NumPy or Python start: a template serves only requests
# whose environment has the values it started with. TF_CONFIG is read later, by each child,
# and a template starts without it.
_IMPORT_TIME_VARIABLES = ("TF_", "KERAS_", "PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_",
                          "CUDA_", "XLA_")
_PER_CHILD = ("TF_CONFIG",)
_MESSAGE_BYTES = 1 << 20


def import_time_environment(env: Dict[str, str]) -> Tuple[Tuple[str, str], ...]:
    """The part of ``env`` a process reads while importing (what a template must share)."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_TIME_VARIABLES) and k not in _PER_CHILD))


def enabled() -> bool:
    """Templates are used on Linux unless ``SPARKTRAIN_FORK_TEMPLATE=0``."""
    return sys.platform.startswith("linux") and os.environ.get(SWITCH, "1") != "0"


class TemplateChild:
    """A child forked by a template, with the part of ``subprocess.Popen``'s interface the
    launchers use: ``pid``, ``stdout`` (with ``stdout=PIPE``), ``poll``, ``wait``,
    ``send_signal``, ``kill``, ``returncode``."""

    def __init__(self, pid: int, reply: socket.socket, stdout: Optional[IO[str]]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None
        self._reply = reply

    def _read_exit(self, block: bool, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        self._reply.settimeout(timeout if block else 0.0)
        try:
            data = self._reply.recv(_MESSAGE_BYTES)
        except (BlockingIOError, socket.timeout):
            return None
        except OSError:
            data = b""
        # no message: the template itself died, and its children with it (PR_SET_PDEATHSIG)
        self.returncode = json.loads(data)["exit"] if data else -signal.SIGKILL
        self._reply.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._read_exit(block=False, timeout=None)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._read_exit(block=True, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"template child {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Template:
    """This process's handle on one template: its control socket and what it preloaded."""

    def __init__(self, preload: Tuple[str, ...], env: Dict[str, str]) -> None:
        self.preload = preload
        self.environment = import_time_environment(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), *preload],
                env={k: v for k, v in env.items() if k not in _PER_CHILD},
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.control = ours

    def fits(self, preload: Tuple[str, ...], env: Dict[str, str]) -> bool:
        return self.process.poll() is None and preload == self.preload and \
            import_time_environment(env) == self.environment

    def fork(self, module: str, args: List[str], env: Dict[str, str], out_fd: int) -> \
            Tuple[int, socket.socket]:
        """Ask for a child; return its pid and the socket its exit status arrives on."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            request = json.dumps({"module": module, "args": args, "env": env,
                                  "cwd": os.getcwd()}).encode()
            socket.send_fds(self.control, [request], [out_fd, theirs.fileno()])
        data = ours.recv(_MESSAGE_BYTES)  # blocks while the template is still importing
        if not data:
            ours.close()
            raise OSError("the fork template exited")
        return json.loads(data)["pid"], ours

    def close(self) -> None:
        self.control.close()
        self.process.wait()


_templates: List[_Template] = []
_lock = threading.Lock()


def start_python(module: str, args: List[str], env: Dict[str, str], preload: Sequence[str],
                 stdout: Union[int, IO[Any]] = subprocess.PIPE) -> TemplateChild:
    """Run ``module.main(*args)`` in a child forked from a template that imported ``preload``
    (started on first use, with ``env``), with ``env`` as its environment and its output
    (stdout and stderr) to ``stdout``: ``subprocess.PIPE`` (read it from ``child.stdout``) or
    an open file. ``module`` must define ``main`` returning the exit status."""
    key = tuple(preload)
    if stdout == subprocess.PIPE:
        read_fd, out_fd = os.pipe()
    else:
        read_fd, out_fd = None, stdout.fileno()  # type: ignore[union-attr]
    try:
        with _lock:
            for attempt in range(2):  # an idle template may exit just as it is asked
                template = next((t for t in _templates if t.fits(key, env)), None)
                if template is None:
                    template = _Template(key, env)
                    _templates.append(template)
                try:
                    pid, reply = template.fork(module, args, env, out_fd)
                    break
                except OSError:
                    _templates.remove(template)
                    template.close()
                    if attempt:
                        raise
    except BaseException:
        if read_fd is not None:
            os.close(read_fd)
        raise
    finally:
        if read_fd is not None:
            os.close(out_fd)
    text = os.fdopen(read_fd, "r", buffering=1) if read_fd is not None else None
    return TemplateChild(pid, reply, text)


# --- the template process (python -m sparktrain.launch.zygote FD MODULE...) ------------------

def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_child(request: Dict[str, Any], out_fd: int, template_pid: int) -> None:
    """In the forked child: become the requested process, run it, exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent()
        if os.getppid() != template_pid:  # the template died between fork and prctl
            os._exit(1)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        if "numpy" in sys.modules:  # a fresh process draws its own seed; forks share one
            sys.modules["numpy"].random.seed()
        import importlib

        code = importlib.import_module(request["module"]).main(*request["args"]) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what interpreter exit runs (e.g. closing reader pools)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(control: socket.socket, preload: List[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wakeup_r, selectors.EVENT_READ, "signal")
    children: Dict[int, socket.socket] = {}
    me = os.getpid()
    while True:
        events = selector.select(timeout=None if children else IDLE_SECONDS)
        if not events and not children:
            return  # idle
        for key, _ in events:
            if key.data == "control":
                try:
                    message, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 2)
                except OSError:
                    message, fds = b"", []
                if not message:  # our creator is gone: so are we, and our children
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
                out_fd, reply_fd = fds
                reply = socket.socket(fileno=reply_fd)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for s in (control, *children.values(), reply):
                        s.close()
                    os.close(wakeup_r)
                    os.close(wakeup_w)
                    _run_child(json.loads(message), out_fd, me)
                os.close(out_fd)
                reply.send(json.dumps({"pid": pid}).encode())
                children[pid] = reply
                selector.register(reply, selectors.EVENT_READ, pid)
            elif key.data == "signal":
                os.read(wakeup_r, 512)
                _reap(children, selector)
            else:  # a requester's socket: it never writes, so this is its end (it died)
                selector.unregister(key.fileobj)
                os.kill(key.data, signal.SIGKILL)  # not reaped yet, so the pid is still its
        _reap(children, selector)


def _reap(children: Dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Send the exit status of every child that ended to its requester."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        reply = children.pop(pid, None)
        if reply is None:
            continue
        if reply.fileno() in selector.get_map():
            selector.unregister(reply)
        try:
            reply.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass
        reply.close()


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
