"""Security and hygiene: what listens during a fit, and where credentials go.

The fits here sample the listening sockets of every rank from inside the rank (a callback),
and those of the driver while the fit runs. In local mode the executor address is 127.0.0.1
(``local_spark`` sets ``SPARK_LOCAL_IP``), so every listener must be bound to it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request

import psutil
import pytest
import torch

from sparktrain import Store, TorchEstimator
from sparktrain.fs import filesystem

WILDCARDS = {"0.0.0.0", "::", ""}
CREDENTIALS = {"key": "AKIA-SECRET", "secret": "s3cr3t-token"}


def listening(process: psutil.Process) -> set:
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def rendezvous_port():
    """The port of this fit's rendezvous server, as a rank sees it during training."""
    if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
        return int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while not hasattr(store, "port"):  # PrefixStores around the TCPStore
        store = store.underlying_store
    return store.port


class RecordListeners:
    """A callback that writes this rank's listening sockets and the rendezvous port it uses to
    ``<folder>/<pid>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_epoch_end(self, epoch, logs):
        import psutil

        found = {"listening": sorted(listening(psutil.Process())), "rendezvous": rendezvous_port()}
        with open(os.path.join(self.folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(found, f)


class DriverListeners:
    """Samples the driver process's listening sockets in a thread while a fit runs."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.before = listening(self.me)
        self.seen: set = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(0.05):
            self.seen |= listening(self.me) - self.before

    def __enter__(self) -> "DriverListeners":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def estimator(store, backend, folder, **overrides):
    torch.manual_seed(3)
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=1, random_seed=3, store=store, backend=backend,
                  callbacks=[RecordListeners(str(folder))], verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


def check_listeners(folder, driver: set) -> list:
    """Every listener of the ranks and the driver is on 127.0.0.1; one rank serves the
    rendezvous there; the driver listens on nothing (rank logs go through the store). Returns
    each rank's listeners."""
    records = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            records.append(json.load(f))
    assert len(records) == 2, records  # one file per rank process
    ranks = [{tuple(pair) for pair in r["listening"]} for r in records]
    everything = set().union(driver, *ranks)
    assert not [a for a in everything if a[0] in WILDCARDS], everything
    assert {ip for ip, _ in everything} == {"127.0.0.1"}, everything
    ports = {r["rendezvous"] for r in records}
    assert len(ports) == 1, records
    server = ("127.0.0.1", ports.pop())
    assert [server in r for r in ranks].count(True) == 1, records
    assert not driver, f"the driver opened listeners: {driver}"
    return ranks


def test_torch_fit_binds_executor_address_and_keeps_credentials_out(
        spark, regression_df, tmp_path, caplog, capfd):
    """One fit checks both items: listeners (TCPStore on rank 0, Gloo's device on every rank,
    no driver listener) and a Store with credentials (logs, params, saved files)."""
    folder = tmp_path / "listeners"
    folder.mkdir()
    store = Store.create(str(tmp_path / "store"), storage_options=CREDENTIALS)
    est = estimator(store, "torch", folder, verbose=2)
    caplog.set_level(logging.INFO)
    with DriverListeners() as driver:
        model = est.fit(regression_df)
    ranks = check_listeners(folder, driver.seen)
    print("torch backend listeners:", ranks, "driver:", driver.seen)

    path = tmp_path / "saved"
    with pytest.warns(UserWarning, match="without its store's storage_options"):
        est.write().save(str(path / "estimator"))
    model.write().save(str(path / "model"))
    shown = [repr(store), str(store), repr(est), str(est), est.explainParams(),
             model.explainParams(), caplog.text, *capfd.readouterr()]
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                shown.append(f.read().decode("latin-1"))
    assert "store" in est.explainParams() and str(tmp_path / "store") in est.explainParams()
    for secret in CREDENTIALS.values():
        assert not [text[:200] for text in shown if secret in text], secret

    loaded = TorchEstimator.load(str(path / "estimator"))
    assert loaded.getStore().prefix == store.prefix and loaded.getStore().storage_options == {}


def test_horovod_fit_binds_executor_address(spark, regression_df, store, tmp_path):
    """Rank 0 serves Horovod's rendezvous on the executor address; Gloo's sockets follow
    HOROVOD_GLOO_IFACE (the interface of that address). Horovod's Gloo listens per pair while
    the ranks connect, so whether a Gloo listener is still open at the epoch's end varies."""
    est = estimator(store, "horovod", tmp_path)
    with DriverListeners() as driver:
        est.fit(regression_df)
    ranks = check_listeners(tmp_path, driver.seen)
    print("horovod backend listeners:", ranks, "driver:", driver.seen)


def test_torch_store_server_listens_on_the_given_address_only():
    from sparktrain.launch.torch_ddp import _master_store

    server = _master_store("127.0.0.1", 1)
    try:
        assert ("127.0.0.1", server.port) in listening(psutil.Process())
        assert not [a for a in listening(psutil.Process()) if a[1] == server.port
                    and a[0] != "127.0.0.1"]
    finally:
        del server


def test_horovod_rendezvous_answers_only_with_the_secret():
    from sparktrain.launch.horovod_torch import RendezvousServer, slot_for

    server = RendezvousServer("127.0.0.1", slot_for(["127.0.0.1", "127.0.0.1"], 0)[1])

    def status(path, method="GET", data=None):
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data,
                                         method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    try:
        assert listening(psutil.Process()) >= {("127.0.0.1", server.port)}
        good = f"/{server.secret}:{server.port}"
        assert server.rendezvous_address == f"127.0.0.1:{server.port}/{server.secret}"
        assert status(good + "/global/rank_0", "PUT", b"addr") == (200, b"")
        assert status(good + "/global/rank_0") == (200, b"addr")
        for path in ("/global/rank_0", f"/{server.secret[:-1]}:{server.port}/global/rank_0",
                     f"/{server.secret}:1/global/rank_0", f"/x{good}/global/rank_0"):
            assert status(path) == (403, b""), path
        assert status("/global/rank_0", "PUT", b"evil") == (403, b"")
        assert status("/global/rank_0", "DELETE") == (403, b"")
        assert status("/README.md", "HEAD") == (403, b"")  # no peeking at the cwd's files
        assert status(good + "/global/rank_0") == (200, b"addr")
    finally:
        server.stop()
    assert ("127.0.0.1", server.port) not in listening(psutil.Process())


def leaky_filesystem():
    """A filesystem that quotes a credential in its error, as gcsfs does when a token string
    is not one of its methods (it opens it as a file name)."""
    from fsspec import AbstractFileSystem

    class LeakyFileSystem(AbstractFileSystem):
        protocol = "leaky"

        def __init__(self, token=None, **kwargs):
            raise FileNotFoundError(2, "No such file or directory", token)

    return LeakyFileSystem


def test_filesystem_errors_never_quote_storage_options():
    import fsspec

    fsspec.register_implementation("leaky", leaky_filesystem(), clobber=True)
    nested = {"token": "s3cr3t-token", "client_kwargs": {"aws_secret_access_key": "AKIA-SECRET"}}
    with pytest.raises(FileNotFoundError) as info:
        filesystem("leaky://bucket/root", nested)
    assert "***" in str(info.value) and "leaky://bucket/root" in str(info.value)
    assert info.value.__context__ is None and info.value.__cause__ is None

    with pytest.raises(ValueError, match="nosuchproto") as info:  # fsspec's own error
        filesystem("nosuchproto://bucket/root", CREDENTIALS)
    for secret in CREDENTIALS.values():
        assert secret not in f"{info.value!r} {info.value}"


def test_fit_with_an_unusable_store_names_it_without_credentials(spark, regression_df, tmp_path):
    est = estimator(Store.create("nosuchproto://bucket/root", storage_options=CREDENTIALS),
                    "torch", tmp_path)
    with pytest.raises(Exception) as info:
        est.fit(regression_df)
    text = f"{info.value!r} {info.value}"
    assert "nosuchproto" in text
    for secret in CREDENTIALS.values():
        assert secret not in text


def test_backend_env_values_are_not_saved(spark, tmp_path):
    """Environment variables often hold tokens: a saved estimator keeps their names only, and
    says so on save and on load."""
    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["features"],
                         label_cols=["label"], backend_env={"TOKEN": "secret-env-value",
                                                            "OMP_NUM_THREADS": 1})
    path = tmp_path / "estimator"
    with pytest.warns(UserWarning, match=r"without its backend_env values .*'OMP_NUM_THREADS', "
                                         r"'TOKEN'"):
        est.write().save(str(path))
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert b"secret-env-value" not in f.read(), name
    with pytest.warns(UserWarning, match=r"set \['OMP_NUM_THREADS', 'TOKEN'\] again"):
        loaded = TorchEstimator.load(str(path))
    assert loaded.getBackendEnv() == {}
    loaded.setParams(backend_env={"TOKEN": "t"})
    assert loaded.getBackendEnv() == {"TOKEN": "t"}
