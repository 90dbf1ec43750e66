"""The Python environment that spark-submit ships to YARN's containers, packed as users pack
theirs (docs/yarn-and-hdfs.md): a venv with the job's packages, packed by venv-pack2 into
``env.tar.gz`` and passed as ``--archives env.tar.gz#environment`` with
``spark.pyspark.python=./environment/bin/python``.

The archive here is thin: its venv holds sparktrain, built from this checkout as a wheel (not the
editable install of the tests' venv, so the containers can only import it from the archive),
and a ``.pth`` line that adds the site-packages of the tests' own venv. That line stands for
the frameworks a GPU cluster's node image provides: PyPI's CUDA torch alone would make a full
archive of over 4 GB, for YARN to copy to every NodeManager.

The archive is built once per content and kept in ~/.cache/sparktrain/job-env/KEY/, KEY a hash
of what goes into it (sparktrain/'s files, setup.py, pyproject.toml, constraints/, this recipe,
the interpreter and the tests' venv it points at): the next run and the next clone of the same
code in the same venv path reuse it, a change to any of them builds another. A build goes into
a folder of its own that is then renamed into place, so concurrent test workers or clones never
see half an archive.

Example::

    archive = cached_environment()  # ~/.cache/sparktrain/job-env/KEY/env.tar.gz, about 1 MB
    archive = thin_environment(folder)  # folder/env.tar.gz, built now
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparktrain", "job-env")


def thin_environment(folder: str) -> str:
    """Build the venv in ``folder/jobenv``, pack it, and return the archive's path."""
    venv, wheels = os.path.join(folder, "jobenv"), os.path.join(folder, "wheels")
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", venv], check=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                          wheels, ROOT], check=True, cwd=folder)
    wheel = [os.path.join(wheels, n) for n in os.listdir(wheels) if n.startswith("sparktrain")]
    python = os.path.join(venv, "bin", "python")
    subprocess.run(pip + ["--python", python, "install", "--no-deps", "--no-index", *wheel],
                   check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True)
    with open(os.path.join(site.stdout.strip(), "node-image.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({_image()!r})\n")
    archive = os.path.join(folder, "env.tar.gz")
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "venv-pack"), "-q", "-p",
                    venv, "-o", archive], check=True)
    return archive


def cached_environment(cache: str = CACHE) -> str:
    """:func:`thin_environment`'s archive for this checkout's content, built on the first call
    and read from ``cache`` after (a folder per :func:`content_key`)."""
    final = os.path.join(cache, content_key())
    archive = os.path.join(final, "env.tar.gz")
    if os.path.exists(archive):
        return archive
    os.makedirs(cache, exist_ok=True)
    building = tempfile.mkdtemp(prefix=".building-", dir=cache)
    try:
        thin_environment(building)
        shutil.rmtree(os.path.join(building, "jobenv"))  # only the archive is kept
        try:
            os.rename(building, final)  # atomic: the archive appears whole or not at all
        except OSError:  # another process renamed its own build first: the same content
            if not os.path.exists(archive):
                raise
    finally:
        if os.path.exists(building):
            shutil.rmtree(building, ignore_errors=True)
    return archive


def content_key() -> str:
    """A hash of everything the archive is made of (see the module's docstring)."""
    digest = hashlib.sha256()
    for item in (sys.version, _base_python(), _image()):
        digest.update(f"{item}\0".encode())
    files = [os.path.join(ROOT, name) for name in ("setup.py", "pyproject.toml")]
    files.append(os.path.abspath(__file__))
    for top in ("sparktrain", "constraints"):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info"))
            files += [os.path.join(folder, n) for n in sorted(names) if not n.endswith(".pyc")]
    for path in files:
        digest.update(f"{os.path.relpath(path, ROOT)}\0".encode())
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()[:24]


def _base_python() -> str:
    """The interpreter the tests' venv was made from (the job's venv is made from it too)."""
    return getattr(sys, "_base_executable", sys.executable)


def _image() -> str:
    """The tests' venv's site-packages: "the node image's" frameworks, added last."""
    return sysconfig.get_paths()["purelib"]
