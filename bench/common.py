"""Helpers shared by the benchmarks in this directory (``bench_*.py``).

Only driver-side code lives here: the parser, progress lines, logging, timing, the hang watchdog
for fits, a process tree's peak memory, the ``--child`` entry point, the generated DataFrame,
result records and their table / JSON-lines / JSON-file output. Functions that Spark ships to
executors (training functions for TorchDistributor, ``horovod.spark.run``, UDFs) stay in the
benchmark scripts themselves: run as ``__main__``, cloudpickle sends them *by value*, whereas a
function from this module would be pickled by reference and the executors, which do not have
``bench/`` on their path, could not import it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # normally installed editable in .venv; this makes a bare checkout work
    sys.path.insert(0, REPO)

_T0 = time.perf_counter()


def new_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of ``doc`` (the script's docstring)."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(parser, figures: List[str], json_name: str, fit_timeout: float,
                    connect: bool = False) -> None:
    """Flags every benchmark has: repeats, master, seed, --skip, --json-out, --fit-timeout
    (and ``--connect``/``--remote`` for those that can run over Spark Connect)."""
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per variant after the warm-up (median reported)")
    parser.add_argument("--master", default="local[2]", help="Spark master (>= 2 task slots)")
    if connect:
        parser.add_argument("--connect", action="store_true",
                            help="run over Spark Connect: start a Connect server on --master "
                                 "in its own JVM and use a remote session (or give --remote)")
        parser.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                            help="run over this Spark Connect server")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip", action="append", default=[],
                        help=f"figures to skip, comma-separated or repeated: {', '.join(figures)}")
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--json-out", default=os.path.join(here, "results", json_name))
    parser.add_argument("--fit-timeout", type=float, default=fit_timeout,
                        help="seconds after which a run counts as hung: its Spark jobs are "
                             "cancelled, the hang is reported and it is retried")
    parser.add_argument("--keep-tmp", action="store_true", help="leave the temp directory")


def add_frame_args(parser, partitions_help: str) -> None:
    """``--features`` and ``--partitions`` of the generated frame (``make_frame``)."""
    parser.add_argument("--features", type=int, default=32, help="floats per row")
    parser.add_argument("--partitions", type=int, default=2, help=partitions_help)


def parse_common(parser, argv: Optional[List[str]], figures: List[str]):
    """Parse, normalising ``--skip`` to a set and rejecting unknown figure names."""
    args = parser.parse_args(argv)
    args.skip = {s.strip() for item in args.skip for s in item.split(",") if s.strip()}
    unknown = args.skip - set(figures)
    if unknown:
        parser.error(f"unknown figure(s) {sorted(unknown)}; expected some of {figures}")
    return args


def progress(message: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def quiet_warnings() -> None:
    """Silence the warnings torch, pyarrow and Petastorm print on every batch or call."""
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


@contextmanager
def sparktrain_logs(rank_log: logging.Handler, *more: logging.Handler) -> Iterator[None]:
    """In the block, sparktrain's INFO lines go to stderr (and to ``more``), not to the root
    logger (``horovod.spark.run`` configures that one); rank lines (``sparktrain.rank``) go to
    ``rank_log`` only."""
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("[sparktrain] %(message)s"))
    added = [(logging.getLogger("sparktrain"), h) for h in (to_stderr, *more)]
    added.append((logging.getLogger("sparktrain.rank"), rank_log))
    for logger, handler in added:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, handler in added:
            logger.removeHandler(handler)


def spark_conf(tmp: str, memory: str = "4g") -> Dict[str, str]:
    """The local Spark conf of a benchmark: driver memory, no UI, scratch space under ``tmp``."""
    return {"spark.driver.memory": memory, "spark.ui.enabled": "false",
            "spark.local.dir": os.path.join(tmp, "spark-local")}


def remove_tmp(tmp: str, keep: bool) -> None:
    """Delete the benchmark's temporary directory, or say where it is (``--keep-tmp``)."""
    import shutil

    if keep:
        progress(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def timed(fn: Callable[[], Any]) -> tuple:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def guarded_runs(spark, fn: Callable[[], Any], repeats: int, timeout: float, label: str,
                 hangs: List[Dict[str, Any]]) -> List[float]:
    """``repeats`` runs of ``fn`` under ``guarded`` (labelled ``label 1``, ``label 2``...); their
    seconds."""
    times = []
    for i in range(repeats):
        seconds, _ = guarded(spark, fn, timeout, f"{label} {i + 1}", hangs)
        times.append(seconds)
        progress(f"{label} {i + 1}/{repeats}: {seconds:.2f}s")
    return times


def cancel_all(spark) -> None:
    """Cancel every running Spark job of ``spark`` (classic or Connect)."""
    from sparktrain.session.spark_api import is_remote

    if is_remote(spark):
        spark.interruptAll()
    else:
        spark.sparkContext.cancelAllJobs()


@contextmanager
def bench_session(args, app_name: str, conf: Dict[str, str]) -> Iterator[Any]:
    """The benchmark's SparkSession: embedded Spark on ``--master`` (executors on this Python),
    or a Spark Connect session (``--remote`` URL, or ``--connect``: a local Connect server on
    ``--master`` started here and stopped after)."""
    from sparktrain import ConnectServer, local_spark, remote_spark

    if args.remote or args.connect:
        server = None if args.remote else ConnectServer(args.master, conf=conf).start()
        try:
            spark = remote_spark(args.remote or server.url, app_name)
            try:
                yield spark
            finally:
                spark.stop()
        finally:
            if server is not None:
                server.stop()
        return
    spark = local_spark(args.master, app_name, conf=conf)
    try:
        yield spark
    finally:
        spark.stop()


@contextmanager
def local_session(args, app_name: str, prefix: str, conf: Optional[Dict[str, str]] = None,
                  jvm_tmpdir: bool = False) -> Iterator[Tuple[Any, str]]:
    """A fresh temp dir and an embedded Spark session on ``--master`` using it (``spark_conf``
    plus ``conf``); after the block Spark is stopped and the dir removed (``--keep-tmp``).
    ``jvm_tmpdir``: the JVM, so its Python workers and what they start, gets ``TMPDIR`` =
    ``<tmp>/scratch`` (their temporary files can be counted there; this process keeps its own)."""
    from sparktrain import local_spark

    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        progress(f"temp dir {tmp}; starting Spark {args.master}")
        before = os.environ.get("TMPDIR")
        if jvm_tmpdir:
            os.makedirs(os.path.join(tmp, "scratch"))
            os.environ["TMPDIR"] = os.path.join(tmp, "scratch")
        try:
            spark = local_spark(args.master, app_name, conf={**spark_conf(tmp), **(conf or {})})
        finally:
            os.environ.pop("TMPDIR", None) if before is None else os.environ.update(TMPDIR=before)
        try:
            yield spark, tmp
        finally:
            spark.stop()
    finally:
        remove_tmp(tmp, args.keep_tmp)


def session_kind(args) -> str:
    return f"Spark Connect ({args.remote or 'local server'})" if args.remote or args.connect \
        else "classic"


class Hang(RuntimeError):
    """A guarded call ran past its time limit (its Spark jobs were cancelled)."""


def guarded(spark, fn: Callable[[], Any], timeout: float, label: str,
            hangs: List[Dict[str, Any]], attempts: int = 3) -> tuple:
    """``timed(fn)``, but cancel every Spark job if it runs past ``timeout`` seconds, record the
    hang in ``hangs`` and try again (up to ``attempts`` times).

    A fit that deadlocks in a barrier task (the Gloo teardown hang fixed in 172f996, see
    sparktrain/launch/torch_ddp.py) would otherwise hang the whole benchmark; Spark kills the
    stuck Python worker once its task is cancelled.
    """
    for attempt in range(1, attempts + 1):
        fired = threading.Event()

        def fire(fired: threading.Event = fired) -> None:
            fired.set()
            progress(f"{label}: still running after {timeout:g}s, cancelling its Spark jobs")
            cancel_all(spark)

        timer = threading.Timer(timeout, fire)
        timer.daemon = True
        timer.start()
        try:
            return timed(fn)
        except Exception as exc:
            if not fired.is_set():
                raise
            hangs.append({"what": label, "attempt": attempt, "timeout_s": timeout,
                          "error": str(exc).strip().splitlines()[0][:300]})
            progress(f"{label}: HUNG (attempt {attempt}/{attempts}); retrying")
        finally:
            timer.cancel()
    raise Hang(f"{label} hung {attempts} times in a row (each cancelled after {timeout:g}s)")


def hang_extras(hangs: List[Dict[str, Any]], prefix: str) -> Dict[str, Any]:
    """Extras recording the hangs whose label starts with ``prefix`` (empty if none)."""
    mine = [h for h in hangs if h["what"].startswith(prefix)]
    if not mine:
        return {}
    return {"HANGS (cancelled and retried, not timed)": {
                "value": None, "note": f"{len(mine)}: " + "; ".join(h["what"] for h in mine)},
            "hangs": mine}


# -- memory and disk of a run ---------------------------------------------------------------------
def bytes_under(*paths: str) -> int:
    """Bytes of the files under ``paths`` (files that vanish meanwhile are skipped)."""
    total = 0
    for path in paths:
        for folder, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(folder, name))
                except OSError:
                    pass
    return total


class TreePeaks:
    """While the block runs, a thread samples (every ``interval`` s) the RSS and PSS summed over
    this process and all its descendants (JVM, Python workers, ranks...) and the bytes under
    ``scratch`` above what was there at the start; their peaks are ``rss``, ``pss``,
    ``scratch_bytes``. RSS counts shared pages once per process, PSS splits them."""

    def __init__(self, scratch: Sequence[str] = (), interval: float = 0.25) -> None:
        self.scratch, self.interval = list(scratch), interval
        self.rss = self.pss = self.scratch_bytes = self._base = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-peaks", daemon=True)

    def sample(self) -> None:
        import psutil

        root, rss, pss = psutil.Process(), 0, 0
        for proc in [root] + root.children(recursive=True):
            try:
                info = proc.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
        self.scratch_bytes = max(self.scratch_bytes, bytes_under(*self.scratch) - self._base)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "TreePeaks":
        self._base = bytes_under(*self.scratch)
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# -- child processes ----------------------------------------------------------------------------
def run_child(script: str, spec: Dict[str, Any], timeout: float, what: str,
              python: Optional[str] = None) -> Dict[str, Any]:
    """``script --child JSON`` in a fresh interpreter (nothing of this process's memory counts),
    this one or ``python`` (e.g. the classic stack's ``.venv-spark35/bin/python``); the JSON
    object it printed last. ``what`` names it in the error if it fails."""
    done = subprocess.run([python or sys.executable, script, "--child", json.dumps(spec)],
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=os.path.dirname(script))
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_entry(fn: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
    """The ``--child JSON`` entry point: if the script was started so, print ``fn(spec)`` as JSON
    and exit."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(fn(json.loads(sys.argv[2]))))
        sys.exit(0)


# -- data ---------------------------------------------------------------------------------------
def make_frame(spark, rows: int, features: int, partitions: int, seed: int):
    """``features``: array<float> of uniform [0, 1) values; ``label``: int 0/1, 1 when the
    alternating-sign sum of the features is positive (linearly separable, about balanced)."""
    from pyspark.sql import functions as F

    names = [f"f{i}" for i in range(features)]
    base = spark.range(0, rows, numPartitions=partitions).select(
        *[F.rand(seed + i).cast("float").alias(n) for i, n in enumerate(names)])
    score = sum((F.col(n) if i % 2 == 0 else -F.col(n)) for i, n in enumerate(names))
    return base.select(F.array(*[F.col(n) for n in names]).alias("features"),
                       (score > 0).cast("int").alias("label"))


def cached(df):
    df = df.cache()
    df.count()
    return df


# -- results ------------------------------------------------------------------------------------
JSON_LINE_KEYS = ("figure", "sparktrain", "baseline", "baseline_name", "ratio", "target", "met",
                  "unit")


def figure(name: str, measure: str, unit: str, sparktrain: Optional[float],
           baseline: Optional[float], baseline_name: str, ratio: Optional[float], target: float,
           op: str, extras: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    met = None if ratio is None else (ratio >= target if op == ">=" else ratio <= target)
    return {"figure": name, "measure": measure, "sparktrain": sparktrain, "baseline": baseline,
            "baseline_name": baseline_name, "ratio": ratio, "target": target, "target_op": op,
            "met": met, "unit": unit, "extras": extras or {}}


def _num(value: Any, unit: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):  # already formatted (e.g. a ratio line among the extras)
        return value
    if unit == "MiB":
        return f"{value:,.0f} MiB"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "copies":
        return f"{value:.2f} copies"
    if unit == "bytes":
        return f"{value:,.0f} B"
    if unit == "accuracy":
        return f"{value:.4f}"
    if unit.endswith("/s"):  # a rate: rows/s, samples/s
        return f"{value / 1e6:.2f}M {unit}" if value >= 1e5 else f"{value:,.0f} {unit}"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def print_table(results: List[Dict[str, Any]]) -> None:
    width = max([12] + [len(r["figure"]) for r in results])
    value_width = max([16] + [len(_num(r[k], r["unit"])) for r in results
                              for k in ("sparktrain", "baseline")])
    header = (f"{'figure':<{width}} {'sparktrain':>{value_width}}  {'baseline':>{value_width}}  "
              f"{'ratio':>7}  {'target':>8}  met  baseline name")
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['figure']:<{width}} {_num(r['sparktrain'], r['unit']):>{value_width}}  "
              f"{_num(r['baseline'], r['unit']):>{value_width}}  {ratio:>7}  "
              f"{r['target_op'] + format(r['target'], 'g') + 'x':>8}  {met:<3}  "
              f"{r['baseline_name']}")
        print(f"{'':<{width}} ({r['measure']})")
        for key, value in r["extras"].items():
            if isinstance(value, dict) and "value" in value:
                shown = ("" if value["value"] is None
                         else _num(value["value"], value.get("unit", r["unit"])))
                note = f"  {value['note']}" if value.get("note") else ""
                print(f"{'':<{width}}   + {key}: {shown}{note}")
    print()


def print_json_lines(results: List[Dict[str, Any]]) -> None:
    for r in results:
        line = {k: r[k] for k in JSON_LINE_KEYS}
        if "status" in r:  # e.g. a backend that is not implemented yet
            line["status"] = r["status"]
        print(json.dumps(line))


def versions(*packages: str) -> Dict[str, Any]:
    """The versions of ``packages`` (imported here), then of Python, PySpark, pyarrow and torch,
    the CPU count and the time."""
    import importlib

    import pyarrow
    import pyspark
    import torch

    return {**{name: importlib.import_module(name).__version__ for name in packages},
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "pyspark": pyspark.__version__, "pyarrow": pyarrow.__version__,
            "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_results(path: str, meta: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "figures": results}, f, indent=2)
    progress(f"wrote {path}")


def arg_meta(args, *names: str) -> Dict[str, Any]:
    """``{name: args.name}`` for the results file's meta."""
    return {name: getattr(args, name) for name in names}


def load_note(load_before: tuple) -> str:
    """``N CPUs, load avg BEFORE -> NOW`` for a benchmark's title line."""
    return f"{os.cpu_count()} CPUs, load avg {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"


def load_meta(load_before: tuple) -> Dict[str, Any]:
    """The load averages before and after, for the results file's meta."""
    return {"load_avg_before": load_before, "load_avg_after": os.getloadavg()}


def report(results: List[Dict[str, Any]], json_out: Optional[str],
           meta: Callable[[], Dict[str, Any]], title: Optional[str] = None) -> None:
    """Print ``title`` (after a blank line), the table and the JSON lines; then, if ``json_out``,
    write ``meta()`` and the results there."""
    if title is not None:
        print()
        print(title)
    print_table(results)
    print_json_lines(results)
    if json_out:
        write_results(json_out, meta(), results)
