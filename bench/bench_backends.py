#!/usr/bin/env python
"""Benchmark TorchEstimator's distributed backends against each other and the horovod backend's
launch against ``horovod.spark.run``, in one process and one Spark session.

    .venv/bin/python bench/bench_backends.py                     # 200,000 rows, every figure
    .venv/bin/python bench/bench_backends.py --rows 20000 --repeats 1 --skip overhead

Figures (bench/README.md: method and figures; bench/HISTORY.md: the full write-up):

  throughput:<backend>  steady-state samples/s of the same 2-rank job (MLP 32->64->64->2,
                        batch 256/rank, shuffle=True) with TorchEstimator(backend=<backend>),
                        against backend="torch" (DDP over Gloo). One epoch's seconds: the gaps
                        between rank 0's epoch-end log lines as they reach the driver, epochs
                        2..E of E-epoch fits, median (cross-check: (E-epoch fit - 1-epoch fit) /
                        (E - 1)). Extras: a per-step breakdown run inside the barrier tasks
                        (compute, wrapped step, all-reduce, CPU per step, idle CPU) that says
                        what limits a slower backend. KerasEstimator's backends
                        (tensorflow, tfos) train the same MLP in Keras 3, timed the same way.
  overhead:horovod      wall time of a warm 1-step 2-rank fit with backend="horovod" against
                        horovod.spark.run(fn, num_proc=2) running the same step
                        (extra: the torch backend's 1-step fit)

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_backends.json).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import statistics
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from common import (
    add_common_args,
    add_frame_args,
    arg_meta,
    cached,
    figure,
    guarded,
    hang_extras,
    load_meta,
    load_note,
    local_session,
    make_frame,
    new_parser,
    parse_common,
    progress,
    quiet_warnings,
    report,
    sparktrain_logs,
    versions,
)

FIGURES = ("throughput", "overhead")
# Backends measured (TorchEstimator's torch/horovod, KerasEstimator's tensorflow/tfos); "torch"
# is the baseline. KERAS_PLANNED are reported as rows without numbers until sparktrain has them.
BACKENDS = ("torch", "horovod", "tensorflow", "tfos")
KERAS_BACKEND_NAMES = ("tensorflow", "tfos")
KERAS_PLANNED: Tuple[str, ...] = ()
HIDDEN, CLASSES = 64, 2
LR = 0.05


# -- model: the same for every backend and for horovod.spark.run --------------------------------
def make_mlp(features: int):
    """``features -> 64 -> 64 -> 2`` MLP with ReLUs."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(features, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def make_keras_mlp(features: int):
    """The same ``features -> 64 -> 64 -> 2`` MLP in Keras 3."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def make_estimator(backend: str, features: int, batch_size: int, epochs: int, shuffle: bool,
                   store: str):
    if backend in KERAS_BACKEND_NAMES:
        import keras

        from sparktrain import KerasEstimator

        return KerasEstimator(
            num_proc=2, model=make_keras_mlp(features), optimizer=keras.optimizers.SGD(LR),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            feature_cols=["features"], label_cols=["label"], batch_size=batch_size,
            epochs=epochs, shuffle=shuffle, random_seed=0, verbose=1, store=store,
            backend=backend)
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(0)
    net = make_mlp(features)
    # verbose=1: rank 0 sends "N steps/epoch" and per-epoch lines to the driver's
    # "sparktrain.rank" logger, which RankLog captures (they are not printed)
    return TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
                          loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                          label_cols=["label"], batch_size=batch_size, epochs=epochs,
                          shuffle=shuffle, random_seed=0, verbose=1, store=store, backend=backend)


class RankLog(logging.Handler):
    """Collects the rank log lines the driver receives during a fit (``sparktrain.rank``), with
    the time each one arrived. Rank 0 sends ``epoch k/E ... (X.Xs)`` the moment epoch k ends
    (after its metrics all-reduce), so the gaps between those arrivals are epoch durations
    measured on the driver's clock, free of launch and teardown costs."""

    EPOCH = re.compile(r"^\[rank 0\] epoch (\d+)/(\d+) ")
    STEPS = re.compile(r"^\[rank 0\] .*: (\d+) steps/epoch of (\d+) rows per rank$")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: List[Tuple[float, str]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.lines.append((record.created, record.getMessage()))

    def take(self) -> List[Tuple[float, str]]:
        with self._lock:
            lines, self.lines = self.lines, []
        return lines

    @classmethod
    def epoch_durations(cls, lines: List[Tuple[float, str]]) -> List[float]:
        """Seconds of epochs 2..E: gaps between the arrivals of consecutive epoch-end lines."""
        ends = {int(m.group(1)): created for created, m in
                ((created, cls.EPOCH.match(text)) for created, text in lines) if m}
        return [ends[k] - ends[k - 1] for k in sorted(ends) if k - 1 in ends]

    @classmethod
    def steps(cls, lines: List[Tuple[float, str]]) -> Optional[int]:
        found = [int(m.group(1)) for m in (cls.STEPS.match(text) for _, text in lines) if m]
        return found[0] if found else None


# -- figure 1: steady-state throughput per backend ----------------------------------------------
def bench_throughput(spark, df, tmp: str, args, state: Dict[str, Any]) -> List[Dict[str, Any]]:
    from sparktrain.data.reader import steps_per_epoch

    rows, epochs, repeats = args.rows, args.epochs, args.repeats
    backends = args.backends  # "torch" first: the baseline
    store = os.path.join(tmp, "store-throughput")  # one store: the frame is materialized once
    estimators = {(b, e): make_estimator(b, args.features, args.batch_size, e, True, store)
                  for b in backends for e in (1, epochs)}
    steps = steps_per_epoch(rows, 2, args.batch_size)
    log, hangs, limit = state["rank_log"], state["hangs"], args.fit_timeout
    runs: Dict[str, Dict[str, List]] = {b: {"fit_1_s": [], f"fit_{epochs}_s": [],
                                            "epoch_s": [], "final_loss": []}
                                        for b in backends}

    def fit(backend: str, n_epochs: int, label: str):
        log.take()
        seconds, model = guarded(spark, lambda: estimators[backend, n_epochs].fit(df), limit,
                                 label, hangs)
        history = model.getHistory()["loss"]
        if len(history) != n_epochs:
            raise AssertionError(f"{label}: {len(history)} epochs in the history, expected "
                                 f"{n_epochs}")
        lines = log.take()
        logged_steps = RankLog.steps(lines)
        if logged_steps is not None and logged_steps != steps:
            raise AssertionError(
                f"{label}: rank 0 ran {logged_steps} steps/epoch, expected {steps}")
        durations = RankLog.epoch_durations(lines)
        if len(durations) != n_epochs - 1:
            raise AssertionError(f"{label}: got {len(durations)} epoch durations from rank 0's "
                                 f"epoch lines, expected {n_epochs - 1}")
        return seconds, history, durations

    for backend in backends:  # the first one also materializes the frame into the store
        progress(f"throughput: warm-up {epochs}-epoch fit, backend={backend!r}")
        seconds, _, _ = fit(backend, epochs, f"throughput: {backend} warm-up fit")
        progress(f"throughput: warm-up {backend}: {seconds:.2f}s")
    for i in range(repeats):
        # alternate backends (and their order) so that load from other processes hits both alike
        order = backends if i % 2 == 0 else tuple(reversed(backends))
        for backend in order:
            for n_epochs in (1, epochs):
                seconds, history, durations = fit(
                    backend, n_epochs, f"throughput: {backend} {n_epochs}-epoch fit {i + 1}")
                runs[backend][f"fit_{n_epochs}_s"].append(seconds)
                if n_epochs == epochs:
                    runs[backend]["epoch_s"].extend(durations)
                    runs[backend]["final_loss"].append(history[-1])
                progress(f"throughput: {backend} {n_epochs}-epoch fit {i + 1}/{repeats}: "
                         f"{seconds:.2f}s" + (f" (epochs 2..{epochs}: "
                                              f"{', '.join(f'{d:.3f}s' for d in durations)})"
                                              if durations else ""))

    summary: Dict[str, Dict[str, Any]] = {}
    for backend in backends:
        r = runs[backend]
        epoch_s = statistics.median(r["epoch_s"])
        t1, te = statistics.median(r["fit_1_s"]), statistics.median(r[f"fit_{epochs}_s"])
        diff_epoch_s = (te - t1) / (epochs - 1)
        summary[backend] = {
            "epoch_s": epoch_s, "samples_per_s": rows / epoch_s, "step_ms": epoch_s / steps * 1e3,
            "fit_1_s": t1, f"fit_{epochs}_s": te, "diff_epoch_s": diff_epoch_s,
            "diff_samples_per_s": rows / diff_epoch_s if diff_epoch_s > 0 else None,
            "fixed_s": te - epochs * epoch_s,  # launch, setup, first-epoch extras, teardown
        }
        progress(f"throughput: {backend}: epoch {epoch_s:.3f}s = {rows / epoch_s:,.0f} samples/s; "
                 f"cross-check (fit_{epochs} {te:.2f}s - fit_1 {t1:.2f}s) / {epochs - 1} = "
                 f"{diff_epoch_s:.3f}s")

    breakdown = step_breakdown(spark, args, state) if args.diag_steps > 0 else {}

    base = summary["torch"]
    measure = (f"steady-state samples/s = {rows:,} rows / epoch s; epoch s = median over "
               f"{repeats} {epochs}-epoch fits of epochs 2..{epochs} (gaps between rank 0's "
               f"epoch-end lines on the driver); 2 ranks, MLP {args.features}->{HIDDEN}->"
               f"{HIDDEN}->{CLASSES}, batch {args.batch_size}/rank ({steps} steps/rank/epoch), "
               f"shuffle=True")
    baseline_name = "TorchEstimator(backend='torch'): DDP over Gloo"
    results = []
    for backend in backends[1:]:
        s = summary[backend]
        extras: Dict[str, Any] = {}
        for name, entry in (("torch", base), (backend, s)):
            extras[f"{name}: wall of the {epochs}-epoch fit"] = {
                "value": entry[f"fit_{epochs}_s"], "unit": "s",
                "note": f"= {epochs} x {entry['epoch_s']:.3f}s epochs + {entry['fixed_s']:.2f}s "
                        f"fixed; 1-epoch fit {entry['fit_1_s']:.2f}s"}
        for name, entry in (("torch", base), (backend, s)):
            extras[f"{name}: cross-check (fit_{epochs} - fit_1) / {epochs - 1}"] = {
                "value": entry["diff_samples_per_s"], "unit": "samples/s",
                "note": f"epoch {entry['diff_epoch_s']:.3f}s (difference of two medians: "
                        f"noisier)"}
        for name, entry in (("torch", base), (backend, s)):
            extras[f"{name}: time per step in the fit (epoch s / {steps})"] = {
                "value": entry["step_ms"], "unit": "ms"}
        for name, entry in breakdown.items():
            if name == "torch" or name.startswith(backend):
                extras[f"in-memory step, {name}"] = {
                    "value": entry["step_ms"], "unit": "ms",
                    "note": f"compute alone {entry['compute_ms']:.2f} ms; one all-reduce of the "
                            f"gradients' size {entry['allreduce_ms']:.2f} ms; CPU/step/rank "
                            f"{entry['step_cpu_ms']:.2f} ms (compute alone "
                            f"{entry['compute_cpu_ms']:.2f}); idle: "
                            f"{entry['idle_cpu_share']:.0%} of a core per rank"}
        extras["final training loss (same seed, same data order)"] = {
            "value": None,
            "note": f"torch {statistics.median(runs['torch']['final_loss']):.4f}, "
                    f"{backend} {statistics.median(runs[backend]['final_loss']):.4f}"}
        extras["runs"] = {"summary": summary, "per_backend": runs, "step_breakdown": breakdown}
        extras.update(hang_extras(hangs, "throughput:"))
        results.append(figure(f"throughput:{backend}", measure, "samples/s", s["samples_per_s"],
                              base["samples_per_s"], baseline_name,
                              s["samples_per_s"] / base["samples_per_s"], 0.8, ">=", extras))
    results.extend(planned_rows(base["samples_per_s"], baseline_name))
    return results


# -- what limits a backend's steady state: a per-step breakdown inside the barrier tasks --------
def step_breakdown_task(backend: str, env: Dict[str, str], features: int, batch_size: int,
                        steps: int, ctx) -> Dict[str, Any]:
    """Executor side, one rank: per-step milliseconds (median over ``steps``) of
    ``compute`` (forward/backward/SGD step of the plain model, no communication), ``step`` (the
    same step with the backend's wrapping: DDP, or hvd.DistributedOptimizer) and ``allreduce``
    (the backend's blocking all-reduce of one flat tensor the size of all the gradients), all
    on one in-memory batch: no reader, no Spark. ``env`` is set for this run only (e.g.
    HOROVOD_CYCLE_TIME, read by hvd.init)."""
    import time

    import torch

    from sparktrain.launch import TORCH_BACKENDS, load_backend

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.set_num_threads(max(1, ctx.cpus))  # what the training loop does
    torch.manual_seed(0)
    model = make_mlp(features)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.rand(batch_size, features), torch.randint(0, CLASSES, (batch_size,))

    def step(m, o) -> None:
        o.zero_grad()
        loss_fn(m(x), y).backward()
        o.step()

    def per_call_ms(fn) -> Dict[str, float]:
        for _ in range(max(10, steps // 10)):  # warm-up
            fn()
        ctx.all_gather("")  # both ranks start timing together
        laps = []
        cpu = time.process_time()  # CPU of every thread of this rank (Horovod's included)
        for _ in range(steps):
            started = time.perf_counter()
            fn()
            laps.append((time.perf_counter() - started) * 1e3)
        cpu = (time.process_time() - cpu) * 1e3 / steps
        laps.sort()
        return {"median_ms": laps[len(laps) // 2], "mean_ms": sum(laps) / len(laps),
                "p90_ms": laps[int(len(laps) * 0.9)], "cpu_ms": cpu}

    def idle_cpu_share(seconds: float = 1.0) -> float:
        """Share of one core this rank burns while its main thread sleeps."""
        ctx.all_gather("")
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return (time.process_time() - cpu) / (time.perf_counter() - wall)

    result: Dict[str, Any] = {"rank": ctx.rank}
    try:
        result["compute"] = per_call_ms(lambda: step(model, optimizer))
        dist = load_backend(TORCH_BACKENDS, backend)(ctx, torch.device("cpu"))
        wrapped = None
        try:
            wrapped, wrapped_optimizer = dist.wrap(model, optimizer)
            result["idle_cpu_share"] = idle_cpu_share()
            result["step"] = per_call_ms(lambda: step(wrapped, wrapped_optimizer))
            flat = torch.zeros(sum(p.numel() for p in model.parameters()))
            if backend == "horovod":  # a fixed name, as DistributedOptimizer's gradients have
                hvd = dist.hvd
                reduce = lambda: hvd.allreduce(flat, name="bench.flat", op=hvd.Sum)  # noqa: E731
            else:
                reduce = lambda: torch.distributed.all_reduce(flat)  # noqa: E731
            result["allreduce"] = per_call_ms(reduce)
            result["allreduce_floats"] = flat.numel()
        finally:
            wrapped = None  # the DDP reducer holds the process group: release it first
            dist.close()
    finally:
        for key, value in saved.items():  # Spark reuses this Python worker for later fits
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result


def step_breakdown(spark, args, state: Dict[str, Any]) -> Dict[str, Any]:
    """Run :func:`step_breakdown_task` in 2 barrier tasks for each diagnostic variant."""
    import functools

    from sparktrain.launch.barrier import run_barrier

    variants = [("torch", "torch", {}), ("horovod", "horovod", {})]
    for value in args.diag_cycle_times:
        variants.append((f"horovod HOROVOD_CYCLE_TIME={value}", "horovod",
                         {"HOROVOD_CYCLE_TIME": value}))
    out: Dict[str, Any] = {}
    for name, backend, env in variants:
        task = functools.partial(step_breakdown_task, backend, env, args.features,
                                 args.batch_size, args.diag_steps)
        seconds, ranks = guarded(spark, lambda t=task: run_barrier(spark, 2, t, echo_logs=False),
                                 args.fit_timeout, f"throughput: step breakdown {name}",
                                 state["hangs"])
        out[name] = {"ranks": ranks, "seconds": seconds}
        summary = {part: max(r[part]["median_ms"] for r in ranks)
                   for part in ("compute", "step", "allreduce")}
        out[name].update({f"{part}_ms": value for part, value in summary.items()})
        out[name]["step_cpu_ms"] = sum(r["step"]["cpu_ms"] for r in ranks) / len(ranks)
        out[name]["compute_cpu_ms"] = sum(r["compute"]["cpu_ms"] for r in ranks) / len(ranks)
        out[name]["idle_cpu_share"] = sum(r["idle_cpu_share"] for r in ranks) / len(ranks)
        progress(f"throughput: step breakdown {name}: " + ", ".join(
            f"{part} {value:.2f} ms" for part, value in summary.items()) + " (slowest rank's "
            f"median); CPU per step {out[name]['step_cpu_ms']:.2f} ms (compute alone "
            f"{out[name]['compute_cpu_ms']:.2f} ms); idle, the rank burns "
            f"{out[name]['idle_cpu_share']:.0%} of a core")
    return out


def planned_rows(torch_rate: Optional[float], baseline_name: str) -> List[Dict[str, Any]]:
    """Rows for backends sparktrain does not have yet: no number is made up."""
    rows = []
    for backend in KERAS_PLANNED:
        status = f"not implemented yet (no {backend!r} in sparktrain's KERAS_BACKENDS)"
        row = figure(f"throughput:{backend}", f"KerasEstimator(backend={backend!r}): {status}",
                     "samples/s", None, torch_rate, baseline_name, None, 0.8, ">=",
                     {"status": {"value": None, "note": status}})
        row["status"] = status
        rows.append(row)
    return rows


# -- figure 2: 1-step overhead ------------------------------------------------------------------
def hvd_one_step(features: int, batch_size: int) -> float:
    """horovod.spark.run's function: the same single step the horovod backend's 1-step fit
    takes (model, broadcast, DistributedOptimizer, one forward/backward/step)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)  # one Spark task slot per rank, as the estimator does
        model = make_mlp(features)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        x = torch.rand(batch_size, features)
        y = torch.randint(0, CLASSES, (batch_size,))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach().item()
    finally:
        hvd.shutdown()


def bench_overhead(spark, tmp: str, args, state: Dict[str, Any]) -> Dict[str, Any]:
    import horovod.spark

    from sparktrain.data.reader import steps_per_epoch

    batch, repeats, limit, hangs = args.step_batch, args.repeats, args.fit_timeout, state["hangs"]
    tiny = cached(make_frame(spark, 2 * batch, args.features, 2, args.seed + 1000))
    assert steps_per_epoch(2 * batch, 2, batch) == 1
    store = os.path.join(tmp, "store-overhead")
    estimators = {b: make_estimator(b, args.features, batch, 1, False, store) for b in BACKENDS}
    log = state["rank_log"]

    def st_fit(backend: str):
        def run():
            log.take()
            model = estimators[backend].fit(tiny)
            assert len(model.getHistory()["loss"]) == 1
            steps = RankLog.steps(log.take())
            assert steps in (None, 1), f"{backend} fit ran {steps} steps/rank, expected 1"
            return model
        return run

    def hvd_run():
        # verbose=0, and rank output to stderr: stdout is for the table
        result = horovod.spark.run(hvd_one_step, args=(args.features, batch), num_proc=2,
                                   verbose=0, start_timeout=int(limit), stdout=sys.stderr,
                                   stderr=sys.stderr)
        assert len(result) == 2, result
        return result

    variants = [("horovod.spark.run", hvd_run), ("horovod fit", st_fit("horovod")),
                ("torch fit", st_fit("torch"))]
    times: Dict[str, List[float]] = {name: [] for name, _ in variants}
    first_fit_after_run: List[float] = []

    def run_variant(name: str, fn, label: str) -> float:
        seconds, _ = guarded(spark, fn, limit, label, hangs)
        if name == "horovod.spark.run":
            # horovod.spark.run leaves Spark's Python workers unfit for reuse: the next job
            # gets fresh workers that import torch, horovod, TensorBoard... again (seconds).
            # An untimed horovod-backend fit pays that here, so every timed fit is warm; its
            # time is reported as an extra.
            again, _ = guarded(spark, st_fit("horovod"), limit, f"{label}: re-warming fit", hangs)
            first_fit_after_run.append(again)
            progress(f"overhead: first horovod fit after horovod.spark.run (untimed): {again:.2f}s")
        return seconds

    for name, fn in variants:  # the first fit materializes the tiny frame
        progress(f"overhead: warm-up {name}")
        seconds = run_variant(name, fn, f"overhead: {name} warm-up")
        progress(f"overhead: warm-up {name}: {seconds:.2f}s")
    for i in range(repeats):  # alternate so that load from other processes hits all alike
        for name, fn in variants:
            seconds = run_variant(name, fn, f"overhead: {name} {i + 1}")
            times[name].append(seconds)
            progress(f"overhead: {name} {i + 1}/{repeats}: {seconds:.2f}s")
    tiny.unpersist()
    med = {name: statistics.median(values) for name, values in times.items()}
    st, hr = med["horovod fit"], med["horovod.spark.run"]
    extras = {
        "torch backend: warm 1-step 2-rank fit": {
            "value": med["torch fit"], "unit": "s",
            "note": f"{med['torch fit'] / hr:.2f}x horovod.spark.run, "
                    f"{med['torch fit'] / st:.2f}x the horovod backend"},
        "first horovod-backend fit after horovod.spark.run (untimed)": {
            "value": statistics.median(first_fit_after_run), "unit": "s",
            "note": "horovod.spark.run's Spark Python workers are not reused: the next job "
                    "starts fresh ones that import torch and horovod again"},
        "runs": {"horovod_backend_fit_s": times["horovod fit"],
                 "horovod_spark_run_s": times["horovod.spark.run"],
                 "torch_backend_fit_s": times["torch fit"],
                 "first_fit_after_horovod_spark_run_s": first_fit_after_run},
        **hang_extras(hangs, "overhead:"),
    }
    return figure("overhead:horovod", f"wall s of a warm 1-step 2-rank run ({2 * batch} rows, "
                  f"batch {batch}/rank, MLP {args.features}->{HIDDEN}->{HIDDEN}->{CLASSES}, data "
                  f"already materialized), median of {repeats}", "s", st, hr,
                  "horovod.spark.run(fn, num_proc=2), fn = the same step with horovod.torch",
                  st / hr, 0.5, "<=", extras)


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the throughput frame")
    add_frame_args(parser, "partitions of the frame")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="rows per rank per step in the throughput figure")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs of the long fit in the throughput figure (>= 2)")
    parser.add_argument("--step-batch", type=int, default=256,
                        help="rows per rank of the single step in the overhead figure")
    parser.add_argument("--diag-steps", type=int, default=300,
                        help="steps per part of the in-memory step breakdown (0: skip it)")
    parser.add_argument("--diag-cycle-times", default="0.1,5",
                        help="comma-separated HOROVOD_CYCLE_TIME values (ms) to also run the "
                             "horovod step breakdown with (Horovod's default is 1 ms; '' = none)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated backends for the throughput figure (torch, the "
                             "baseline, always runs)")
    add_common_args(parser, FIGURES, "bench_backends.json", fit_timeout=300.0)
    args = parse_common(parser, argv, FIGURES)
    chosen = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(chosen) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backend(s) {sorted(unknown)}; expected some of {list(BACKENDS)}")
    args.backends = ("torch",) + tuple(b for b in BACKENDS[1:] if b in chosen)
    args.diag_cycle_times = [v.strip() for v in args.diag_cycle_times.split(",") if v.strip()]
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    if args.rows < 2 * args.batch_size:
        parser.error(f"--rows must be at least 2 x --batch-size ({2 * args.batch_size})")
    return args


def run_figures(spark, tmp: str, args, state: Dict[str, Any],
                results: List[Dict[str, Any]]) -> None:
    if "throughput" not in args.skip:
        progress(f"== throughput: generating {args.rows:,} rows x {args.features} features "
                 f"({args.partitions} partitions), cached and counted ==")
        df = cached(make_frame(spark, args.rows, args.features, args.partitions, args.seed))
        results.extend(bench_throughput(spark, df, tmp, args, state))
        df.unpersist()
    if "overhead" not in args.skip:
        progress("== overhead ==")
        results.append(bench_overhead(spark, tmp, args, state))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    quiet_warnings()

    rank_log = RankLog()
    state: Dict[str, Any] = {"hangs": [], "rank_log": rank_log}
    results: List[Dict[str, Any]] = []
    # sparktrain's INFO lines ("fit done in ...") to stderr; rank lines captured, not printed
    with sparktrain_logs(rank_log), \
            local_session(args, "sparktrain-bench-backends", "sparktrain-bench-") as (spark, tmp):
        load_before = os.getloadavg()
        with contextlib.redirect_stdout(sys.stderr):  # stdout is for the table and JSON lines
            run_figures(spark, tmp, args, state, results)

    title = (f"sparktrain backends benchmark: {args.rows:,} rows x {args.features} features, "
             f"{args.epochs} epochs, batch {args.batch_size}/rank, {args.master}, "
             f"{load_note(load_before)}")
    names = ("rows", "features", "partitions", "batch_size", "epochs", "step_batch", "repeats",
             "master")
    report(results, args.json_out, lambda: {
        **arg_meta(args, *names), "skipped": sorted(args.skip), **load_meta(load_before),
        **versions("horovod")}, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
