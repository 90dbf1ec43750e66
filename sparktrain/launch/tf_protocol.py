"""What a Spark task and its TensorFlow child process exchange: the spec and the workdir files.

A leaf module (no TensorFlow; of sparktrain only the leaf :mod:`sparktrain.loop_spec`): the
estimator builds a :class:`KerasTrainSpec`, the launchers (:mod:`.tf_multiworker`,
:mod:`.tf_parameter_server`, :mod:`.tfos`) write it with the pickled payload into a directory,
and the child (``python -m sparktrain.estimators.keras_worker DIR``) answers through the files
named here.

Example::

    write_inputs(workdir, replace(spec, rank=1, world_size=2), payload_bytes)
    spec = read_spec(workdir)          # in the child
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from sparktrain.loop_spec import LoopSpec

WORKER_MODULE = "sparktrain.estimators.keras_worker"  # the child: python -m WORKER_MODULE DIR
SPEC_FILE = "spec.json"
PAYLOAD_FILE = "payload.pkl"
RESULT_FILE = "result.pkl"  # the training process's result (pickled)
ERROR_FILE = "error.txt"  # its traceback, when it failed
USER_ERROR_FILE = "user_error.txt"  # where the user's code raised the error, if it did
READY = "ready"  # written by a serving process once its server is up
SHARD_INFO = "shard.json"  # written by a serving process that prepared data for the trainer
PROGRESS_PREFIX = "\x1esparktrain-progress "  # a stdout line carrying a progress event


@dataclass(kw_only=True)
class KerasTrainSpec(LoopSpec):
    """One Keras fit's :class:`~sparktrain.loop_spec.LoopSpec`, plus what the Keras loop and
    the launchers add; written to the child process as JSON (``spec.json``)."""

    best_model: Optional[Dict[str, Any]] = None  # checkpoint_callback's settings, see keras_checkpoint
    strategy_options: Dict[str, Any] = field(default_factory=dict)  # KerasStrategy.check's
    # set by the launcher for each process
    rank: int = 0
    world_size: int = 1
    attempt: int = 0
    role: str = ""  # "": the training loop; else a serving role of the strategy's cluster
    launch_info: Dict[str, Any] = field(default_factory=dict)  # what the launch gathered


def write_inputs(workdir: str, spec: KerasTrainSpec, payload: bytes) -> None:
    """The child's inputs: ``spec.json`` and ``payload.pkl`` in ``workdir``."""
    with open(os.path.join(workdir, SPEC_FILE), "w") as f:
        f.write(spec.to_json())
    with open(os.path.join(workdir, PAYLOAD_FILE), "wb") as f:
        f.write(payload)


def read_spec(workdir: str) -> KerasTrainSpec:
    with open(os.path.join(workdir, SPEC_FILE)) as f:
        return KerasTrainSpec.from_json(f.read())


def progress(**event: Any) -> None:
    """Report a progress event to the task (one stdout line it relays to the driver)."""
    print(PROGRESS_PREFIX + json.dumps(event), flush=True)
