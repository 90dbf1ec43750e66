"""Can the executors' Python run a training rank? One tiny job per session says so up front.

When the executors run another Python than the client (``PYSPARK_PYTHON`` or
``spark.pyspark.python`` pointing elsewhere, a cluster image without the library), the barrier
tasks die before a rank can report, and Spark retries the stage and fails with
``Job aborted due to stage failure ... failed the maximum allowable number of times``, naming
nothing. So before materializing, :func:`check_executors` runs one task with a plain (pickled,
not Arrow) Python UDF, the one kind of Python task that needs neither pandas nor pyarrow nor
sparktrain on the executor: it reports the executors' ``sys.executable``, Python version, which
of the needed modules ``importlib`` finds (without importing them) and their versions. A
missing module raises :class:`ExecutorEnvironmentError` naming it, that Python and the fix;
versions that differ from the client's are one warning (over Spark Connect the client and the
server are separate environments by design). The same code runs on classic and Connect
sessions; the result is cached per session and module set.

:func:`environment_error` turns Spark's text of a failed Python worker (``No module named
'x'``, ``PYTHON_VERSION_MISMATCH``, ``Cannot run program "..."``) into the same error, for the
probe itself and for a barrier stage that failed before any rank could report.

Example::

    check_executors(spark, ["pandas", "pyarrow", "numpy", "cloudpickle", "sparktrain", "torch"])
    # ExecutorEnvironmentError: The executors' Python (/opt/py/bin/python, Python 3.11.7)
    # cannot find pandas, torch, ... Point Spark at a Python that has them: ...
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyspark.sql import SparkSession

from sparktrain.errors import ExecutorEnvironmentError
from sparktrain.fs import client_package
from sparktrain.session.spark_api import conf_value, is_remote, master

log = logging.getLogger(__name__)

#: what every rank imports, whatever the framework (sparktrain's own runtime needs)
RANK_MODULES = ("pandas", "pyarrow", "numpy", "cloudpickle", "fsspec", "sparktrain")

# Packages whose versions should match between the client (which pickles the model, the
# optimizer and closures with cloudpickle) and the executors (which unpickle them); the
# frameworks only where the fit uses them.
_ALWAYS_COMPARED = ("cloudpickle", "sparktrain")
_FRAMEWORK_PACKAGES = {"torch": ("torch",), "horovod": ("torch",),
                       "tensorflow": ("tensorflow", "keras"), "keras": ("tensorflow", "keras"),
                       "tensorflowonspark": ("tensorflow", "keras")}
# Import name -> distribution names to ask importlib.metadata for (TensorFlow ships as several).
_DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu",
                                 "tensorflow-macos", "tensorflow-intel", "tf-nightly")}

_CHECKED: set = set()  # (id(session), modules) whose executors were found fine


def store_modules(url: str) -> List[str]:
    """What every rank imports to open the store ``url``: the package of its filesystem
    (:func:`sparktrain.fs.client_package`: ``hdfs_native``, ``s3fs``...), or nothing.

    Example: ``store_modules("hdfs://nn:8020/st") == ["hdfs_native"]`` where hdfs-native is
    installed.
    """
    package = client_package(url)
    return [package] if package else []


def check_executors(spark: SparkSession, modules: Sequence[str],
                    needed_by: str = "a training rank") -> None:
    """Fail fast, once per session, if the executors' Python lacks one of ``modules``.

    ``modules`` are import names (``"horovod.torch"`` is looked up without importing
    ``horovod``); ``needed_by`` says who needs them, for the message. Runs one one-task job
    (measured on local[2]: 0.3 s; 2.6 s when it is the session's first Python task, which
    starts Spark's Python worker for the fit). Raises :class:`ExecutorEnvironmentError`; logs one
    warning when the executors' versions of cloudpickle, sparktrain, the framework or Python
    differ from this client's.
    """
    modules = list(dict.fromkeys(modules))
    key = (id(spark), tuple(sorted(modules)))
    if key in _CHECKED:
        return
    compared = _compared_packages(modules)
    probe = _probe_function(modules, compared)
    from pyspark.sql import functions as F

    # useArrow=False: a plain UDF is pickled rows in and out, so the executors need neither
    # pandas nor pyarrow to run it; pyspark 4 makes Python UDFs Arrow-optimized by default
    # (spark.sql.execution.pythonUDF.arrow.enabled is true in pyspark 4.3).
    udf = F.udf(probe, "string", useArrow=False)
    started = time.perf_counter()
    try:
        text = spark.range(0, 1, 1, 1).select(udf(F.col("id"))).collect()[0][0]
    except Exception as exc:  # noqa: BLE001 - re-raised below unless Spark's text explains it
        error = environment_error(str(exc), spark, needed_by)
        if error is None:
            raise
        raise error from None
    executors = json.loads(text)
    log.debug("executor environment probe took %.2fs: %s", time.perf_counter() - started,
              executors)
    here = json.loads(probe(None))
    missing = [name for name in modules if not executors["found"].get(name)]
    if missing:
        raise ExecutorEnvironmentError(
            _missing_message(spark, missing, executors["python"], executors["version"],
                             needed_by, client_has_them=all(here["found"].values())),
            python=executors["python"], missing=missing)
    _warn_on_version_differences(spark, here, executors)
    _CHECKED.add(key)


def _compared_packages(modules: Sequence[str]) -> List[str]:
    packages = list(_ALWAYS_COMPARED)
    for name in modules:
        for package in _FRAMEWORK_PACKAGES.get(name.split(".")[0], ()):
            if package not in packages:
                packages.append(package)
    return packages


def _probe_function(modules: Sequence[str], packages: Sequence[str]) -> Callable[[Any], str]:
    """The probe, run as a UDF on an executor and directly here: a JSON report of this
    Python. It is a closure over plain values with every import inside, so cloudpickle ships
    it by value and it runs on executors where sparktrain itself does not import."""
    modules, packages, distributions = list(modules), list(packages), dict(_DISTRIBUTIONS)

    def probe(_: Any) -> str:
        import importlib.machinery
        import importlib.metadata
        import importlib.util
        import json
        import platform
        import sys

        def found(name: str) -> bool:
            # find_spec of "a.b" would import "a": walk down the packages' paths instead
            parts = name.split(".")
            try:
                spec = importlib.util.find_spec(parts[0])
                for depth in range(1, len(parts)):
                    if spec is None or not spec.submodule_search_locations:
                        return False
                    spec = importlib.machinery.PathFinder.find_spec(
                        ".".join(parts[:depth + 1]), list(spec.submodule_search_locations))
                return spec is not None
            except (ImportError, ValueError):
                return False

        def version(package: str) -> Any:
            if package == "sparktrain":  # a development install's metadata can lag its code
                try:
                    import sparktrain

                    return sparktrain.__version__
                except Exception:  # noqa: BLE001 - reported as missing instead
                    return None
            for dist in distributions.get(package, (package,)):
                try:
                    return importlib.metadata.version(dist)
                except importlib.metadata.PackageNotFoundError:
                    continue
            return None

        return json.dumps({"python": sys.executable, "version": platform.python_version(),
                           "found": {name: found(name) for name in modules},
                           "versions": {name: version(name) for name in packages}})

    return probe


# -- messages -----------------------------------------------------------------------------------
def _fix(spark: Optional[SparkSession], need: str = "has them",
         example: Optional[str] = None) -> str:
    """How to give the executors a Python that ``need``s, for ``spark``'s cluster manager."""
    remote = spark is not None and is_remote(spark)
    return fix_for(master(spark) if spark is not None else "", remote, need, example)


def fix_for(manager: str, remote: bool, need: str = "has them",
            example: Optional[str] = None) -> str:
    """How to give the executors a Python that ``need``s, for the cluster manager ``manager``
    (``spark.master``) or a Spark Connect server (``remote``); ``example``: a Python to suggest
    (one that exists on the executors' machines).

    Example: ``fix_for("yarn", False)`` says to rebuild and ship the environment archive.
    """
    setting = ("set the PYSPARK_PYTHON environment variable before the SparkSession starts "
               "(with spark-submit: --conf spark.pyspark.python=/path/to/python)")
    if example:
        setting += f", e.g. PYSPARK_PYTHON={example}"
    if remote:
        return (f"This is a Spark Connect session: the server's executors need a Python that "
                f"{need} (on Databricks: the cluster's Python, with cluster or notebook-scoped "
                f"libraries); where the Spark Connect server starts, {setting}.")
    if manager.startswith("yarn"):
        return (f"On YARN the executors run the Python of the environment archive the "
                f"application ships (--archives env.tar.gz#environment with --conf "
                f"spark.pyspark.python=./environment/bin/python): make the environment you "
                f"pack one that {need} (e.g. pip install 'sparktrain[cluster,torch]': the "
                f"store clients, psutil and the framework), pack it again and ship the new "
                f"archive (docs/yarn-and-hdfs.md, \"The Python environment, shipped as an "
                f"archive\").")
    if manager.startswith("k8s"):
        return (f"On Kubernetes the executors run the image's Python "
                f"(spark.kubernetes.container.image): use an image whose Python {need}, or "
                f"{setting}.")
    return (f"Point Spark at a Python that {need}: {setting}. (On Databricks or another Spark "
            f"Connect server, the cluster's Python needs the same.)")


def _missing_message(spark: SparkSession, missing: Sequence[str], python: str, version: str,
                     needed_by: str, client_has_them: bool) -> str:
    packages = " ".join(dict.fromkeys(_PIP_NAMES.get(top, top) for top in
                                      (name.split(".")[0] for name in missing)))
    # this driver's Python, or a pip run in the executors' one, exists on their machines only
    # where they are this machine's or share its files (local and standalone masters; not
    # YARN's or Kubernetes' containers, nor a Connect server's)
    on_hosts = not is_remote(spark) and not master(spark).startswith(("yarn", "k8s"))
    example = None
    if client_has_them and on_hosts and sys.executable != python:
        example = f"{sys.executable} (this driver's Python, which has them)"
    install = f" Or install them into that Python: {python} -m pip install {packages}" \
        if on_hosts else ""
    return (f"The executors' Python ({python}, Python {version}) cannot find "
            f"{', '.join(missing)}, which {needed_by} needs on every executor. "
            f"{_fix(spark, example=example)}{install}")


_PIP_NAMES = {"hdfs_native": "hdfs-native", "sklearn": "scikit-learn"}  # where they differ


def _configured_python(spark: Optional[SparkSession]) -> str:
    """What this client knows of the executors' Python, for errors raised before they said."""
    if spark is not None and is_remote(spark):
        value = conf_value(spark, "spark.pyspark.python")
        return value or "the Spark Connect server's Python"
    # a classic session's tasks run pyspark's SparkContext.pythonExec, which it reads from
    # PYSPARK_PYTHON when the context starts (pyspark/core/context.py), default "python3"
    return os.environ.get("PYSPARK_PYTHON", "python3")


_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
_VERSION_MISMATCH = re.compile(r"PYTHON_VERSION_MISMATCH\]?[^\n]*?different version:?\s*"
                               r"([\d.]+)\s+than that in driver:?\s*([\d.]+)")
_CANNOT_RUN = re.compile(r'Cannot run program "([^"]+)"(?:[^:\n]*:\s*([^\n]+))?')
_CANNOT_IMPORT = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def environment_error(text: str, spark: Optional[SparkSession] = None,
                      needed_by: str = "a training rank",
                      attempts: int = 1) -> Optional[ExecutorEnvironmentError]:
    """The :class:`ExecutorEnvironmentError` that Spark's error ``text`` shows (a Python worker
    that could not start or import what it needs), or ``None`` if it shows none of them.

    Example: ``environment_error("... ModuleNotFoundError: No module named 'pyarrow' ...")``
    names pyarrow, the executors' Python and how to point Spark at another one.
    """
    if spark is None:
        spark = SparkSession.getActiveSession()
    python = _configured_python(spark)
    cannot_run = _CANNOT_RUN.search(text)
    if cannot_run:
        python = cannot_run.group(1)
        reason = (cannot_run.group(2) or "").strip()
        return ExecutorEnvironmentError(
            f"Spark cannot start the executors' Python {python!r}"
            f"{f' ({reason})' if reason else ''}. "
            f"{_fix(spark, 'exists there', f'{sys.executable} (this driver)')}", python,
            attempts=attempts)
    mismatch = _VERSION_MISMATCH.search(text)
    if mismatch:
        worker, driver = mismatch.groups()
        return ExecutorEnvironmentError(
            f"The executors' Python ({python}) is Python {worker} and this driver's is Python "
            f"{driver}; pyspark needs the same minor version on both sides. "
            f"{_fix(spark, f'is Python {driver}', f'{sys.executable} (this driver)')}",
            python, attempts=attempts)
    missing = list(dict.fromkeys(_NO_MODULE.findall(text)))
    if missing:
        return ExecutorEnvironmentError(
            f"The executors' Python ({python}) cannot import {', '.join(missing)}, which "
            f"{needed_by} needs on every executor. {_fix(spark)} Or install "
            f"{' '.join(dict.fromkeys(m.split('.')[0] for m in missing))} into that Python.",
            python, missing, attempts=attempts)
    stale = _CANNOT_IMPORT.search(text)
    if stale:
        name, module = stale.groups()
        package = module.split(".")[0]
        return ExecutorEnvironmentError(
            f"The executors' {module} has no {name!r} (in {python}): the executors and this "
            f"client run different versions of {package}. Install the same version on both "
            f"sides. {_fix(spark, f'has the same {package}')}", python, attempts=attempts)
    return None


def _warn_on_version_differences(spark: SparkSession, here: Dict[str, Any],
                                 executors: Dict[str, Any]) -> None:
    differences = []
    mine, theirs = here["version"].rsplit(".", 1)[0], executors["version"].rsplit(".", 1)[0]
    if mine != theirs:
        differences.append(f"Python {mine} here, {theirs} on the executors")
    for package, version in here["versions"].items():
        other = executors["versions"].get(package)
        if version and other and version != other:
            differences.append(f"{package} {version} here, {other} on the executors")
    if not differences:
        return
    connect = (" Over Spark Connect the client and the server are separate environments, so "
               "this can be intended." if is_remote(spark) else "")
    log.warning("the executors' Python (%s) differs from this client's: %s. Models, optimizers "
                "and functions pickled here may fail to load there; install the same versions "
                "on both sides.%s", executors["python"], "; ".join(differences), connect)
