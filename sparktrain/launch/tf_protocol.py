"""What a Spark task and its TensorFlow child process exchange: the spec and the workdir files.

A leaf module (no TensorFlow; of sparktrain only the leaf :mod:`sparktrain.options.spec`): the
estimator builds a :class:`KerasTrainSpec`, the launchers (:mod:`.tf_multiworker`,
:mod:`.tf_parameter_server`, :mod:`.tfos`) write it with the pickled payload into a directory,
and the child (``python -m sparktrain.loop.keras_loop DIR``) answers through the files
named here.

Example::

    write_inputs(workdir, replace(spec, rank=1, world_size=2), payload_bytes)
    spec = read_spec(workdir)          # in the child
"""
from __future__ import annotations

import json
import os
from typing import Any

from sparktrain.options.spec import KerasTrainSpec

WORKER_MODULE = "sparktrain.loop.keras_loop"  # the child: python -m WORKER_MODULE DIR
SPEC_FILE = "spec.json"
PAYLOAD_FILE = "payload.pkl"
RESULT_FILE = "result.pkl"  # the training process's result (pickled)
ERROR_FILE = "error.txt"  # its traceback, when it failed
USER_ERROR_FILE = "user_error.txt"  # where the user's code raised the error, if it did
READY = "ready"  # written by a serving process once its server is up
SHARD_INFO = "shard.json"  # written by a serving process that prepared data for the trainer
PROGRESS_PREFIX = "\x1esparktrain-progress "  # a stdout line carrying a progress event


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
