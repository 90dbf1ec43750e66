"""Ctrl-C at many points of a fit, run and checked: shared by tests/test_interrupts.py (a
classic session) and tests/test_connect.py (over Spark Connect).

Example: ``check_interrupts(run_interrupts("classic", tmp_path, "torch", "mid_epoch"), 1)``
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "interrupt_client.py")
LIMIT_S = 15.0  # from the signal to the caller's KeyboardInterrupt, and to the ranks' stop


def run_interrupts(where: str, workdir, framework: str, points: str = "") -> dict:
    """tests/support/interrupt_client.py's findings: ``where`` is "classic" or a Connect URL,
    ``points`` the interrupt points to try (comma-separated; all when empty)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    result = subprocess.run([sys.executable, CLIENT, where, str(workdir), framework, points],
                            cwd=os.path.dirname(os.path.dirname(HERE)), env=env,
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_interrupts(found: dict, points: int) -> None:
    """Every one of ``points`` interrupted fits reached the caller and stopped its ranks within
    ``LIMIT_S``, and the fit after it resumed from its last checkpoint."""
    fits = found["fits"]
    assert len(fits) == points, fits
    for point, outcome in fits.items():
        assert "ended" not in outcome, (point, outcome)
        assert outcome["interrupt_to_caller_s"] < LIMIT_S, (point, outcome)
        assert outcome["ranks_stopped_after_s"] < LIMIT_S, (point, outcome)
        # the lock was free and the run resumed where its last checkpoint left it
        assert outcome["resumed_from"] == outcome["checkpoint_epochs"], (point, outcome)
        assert outcome["resumed_epochs"] == outcome["checkpoint_epochs"] + 1, (point, outcome)
    if "transform" in found:
        assert found["transform"].get("interrupt_to_caller_s", 99) < LIMIT_S, found["transform"]
