"""The Python environment that spark-submit ships to YARN's containers, packed as users pack
theirs (docs/yarn-and-hdfs.md): a venv with the job's packages, packed by venv-pack2 into
``env.tar.gz`` and passed as ``--archives env.tar.gz#environment`` with
``spark.pyspark.python=./environment/bin/python``.

The archive here is thin: its venv holds sparktrain, built from this checkout as a wheel (not the
editable install of the tests' venv, so the containers can only import it from the archive),
and a ``.pth`` line that adds the site-packages of the tests' own venv. That line stands for
the frameworks a GPU cluster's node image provides: PyPI's CUDA torch alone would make a full
archive of over 4 GB, for YARN to copy to every NodeManager.

Example::

    archive = thin_environment(folder)  # folder/env.tar.gz, about 1 MB
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def thin_environment(folder: str) -> str:
    """Build the venv in ``folder/jobenv``, pack it, and return the archive's path."""
    venv, wheels = os.path.join(folder, "jobenv"), os.path.join(folder, "wheels")
    base = getattr(sys, "_base_executable", sys.executable)  # the venv's own interpreter
    subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                          wheels, ROOT], check=True, cwd=folder)
    wheel = [os.path.join(wheels, n) for n in os.listdir(wheels) if n.startswith("sparktrain")]
    python = os.path.join(venv, "bin", "python")
    subprocess.run(pip + ["--python", python, "install", "--no-deps", "--no-index", *wheel],
                   check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True)
    image = sysconfig.get_paths()["purelib"]  # "the node image's" frameworks, added last
    with open(os.path.join(site.stdout.strip(), "node-image.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({image!r})\n")
    archive = os.path.join(folder, "env.tar.gz")
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "venv-pack"), "-q", "-p",
                    venv, "-o", archive], check=True)
    return archive
