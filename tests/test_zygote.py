"""Children forked from a template process (sparktrain.launch.zygote), without Spark."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from sparktrain.launch import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "support.zygote_target"  # tests/support/zygote_target.py
PRELOAD = ("numpy", TARGET)


def _env(**extra):
    # a variable of this module's own: its templates are not other tests' (nor other workers')
    return dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]),
                PYTHON_ZYGOTE_TEST=str(os.getpid()), **extra)


def _run(*args, env=None, stdout=subprocess.PIPE):
    return zygote.start_python(TARGET, list(args), env or _env(), PRELOAD, stdout)


def _describe(env=None):
    child = _run("describe", env=env)
    found = child.stdout.read().split()
    assert child.wait() == 0
    return found


def test_child_runs_main_with_its_output_and_status():
    child = _run("echo", "hello", "there")
    assert child.stdout.read().splitlines() == ["hello there", "to stderr"]
    assert child.wait() == 0 and child.returncode == 0
    assert _run("exit", "3").wait() == 3
    failed = _run("raise")
    output = failed.stdout.read()
    assert failed.wait() == 1
    assert "Traceback" in output and "ValueError: raised in the child" in output


def test_children_share_one_template_and_get_their_own_environment(tmp_path):
    os.chdir(tmp_path)
    (cwd1, var1, parent1, draw1), (cwd2, var2, parent2, draw2) = \
        _describe(_env(CHILD_VAR="a")), _describe(_env(CHILD_VAR="b"))
    assert cwd1 == cwd2 == str(tmp_path) and (var1, var2) == ("a", "b")
    assert parent1 == parent2 != str(os.getpid())  # one template, not this process
    with open(f"/proc/{parent1}/cmdline") as f:
        assert "sparktrain.launch.zygote" in f.read()
    assert draw1 != draw2  # NumPy's global generator is seeded again in each child


def test_an_import_time_variable_gets_a_template_of_its_own():
    parents = [_describe(_env(OMP_NUM_THREADS=n))[2] for n in ("1", "2", "1")]
    assert parents[0] == parents[2] != parents[1]


def test_kill_wait_timeout_and_output_to_a_file(tmp_path):
    with open(tmp_path / "log", "w") as log:
        child = _run("sleep", "60", stdout=log)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    assert (tmp_path / "log").read_text() == "sleeping\n"


def test_a_child_dies_with_its_requester_and_the_template_with_its_owner():
    """owner (a process) -> requester (its child) -> child forked by the owner's template."""
    requester = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {HERE!r})
        from sparktrain.launch import zygote
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([{HERE!r}, *sys.path]))
        target = "support.zygote_target"
        child = zygote.start_python(target, ["sleep", "60"], env, (target,))
        assert child.stdout.readline() == "sleeping\\n"
        with open(f"/proc/{{child.pid}}/stat") as f:
            template = f.read().split(") ")[1].split()[1]
        print(child.pid, template, flush=True)
        time.sleep(60)
    """)
    owner = textwrap.dedent(f"""
        import subprocess, sys
        requester = subprocess.Popen([sys.executable, "-c", {requester!r}],
                                     stdout=subprocess.PIPE, text=True)
        print(requester.stdout.readline().strip(), requester.pid, flush=True)
        sys.stdin.readline()         # the test has looked: SIGKILL the requester
        requester.kill()
        requester.wait()
        sys.stdin.readline()         # the test saw the child die: the owner exits
    """)
    process = subprocess.Popen([sys.executable, "-c", owner], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    child, template, requester = map(int, process.stdout.readline().split())
    assert _alive(child) and _alive(template) and _alive(requester)
    process.stdin.write("\n")
    process.stdin.flush()
    _wait_dead(child, "the child outlived its requester")
    assert _alive(template), "the template must outlive one requester"
    process.stdin.write("\n")
    process.stdin.flush()
    assert process.wait(timeout=30) == 0
    _wait_dead(template, "the template outlived its owner")


def _wait_dead(pid, message, seconds=15):
    deadline = time.monotonic() + seconds
    while _alive(pid):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return False


def test_only_the_same_user_is_served_and_templates_can_be_switched_off(monkeypatch):
    _describe()  # the template is up
    name = zygote.template_name(PRELOAD, _env(), os.getppid())
    if os.getuid() == 0:  # another user asks it for a child: refused, nothing forked
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # only system calls here, then _exit
            try:
                os.setuid(65534)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.connect(name)
                request = {"module": "support.zygote_target", "args": ["exit", "0"], "env": {},
                           "cwd": "/"}
                socket.send_fds(sock, [json.dumps(request).encode()], [1])
                os.write(write_end, sock.recv(4096) or b"refused")
            except (BrokenPipeError, ConnectionResetError):  # closed before the request
                os.write(write_end, b"refused")
            except BaseException as exc:
                os.write(write_end, repr(exc).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        assert os.read(read_end, 4096) == b"refused"
    assert name.startswith(f"\0sparktrain-template-{os.getuid()}-{os.getppid()}-")
    assert zygote.template_name(PRELOAD, _env(OMP_NUM_THREADS="3"), os.getppid()) != name
    assert zygote.template_name(PRELOAD, _env(TF_CONFIG="{}"), os.getppid()) == name
    monkeypatch.setenv(zygote.SWITCH, "0")
    assert not zygote.enabled()


def test_a_python_child_started_dying_with_its_parent_dies_with_it():
    """``dying_with_me`` + ``die_with_starter``: the child of a SIGKILLed parent is killed too,
    without a ``preexec_fn`` (unsafe in a process with threads); its own children inherit
    nothing."""
    child_code = ("import os, time; from sparktrain.launch import zygote; "
                  "zygote.die_with_starter(); "
                  "print(os.getpid(), zygote.DIE_WITH in os.environ, flush=True); time.sleep(60)")
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from sparktrain.launch import zygote
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}],
                                 env=zygote.dying_with_me(dict(os.environ)), stdout=subprocess.PIPE,
                                 text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, env=_env())
    pid, inherited = parent.stdout.readline().split()
    assert inherited == "False" and _alive(int(pid))
    parent.kill()
    parent.wait()
    _wait_dead(int(pid), "the child outlived its SIGKILLed parent")
