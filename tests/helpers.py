"""Builders shared by test modules."""
from __future__ import annotations

import os
import signal
from typing import Any


def linear_estimator(store: str, seed: int = 0, lr: float = 0.05, **overrides: Any):
    """A 2-rank ``TorchEstimator`` fitting ``Linear(4, 1)`` with SGD on the ``features`` /
    ``label`` columns of the ``regression_df`` fixture; any param can be overridden."""
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  random_seed=seed, store=store, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


class KillRankOnce:
    """A transformation_fn that SIGKILLs rank 1's Python worker at its ``at``-th batch, once
    per marker file (so the retried attempt runs through)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at, self.seen = marker, at, 0

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        self.seen += 1
        if BarrierTaskContext.get().partitionId() == 1 and self.seen == self.at \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


FAKE_GPU_DISCOVERY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "conf", "getGpusResources.sh")


def run_reporting_script(code: str, timeout: int, fake_gpus: str = "") -> tuple:
    """Run ``python -c code`` in its own process (e.g. a Spark session with another master):
    ``(the JSON it printed on its "RESULT " line, its stderr)``; fails with its output if it
    printed none.
    ``fake_gpus`` (``"0,1"``): the addresses ``FAKE_GPU_DISCOVERY`` announces."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(FAKE_GPU_DISCOVERY))
    env = dict(os.environ, SPARKTRAIN_FAKE_GPUS=fake_gpus) if fake_gpus else None

    def tails(stdout, stderr) -> str:  # the output's ends, without the JVM's stack frames
        stdout, stderr = (b.decode(errors="replace") if isinstance(b, bytes) else b or ""
                          for b in (stdout, stderr))
        return stdout[-3000:] + "\n".join(
            l for l in stderr.splitlines() if not l.lstrip().startswith("at "))[-6000:]

    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=timeout, cwd=root, env=env)
    except subprocess.TimeoutExpired as exc:  # its output so far says where it stuck
        raise AssertionError(f"the script ran past {timeout} s:\n"
                             + tails(exc.stdout, exc.stderr)) from None
    lines = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, tails(result.stdout, result.stderr)
    return json.loads(lines[0][len("RESULT "):]), result.stderr
