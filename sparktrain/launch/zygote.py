"""Python child processes forked from a template that has already imported TensorFlow.

Every Keras rank trains in a child process of its barrier task (TensorFlow's distributed runtime
cannot start twice in one process, :mod:`.tf_multiworker`). A fresh ``python`` spends ~9 CPU-s
importing TensorFlow and Keras before its first step (measured on a 2-core machine), and every
fit of a ``CrossValidator``, every elastic generation and every retried stage paid it again,
for each rank. Instead, each executor keeps a *template* process (a "zygote", as Android and
Chromium call theirs) that imported them once; each rank is ``fork()``-ed from it in
milliseconds, with the environment, working directory and output its task gives.

Why forking it is safe: ``fork()`` copies only the calling thread, so a process must not fork
while other threads hold state. The template imports modules and runs nothing else: no
TensorFlow op, context, thread pool, session or gRPC channel exists yet (TensorFlow creates
them at the first op); the only other threads are OpenBLAS's and Arrow's jemalloc background
thread, which both re-initialize after ``fork`` (``pthread_atfork``). The template is
single-threaded Python waiting in a ``select`` loop. GPU ranks start fresh processes (CUDA is
never initialized in the template, but this was not verified on a GPU machine).

Which template: the one of the requesting process's parent (a Spark Python worker's parent is
its executor's daemon, so all of an executor's workers share one), for the same Python, the
same modules and the same import-time environment (``TF_*``, ``KERAS_*``, ``PYTHON*``, ...);
it listens on an abstract Unix socket named after them and serves only its own user
(``SO_PEERCRED``). The first request starts it.

Lifetimes: the template exits when its owner (that parent) is gone or after ``IDLE_SECONDS``
without children; a child is killed when its requester's connection closes (the task died) and
dies with the template (``PR_SET_PDEATHSIG``). /proc shows a child the environment its template
started with (``os.environ`` is the requested one). ``SPARKTRAIN_FORK_TEMPLATE=0`` in the
executors' environment turns templates off (every child is a fresh ``python -m``).

Example (what :func:`~.tf_multiworker.start_tf_child` does)::

    child = start_python("sparktrain.loop.keras_loop", [workdir], env,
                         preload=("tensorflow", "keras"), stdout=subprocess.PIPE)
    for line in child.stdout: ...
    code = child.wait()
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union

IDLE_SECONDS = 300.0
OWNER_POLL_SECONDS = 2.0
START_SECONDS = 30.0
IMPORT_SECONDS = 300.0  # a template importing longer counts as broken: a fresh process then
SWITCH = "SPARKTRAIN_FORK_TEMPLATE"
DIE_WITH = "SPARKTRAIN_DIE_WITH"  # the pid of the process a child must die with
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
        if self.poll() is None:  # not reaped by its template yet: the pid is still its
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def template_name(preload: Sequence[str], env: Dict[str, str], owner: int) -> str:
    """The abstract Unix socket name of the template for ``owner``, ``preload`` and ``env``'s
    import-time part (one per executor: the owner of a Spark Python worker is its daemon)."""
    key = json.dumps([sys.executable, list(preload), import_time_environment(env)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return f"\0sparktrain-template-{os.getuid()}-{owner}-{digest}"


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        raise
    return sock


def _start_template(name: str, preload: Sequence[str], env: Dict[str, str],
                    owner: int) -> socket.socket:
    """Start a template listening on ``name`` (or find the one a racing process started) and
    return a connection to it."""
    process = subprocess.Popen(
        [sys.executable, "-m", __name__, name[1:], str(owner), *preload],
        env={k: v for k, v in env.items() if k not in _PER_CHILD}, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_SECONDS
    while True:  # it listens before importing anything: milliseconds
        try:
            return _connect(name)
        except OSError:
            if time.monotonic() > deadline or \
                    (process.poll() is not None and process.returncode != 0):
                raise OSError(f"the fork template did not start (exit code "
                              f"{process.poll()})") from None
            time.sleep(0.01)


def _fork(connection: socket.socket, module: str, args: List[str], env: Dict[str, str],
          out_fd: int) -> int:
    """Ask for a child on ``connection``; return its pid (its exit status comes later on the
    same connection)."""
    request = json.dumps({"module": module, "args": args, "env": env, "cwd": os.getcwd()})
    socket.send_fds(connection, [request.encode()], [out_fd])
    connection.settimeout(IMPORT_SECONDS)  # waits while the template is still importing
    data = connection.recv(_MESSAGE_BYTES)
    if not data:
        raise OSError("the fork template exited")
    return json.loads(data)["pid"]


def start_python(module: str, args: List[str], env: Dict[str, str], preload: Sequence[str],
                 stdout: Union[int, IO[Any]] = subprocess.PIPE) -> TemplateChild:
    """Run ``module.main(*args)`` in a child forked from a template that imported ``preload``
    (the template of this process's parent: started on first use, with ``env``), with ``env``
    as its environment and its output (stdout and stderr) to ``stdout``: ``subprocess.PIPE``
    (read it from ``child.stdout``) or an open file. ``module`` must define ``main``
    returning the exit status."""
    name = template_name(preload, env, os.getppid())
    if stdout == subprocess.PIPE:
        read_fd, out_fd = os.pipe()
    else:
        read_fd, out_fd = None, stdout.fileno()  # type: ignore[union-attr]
    try:
        for attempt in range(2):  # an idle template may exit just as it is asked
            try:
                connection = _connect(name)
            except OSError:
                connection = _start_template(name, preload, env, os.getppid())
            try:
                pid = _fork(connection, module, args, env, out_fd)
                break
            except OSError:
                connection.close()
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
    return TemplateChild(pid, connection, text)


# --- the template process (python -m sparktrain.launch.zygote FD MODULE...) ------------------

def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux ``PR_SET_PDEATHSIG``); called by forked
    children and, through :func:`die_with_starter`, by ``python -m`` children."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass


def dying_with_me(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` for a ``python -m`` child whose module calls :func:`die_with_starter` first: it
    then dies with this process. The safe twin of ``preexec_fn=die_with_parent``: Python's docs
    warn that ``preexec_fn`` is not safe in a process with threads (it runs Python between fork
    and exec, where a lock another thread held stays held), and Spark's workers have threads.

    Example: ``subprocess.Popen([sys.executable, "-m", module], env=dying_with_me(env))``"""
    return dict(env, **{DIE_WITH: str(os.getpid())})


def die_with_starter() -> None:
    """In a child started with :func:`dying_with_me`'s environment: die with that parent (and
    exit now if it died already); the variable is removed, so this child's own children do
    not inherit it."""
    parent = os.environ.pop(DIE_WITH, None)
    if parent is not None:
        die_with_parent()
        if os.getppid() != int(parent):  # the parent died before the prctl
            os._exit(1)


def _run_child(request: Dict[str, Any], out_fd: int, template_pid: int) -> None:
    """In the forked child: become the requested process, run it, exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        die_with_parent()
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


class _Server:
    """The template's loop: accept requesters (same user only), fork a child per request, send
    its pid and later its exit status; kill a child whose requester went away; stop when the
    owner process is gone or after ``IDLE_SECONDS`` without children."""

    def __init__(self, listener: socket.socket, owner: int) -> None:
        self.listener, self.owner = listener, owner
        self.selector = selectors.DefaultSelector()
        self.children: Dict[int, socket.socket] = {}  # pid -> its requester's connection
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "signal")
        self.idle_since = time.monotonic()

    def serve(self) -> None:
        while self._owner_alive() and \
                (self.children or time.monotonic() - self.idle_since < IDLE_SECONDS):
            for key, _ in self.selector.select(timeout=OWNER_POLL_SECONDS):
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    os.read(self.wakeup_r, 512)
                elif key.data == "request":
                    self._request(key.fileobj)  # type: ignore[arg-type]
                else:  # a requester's connection closed: it died, its child with it
                    self.selector.unregister(key.fileobj)
                    os.kill(key.data, signal.SIGKILL)  # not reaped yet: still its pid
            self._reap()
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)

    def _owner_alive(self) -> bool:
        try:
            os.kill(self.owner, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _accept(self) -> None:
        connection, _ = self.listener.accept()
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            struct.calcsize("3i"))
        if struct.unpack("3i", credentials)[1] != os.getuid():  # (pid, uid, gid)
            connection.close()
            return
        self.selector.register(connection, selectors.EVENT_READ, "request")

    def _request(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        try:
            message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 1)
        except OSError:
            message, fds = b"", []
        if not message or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        template_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            for sock in (self.listener, connection, *self.children.values()):
                sock.close()
            os.close(self.wakeup_r)
            _run_child(json.loads(message), fds[0], template_pid)
        os.close(fds[0])
        try:
            connection.send(json.dumps({"pid": pid}).encode())
        except OSError:
            pass  # its requester is gone: the next select sees the closed connection
        self.children[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, pid)

    def _reap(self) -> None:
        """Send the exit status of every child that ended to its requester."""
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            if connection.fileno() in self.selector.get_map():
                self.selector.unregister(connection)
            try:
                connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            connection.close()
            if not self.children:
                self.idle_since = time.monotonic()


def _main(name: str, owner: int, preload: List[str]) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + name)
    except OSError:  # another requester started this template first
        return
    listener.listen(64)  # requesters may connect now; they wait while the imports run
    import importlib

    for module in preload:
        importlib.import_module(module)
    _Server(listener, owner).serve()


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
