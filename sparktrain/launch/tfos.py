"""The ``tfos`` backend: TensorFlowOnSpark (``InputMode.TENSORFLOW``) for ``KerasEstimator``.

TensorFlowOnSpark (TFoS) 2.2.5 forms the TensorFlow cluster; sparktrain's Keras worker trains
in it, each node reading its own shard of the materialized Petastorm dataset (the same training
loop as ``backend="tensorflow"``):

1. the driver starts TFoS's reservation server and builds the cluster metadata as
   ``TFCluster.run(sc, fn, args, num_proc, num_ps=0, input_mode=InputMode.TENSORFLOW,
   master_node="chief")`` does: node 0 is ``chief:0``, node ``i`` is ``worker:i-1``;
2. one Spark barrier task per node runs TFoS's own node start-up, ``TFSparkNode.run``: it
   reserves a port, registers it with the server, waits for every node, and calls the main
   function with a ``TFNodeContext`` (``cluster_spec``, ``job_name``, ``task_index``);
3. the main function turns that into ``TF_CONFIG`` and trains in a child process
   (:func:`~sparktrain.launch.tf_multiworker.spawn_keras_worker`); rank 0 returns the model.

Spark re-runs a failed training stage as a whole (see :mod:`sparktrain.launch.barrier`); each
attempt gets a cluster of its own (its own reservation server and cluster id, as a new
``TFCluster.run`` would), so a node retried on another host cannot meet its old reservation
(TFoS's retry path matches reservations by host and node id, and a second one for the same node
fails its "Duplicate worker/task" check). The Keras worker resumes from the last checkpoint.

Only TFoS's driver side is replaced, because a fit must leave the user's session alone:
``TFCluster.run``/``shutdown`` stop the SparkContext and ``sys.exit(1)`` when a node fails,
keep the failure in a module-global dict that fails every later cluster of the process, install
a ``SIGALRM`` handler, poll in 5 s sleeps and drop the nodes' return values. Here the start job
is a barrier stage run by :func:`~sparktrain.launch.barrier.run_barrier` (rank logs, progress,
``TrainingError`` with the failing node's traceback, the job group cancelled on failure), and
the driver stops the reservation server in a ``finally``.

Example (what ``KerasEstimator._train`` does for an engine that ``launches_itself``)::

    result = TensorFlowOnSpark.launch(spark, 2, spec, payload_broadcast, use_gpu=False)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import socket
import tempfile
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from sparktrain.launch import import_quietly
from sparktrain.launch.barrier import run_barrier, stage_attempts
from sparktrain.launch.engine import KerasEngine
from sparktrain.launch.environment import rank_environment
from sparktrain.launch.gpus import worker_gpus
from sparktrain.launch.rank_context import RankContext
from sparktrain.launch.tf_multiworker import spawn_keras_worker
from sparktrain.options.spec import KerasTrainSpec
from sparktrain.session.spark_jvm import hadoop_conf

CHIEF = "chief"  # TFCluster.run's master_node: TFoS then exports TF_CONFIG with chief + workers


def _tfos(module: str) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TFSparkNode imports TensorFlow
    return import_quietly(f"tensorflowonspark.{module}")


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------

def cluster_template(num_nodes: int) -> Dict[str, list]:
    """TFCluster.run's template for ``num_ps=0, master_node="chief"``: node -> role."""
    template = {CHIEF: [0]}
    if num_nodes > 1:
        template["worker"] = list(range(1, num_nodes))
    return template


def _default_fs(sc: Any) -> str:
    """``fs.defaultFS`` as TFCluster.run passes it to the nodes (``TFNodeContext.defaultFS``)."""
    fs = hadoop_conf(sc, "fs.defaultFS")
    assert fs is not None  # Hadoop's core-default.xml sets it (file:///)
    return fs[:-1] if fs.startswith("file://") and len(fs) > 7 and fs.endswith("/") else fs


def start_reservations(sc: Any, num_nodes: int) -> Tuple[Any, Dict[str, Any]]:
    """Start TFoS's reservation server; return it and the cluster metadata for the nodes."""
    reservation = _tfos("reservation")
    server = reservation.Server(num_nodes)
    _, port = server.start()  # binds all interfaces (a port from TFOS_SERVER_PORT if set)
    # TFoS advertises the address its 8.8.8.8 probe finds; executors reach the driver at
    # spark.driver.host for sure (loopback in local mode). TFOS_SERVER_HOST still wins.
    host = os.environ.get(reservation.TFOS_SERVER_HOST) or \
        sc.getConf().get("spark.driver.host", None) or "127.0.0.1"
    meta = {"id": random.getrandbits(64), "cluster_template": cluster_template(num_nodes),
            "num_executors": num_nodes, "default_fs": _default_fs(sc),
            "working_dir": os.getcwd(), "server_addr": (host, port), "release_port": True}
    return server, meta


def stop_reservations(server: Any, address: Tuple[str, int]) -> None:
    """Stop the server's listener thread now, not at its next 60 s ``select`` timeout: set
    ``done`` (``Server.stop``) and wake the ``select`` with a connection, so the thread exits
    and closes the listening socket."""
    server.stop()
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        pass


def launch(spark: Any, num_proc: int, spec: KerasTrainSpec, payload: Any, use_gpu: bool,
           description: str = "sparktrain tfos", echo_logs: bool = True,
           on_progress: Any = None, max_attempts: Optional[int] = None,
           **where: Any) -> Any:
    """Train on a TFoS cluster of ``num_proc`` nodes; return rank 0's result.

    ``payload`` holds the pickled :class:`~sparktrain.options.payload.KerasPayload`
    (``.value``); ``where`` are :func:`~sparktrain.launch.barrier.run_barrier`'s
    ``workdir``/``storage_options``. Raises :class:`~sparktrain.errors.TrainingError` if a node
    fails (after up to
    ``max_attempts`` attempts); the SparkSession keeps working either way.
    """
    sc = spark.sparkContext
    attempts = min(max_attempts or stage_attempts(spark), stage_attempts(spark))
    clusters: List[Tuple[Any, Dict[str, Any]]] = []
    try:
        for _ in range(attempts):  # one per attempt of the stage: a thread and a socket each
            clusters.append(start_reservations(sc, num_proc))
        task = functools.partial(_node_task, spec, [m for _, m in clusters], payload, use_gpu)
        results = run_barrier(spark, num_proc, task, description=description,
                              echo_logs=echo_logs, on_progress=on_progress,
                              max_attempts=max_attempts, **where)
    finally:
        for server, meta in clusters:
            stop_reservations(server, meta["server_addr"])
    return results[0]


# ---------------------------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------------------------

def _node_task(spec: KerasTrainSpec, clusters: List[Dict[str, Any]], payload: Any,
               use_gpu: bool, ctx: RankContext) -> Any:
    with rank_environment(spec.backend_env):  # backend_env, inherited by the Keras worker
        return run_node(ctx, spec, payload.value, use_gpu, clusters)


def _stop_manager(node_module: Any) -> None:
    """Stop the node's TFManager. ``TFSparkNode.run`` starts one (a multiprocessing manager
    server process) for InputMode.SPARK's feed queues; InputMode.TENSORFLOW never uses it, and a
    node that Spark kills would leave the process behind. State ``'stopped'`` is what
    ``TFSparkNode.shutdown`` sets; ``mgr = None`` lets the next cluster in this Python worker
    start a fresh one (``run`` reads the old one's state first)."""
    mgr = node_module.TFSparkNode.mgr
    node_module.TFSparkNode.mgr = None
    if mgr is None:
        return
    try:
        mgr.set("state", "stopped")
        mgr.shutdown()
    except Exception:  # already gone
        pass


def node_tf_config(cluster_spec: Dict[str, list], job_name: str, task_index: int) -> str:
    """``TF_CONFIG`` from TFoS's node context (what TFoS exports itself when there is a chief)."""
    return json.dumps({"cluster": cluster_spec, "task": {"type": job_name, "index": task_index}})


def node_rank(job_name: str, task_index: int) -> int:
    """The training rank of a TFoS node: ``chief:0`` is 0, ``worker:i`` is ``i + 1``."""
    return 0 if job_name == CHIEF else task_index + 1


def run_node(ctx: RankContext, spec: KerasTrainSpec, payload: bytes, use_gpu: bool,
             clusters: List[Dict[str, Any]]) -> Any:
    """One TFoS node in barrier task ``ctx.rank``: TFoS's node start-up, then the Keras worker
    (``clusters``: the cluster metadata of each attempt, :func:`start_reservations`'s).

    The task's process is a Spark Python worker that later tasks reuse, so what TFoS changes in
    it is undone afterwards: its working directory (TFoS writes an ``executor_id`` file there,
    which in local mode is the driver's own directory), ``TF_CONFIG`` and
    ``CUDA_VISIBLE_DEVICES`` (TFoS exports both), and the TFManager.
    """
    spec = replace(spec, attempt=ctx.attempt)
    meta = clusters[min(ctx.attempt, len(clusters) - 1)]
    node_module = _tfos("TFSparkNode")
    result: Dict[str, Any] = {}

    def main_fun(args: argparse.Namespace, node: Any) -> None:  # TFoS's (tf_args, ctx)
        _stop_manager(node_module)
        rank = node_rank(node.job_name, node.task_index)
        if rank != ctx.rank or node.executor_id != ctx.rank:
            raise RuntimeError(f"TFoS node {node.executor_id} ({node.job_name}:"
                               f"{node.task_index}) is not barrier task {ctx.rank}")
        if rank == 0 and args.verbose >= 1:
            print(f"TensorFlowOnSpark cluster: {json.dumps(node.cluster_spec)}", flush=True)
        # sparktrain's GPU rule: the child sees the GPUs Spark gave this task, or none
        result["value"] = spawn_keras_worker(
            rank, ctx.world_size, node_tf_config(node.cluster_spec, node.job_name, node.task_index),
            args.spec, payload, worker_gpus(ctx.resources, use_gpu), ctx.progress)

    saved_env = {key: os.environ.get(key) for key in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
    cwd = os.getcwd()
    workdir = tempfile.mkdtemp(prefix=f"sparktrain-tfos-node{ctx.rank}-")
    os.chdir(workdir)
    try:
        # tf_args: a Namespace, not a list (TFoS would make a list the worker's sys.argv), with
        # num_gpus=0: else, when Spark assigned no GPU to the task but nvidia-smi lists some,
        # TFoS picks a free one itself (and sleeps 30 s, 60 s, 90 s, then fails, when none is
        # free). background=False: main_fun runs in this task (InputMode.TENSORFLOW).
        args = argparse.Namespace(num_gpus=0, spec=spec, verbose=spec.verbose)
        start = node_module.run(main_fun, args, meta, False, None, ["error"], False)
        start(iter([ctx.rank]))  # the node RDD's partition holds its executor_id: the rank
    finally:
        _stop_manager(node_module)
        os.chdir(cwd)
        shutil.rmtree(workdir, ignore_errors=True)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result["value"]


class TensorFlowOnSpark(KerasEngine):
    """The registry's entry for ``backend="tfos"``: it starts its own cluster around the Spark
    job (``launch``, driver side); :func:`run_node` is one node. It forms the cluster itself
    (chief + workers), so ``KerasStrategy.roles`` and ``run_task`` are not asked (strategies
    that need them, ``KerasStrategy.engine_needs``, do not train here)."""

    launches_itself = True
    streams_rows = False  # TFoS's InputMode.TENSORFLOW: the nodes read the store themselves
    elastic = False
    not_elastic_note = "TensorFlowOnSpark's cluster is reserved once with num_proc nodes for " \
                       "the whole fit"
    runs_strategy_roles = False
    needs_classic_session = True
    classic_session_note = "TensorFlowOnSpark starts its reservation server through the " \
                           "SparkContext"
    launch = staticmethod(launch)
