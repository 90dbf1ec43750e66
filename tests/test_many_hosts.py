"""Many hosts on one machine: a standalone Master and four 2-core Workers, each in a network
namespace of its own with its own address and host name (``tests/support/host_net.py``), the
driver on the bridge between them, and a sixth namespace for a stranger on the same network.

A streamed fit (rows fed beside the ranks) trains with its ranks on several hosts, with DDP
and with Horovod, while the test watches every host's listening sockets (``ss -tlnp`` in its
namespace) and has the stranger connect to each listener of the ranks' Python processes as
soon as it appears, sending a plausible header and junk: no listener is bound to every
interface, the fits learn as undisturbed ones do, a fit from the store (whose order is a
function of its seed) that the stranger probes loses exactly what one it is kept from loses,
and the row feed logs each refused stranger once.

Horovod across hosts needs each host's name to resolve to its address (its process-set Gloo
context binds there): a host whose name does not is refused before ``hvd.init()``, clearly.

Full tier: the whole file (``pytestmark``). Only it runs ranks on hosts whose address is not
127.0.0.1. The quick tier's listener checks (test_security.py) run in local mode, where a bind
to loopback is the right one, and its strangers (test_row_feed.py, test_rank_gather.py) knock
on one listener outside a fit; so only here do ranks that cannot reach each other across hosts,
a fit a stranger's probes disturb, row feeding that ignores where the blocks are, executors'
CUDA_VISIBLE_DEVICES="2,3" mistranslated on real Workers (test_gpus.py patches the environment)
and a host name resolving to loopback fail.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

from support.host_net import HostNet, available
from support.standalone import StandaloneCluster

pytestmark = pytest.mark.full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_HOSTS = (1, 2, 3, 4)
STRANGER = 5
WILDCARDS = ("0.0.0.0", "::", "*")

# what the stranger runs against one listener: connect, send a feed header and junk, read
# what comes back until the listener closes or 3 s pass
PROBE = textwrap.dedent('''
    import json, socket, sys, time
    out = {"connected": False, "received": 0, "closed": False}
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
        out["connected"] = True
        s.sendall(b'{"epoch": 0, "partition": 0, "split": "train"}\\n' + b"\\xff" * 4096)
        end = time.time() + 3
        while time.time() < end:
            data = s.recv(65536)
            if not data:
                out["closed"] = True
                break
            out["received"] += len(data)
    except OSError as exc:
        out["error"] = type(exc).__name__
    print(json.dumps(out))
''')

# A driver on the bridge: a session on the bed's Master (its settings plus CONF) and ROWS rows
# of the regression of tests/conftest.py as ``df``; a test's own lines follow (_driver).
SESSION = textwrap.dedent('''
    import json, logging, os, sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    import numpy as np
    from pyspark.ml.linalg import Vectors
    from sparktrain import local_spark
    from support.helpers import linear_estimator

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    os.environ["SPARK_LOCAL_IP"] = {driver!r}
    spark = local_spark(None, conf={{
        "spark.master": {url!r}, "spark.driver.host": {driver!r},
        "spark.pyspark.python": sys.executable, "spark.executor.memory": "768m",
        "spark.executor.cores": "2", "spark.sparktrain.slotWaitSeconds": "90", **{conf!r}}})
    rng = np.random.default_rng(0)
    x = rng.normal(size=({rows}, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y)],
                               ["features", "label"])
''')

FITS = textwrap.dedent('''
    df = df.repartition(8).cache()
    df.count()
    result = {}
    for backend in ("torch", "horovod"):
        est = linear_estimator(STORE + backend, num_proc=4, input_mode="stream", epochs=4,
                               batch_size=256, backend=backend, verbose=1)
        result[backend] = est.fit(df).getHistory()["loss"]
    # the rows from the store, in an order that is a function of the seed: a fit the stranger
    # probes and then one it is kept away from (the QUIET file) must lose the same, bit for bit
    stored = lambda: linear_estimator(STORE + "store", num_proc=4, epochs=2, batch_size=256,
                                      verbose=1).fit(df).getHistory()["loss"]
    started = time.time()
    result["store_probed"] = stored()
    result["probed_between"] = [started, time.time()]
    open(QUIET, "w").close()
    result["store_quiet"] = stored()
    print("RESULT " + json.dumps(result), flush=True)
''')


def _driver(net: HostNet, cluster: StandaloneCluster, rows: int, body: str,
            conf: Optional[dict] = None, **names: str) -> str:
    """A driver script: :data:`SESSION`, ``names`` bound (``STORE = "..."``), then ``body``."""
    code = SESSION.format(root=ROOT, tests=os.path.join(ROOT, "tests"), driver=net.driver,
                          url=cluster.url, conf=conf or {}, rows=rows)
    return code + "".join(f"{name} = {value!r}\n" for name, value in names.items()) + body


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """The bed: ``(net, cluster)``; Workers on hosts 1-4, 2 cores each (a rank and a feeding
    task), host 5 left for the stranger."""
    why = available()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    workdir = tmp_path_factory.mktemp("hosts")
    with HostNet(hosts=6) as net:
        cluster = StandaloneCluster(workdir, host=(net.address(0), net.enter(0))).start()
        try:
            for host in WORKER_HOSTS:
                cluster.add_worker(cores=2, memory="2g", host=(net.address(host), net.enter(host)))
            yield net, cluster
        finally:
            cluster.stop()


class ListenerWatch:
    """Polls every worker host's listening sockets while a fit runs; the stranger probes each
    new one that a Python process holds on a non-loopback address."""

    def __init__(self, net: HostNet, quiet: str) -> None:
        self.net, self.seen, self.probes, self.quiet = net, {}, {}, quiet
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(8)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _probe(self, key, address: str, port: int) -> None:
        at = time.time()
        out = subprocess.run(self.net.enter(STRANGER) + [sys.executable, "-c", PROBE, address,
                                                           str(port)],
                             capture_output=True, text=True, timeout=30).stdout
        self.probes[key] = {**json.loads(out.strip().splitlines()[-1]), "at": at}

    def _run(self) -> None:
        while not self.stop.wait(0.15):
            for host in WORKER_HOSTS:
                for sock in self.net.listeners(host):
                    key = (host, sock["address"], sock["port"])
                    if key in self.seen:
                        continue
                    self.seen[key] = sock
                    if os.path.exists(self.quiet):  # the undisturbed fit: seen, not probed
                        continue
                    if sock["process"].startswith("python") and \
                            not sock["address"].startswith(("127.", "::1")):
                        self.pool.submit(self._probe, key, sock["address"], sock["port"])

    def __enter__(self) -> "ListenerWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.pool.shutdown(wait=True)


def test_fits_across_hosts_keep_their_listeners_to_themselves(hosts, tmp_path):
    net, cluster = hosts
    quiet = str(tmp_path / "quiet")
    code = _driver(net, cluster, 40_000, FITS, STORE=str(tmp_path / "store-"), QUIET=quiet)
    env = dict(os.environ, SPARK_LOCAL_IP=net.driver)
    errors = tmp_path / "fits.log"  # kept for a failure's reader
    with ListenerWatch(net, quiet) as watch, open(errors, "w") as stderr:
        run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=stderr, text=True, cwd=ROOT, env=env)
        timer = threading.Timer(540, run.kill)
        timer.start()
        out = list(run.stdout)
        run.wait()
        timer.cancel()
    log = errors.read_text()
    lines = [line for line in out if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (watch.probes, "".join(out)[-2000:] + log[-6000:])
    histories = json.loads(lines[0][len("RESULT "):])

    python = {key: sock for key, sock in watch.seen.items()
              if sock["process"].startswith("python")}
    # the ranks ran on the four hosts, each listening on its own address only
    assert {key[1] for key in python} >= {net.address(h) for h in WORKER_HOSTS}, python
    assert not [s for s in python.values() if s["address"] in WILDCARDS], python
    # the stranger reached listeners of the ranks (the row feeds at least) and got nothing in
    assert len(watch.probes) >= len(WORKER_HOSTS), (watch.probes, python)
    assert any(p["connected"] for p in watch.probes.values()), watch.probes
    # both fed fits learned as undisturbed ones do (tests/test_stream.py: loss under 0.05)
    probed, quiet_run = histories.pop("store_probed"), histories.pop("store_quiet")
    begin, end = histories.pop("probed_between")
    for backend, history in histories.items():
        assert history[-1] < 0.05 and history[-1] < history[0] / 10, (backend, history)
    # the fit from the store was probed while it ran (its rank gather, TCPStore, Gloo) and
    # lost exactly what the one nobody probed lost: the stranger changed nothing
    during = [p for p in watch.probes.values() if begin <= p["at"] <= end and p["connected"]]
    assert during, (begin, end, watch.probes)
    assert probed == quiet_run and probed[-1] < probed[0] / 10, (probed, quiet_run)
    # the row feeds said who they refused, once each, and took their rows from the feeders
    refused = re.findall(r"row feed on ([\d.]+:\d+) closed a connection from ([\d.]+)", log)
    assert refused and {peer for _, peer in refused} == {net.address(STRANGER)}, log[-4000:]
    assert len(refused) == len(set(refused)), refused
    traffic = re.findall(r"row feed: (\d+) feeder connection\(s\) from (\d+) host\(s\); "
                         r"(\d+) rows, (\d+) of them from another host", log)
    assert len(traffic) == 2 * len(WORKER_HOSTS), log[-4000:]
    assert sum(int(rows) for _, _, rows, _ in traffic) == 2 * 40_000, traffic
    # each of the 8 partitions (5,000 rows: 5 chunks) went to one host's rank, not to all 4:
    # 2 feeder connections a rank, where every feeder fed every rank before (8)
    assert all(int(connections) <= 2 for connections, _, _, _ in traffic), traffic
    # each partition went to the host where its cached blocks are, which is where Spark runs
    # its feeding task: few rows cross hosts (none, measured here; a feeding task that waited
    # past Spark's locality wait for its host's free slot runs elsewhere)
    crossed = sum(int(other) for _, _, _, other in traffic)
    assert crossed <= 2 * 40_000 // 2, traffic
    print("listeners:", json.dumps({f"{k[0]} {k[1]}:{k[2]}": v for k, v in watch.probes.items()}))
    print("row feed traffic per rank:", traffic)


GPU_FIT = textwrap.dedent('''
    model = linear_estimator(STORE, num_proc=4, epochs=2, batch_size=32, verbose=2).fit(df)
    print("RESULT " + json.dumps(model.getHistory()["loss"]), flush=True)
''')
RANK_GPU = re.compile(r"\[rank (\d+)\] GPU (\S+) \(CUDA_VISIBLE_DEVICES=([\w,]+)")


def test_local_ranks_on_hosts_whose_executors_see_gpus_2_and_3_get_devices_2_and_3(hosts,
                                                                                  tmp_path):
    """Two more Workers, on hosts 1 and 2, whose executors see CUDA_VISIBLE_DEVICES="2,3" (a
    container runtime's) and announce fake GPUs "0","1" (positions in it) and "2","3" (its
    entries): each task of 2 GPUs runs 2 local ranks, and each rank is given device 2 or 3,
    whichever form Spark's addresses take (launch.gpus translates once)."""
    from support.helpers import FAKE_GPU_DISCOVERY
    from support.servers import gpu_worker_env

    net, cluster = hosts
    for host, addresses in ((1, "0,1"), (2, "2,3")):
        cluster.add_worker(dict(gpu_worker_env(addresses), CUDA_VISIBLE_DEVICES="2,3"),
                           cores=2, memory="2g", host=(net.address(host), net.enter(host)))
    code = _driver(net, cluster, 512, GPU_FIT, {
        "spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": "2",
        "spark.executor.resource.gpu.discoveryScript": FAKE_GPU_DISCOVERY},
        STORE=str(tmp_path / "store"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, SPARK_LOCAL_IP=net.driver),
                          timeout=540)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-6000:]
    loss = json.loads(lines[0][len("RESULT "):])
    assert loss[-1] < loss[0], loss
    ranks = {int(rank): (gpu, visible) for rank, gpu, visible in RANK_GPU.findall(done.stderr)}
    assert sorted(ranks) == [0, 1, 2, 3], done.stderr[-6000:]
    assert sorted(ranks.values()) == [("2", "2"), ("2", "2"), ("3", "3"), ("3", "3")], ranks
    assert "each task holds 2 GPUs and runs 2 ranks" in done.stderr, done.stderr[-6000:]


def test_horovod_refuses_a_host_whose_name_resolves_to_loopback(hosts):
    """On a bed host, a host name that resolves to its address passes; one that resolves to
    127.0.0.1 (as many images map it) fails with what to change, where Gloo would abort."""
    net, _ = hosts
    ips = [net.address(h) for h in WORKER_HOSTS]
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from sparktrain.launch.horovod_torch import check_host_name\n"
            "from sparktrain.faults import user_error_source\n"
            "try:\n    check_host_name(%r, 0)\n    print('PASSED')\n"
            "except RuntimeError as exc:\n    print(user_error_source(exc), '|', exc)\n"
            % (ROOT, ips))
    named = subprocess.run(net.enter(1) + [sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=60)
    assert named.stdout.strip() == "PASSED", named.stdout + named.stderr
    # the same host under the name "localhost", which its /etc/hosts maps to loopback
    local = net.enter(1)[:-1] + ["localhost"]
    refused = subprocess.run(local + [sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
    assert refused.stdout.startswith("the executors' host names |"), \
        refused.stdout + refused.stderr
    assert re.search(r"'localhost' resolves to (127\.0\.0\.1|::1),", refused.stdout)
    assert f"executor's address ({ips[0]})" in refused.stdout
