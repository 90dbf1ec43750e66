"""Children forked from a template process (sparktrain.launch.zygote), without Spark."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparktrain.launch import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = ("numpy", "zygote_target")


def _env(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]), **extra)


def _run(*args, env=None, stdout=subprocess.PIPE):
    return zygote.start_python("zygote_target", list(args), env or _env(), PRELOAD, stdout)


@pytest.fixture(autouse=True)
def _no_templates_left():
    yield
    for template in list(zygote._templates):
        template.close()
    zygote._templates.clear()


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
    outputs = []
    for value in ("a", "b"):
        os.chdir(tmp_path)
        child = _run("describe", env=_env(CHILD_VAR=value))
        outputs.append(child.stdout.read().split())
        assert child.wait() == 0
    (cwd1, var1, parent1, draw1), (cwd2, var2, parent2, draw2) = outputs
    assert cwd1 == cwd2 == str(tmp_path) and (var1, var2) == ("a", "b")
    [template] = zygote._templates
    assert int(parent1) == int(parent2) == template.process.pid
    assert draw1 != draw2  # NumPy's global generator is seeded again in each child


def test_an_import_time_variable_gets_a_template_of_its_own():
    for threads in ("1", "2", "1"):
        assert _run("exit", "0", env=_env(OMP_NUM_THREADS=threads)).wait() == 0
    assert len(zygote._templates) == 2


def test_kill_wait_timeout_and_output_to_a_file(tmp_path):
    with open(tmp_path / "log", "w") as log:
        child = _run("sleep", "60", stdout=log)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    assert (tmp_path / "log").read_text() == "sleeping\n"


def test_children_die_with_their_requester_and_templates_with_their_creator(tmp_path):
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        sys.path.insert(0, {HERE!r})
        from sparktrain.launch import zygote
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([{HERE!r}, *sys.path]))
        child = zygote.start_python("zygote_target", ["sleep", "60"], env, ("zygote_target",))
        assert child.stdout.readline() == "sleeping\\n"
        print(child.pid, zygote._templates[0].process.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    requester = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=60)
    assert requester.returncode == -9, requester.stderr
    child, template = map(int, requester.stdout.split())
    deadline = time.monotonic() + 10
    while _alive(child) or _alive(template):
        assert time.monotonic() < deadline, "the child or its template outlived the requester"
        time.sleep(0.05)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_templates_are_off_with_the_switch(monkeypatch):
    monkeypatch.setenv(zygote.SWITCH, "0")
    assert not zygote.enabled()
