"""Several "hosts" on one machine for tests: Linux network namespaces, each with an address of
its own on a bridge that only they and this machine's root namespace share (no route out:
nothing they send leaves the bridge). A process started in a host sees that address as its
machine's only one, as a Spark Worker on another machine would.

Example::

    with HostNet(hosts=5) as net:          # root needed: ip netns, a bridge, veth pairs
        net.driver                         # "10.213.7.1": this process's address on the bridge
        net.address(2)                     # "10.213.7.4": host 2's
        subprocess.run(net.enter(2) + ["ss", "-tlnH"])   # a command on host 2

``available()`` says whether this machine lets us (root, ``ip``, namespaces); tests that need
the bed skip with its reason otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> Optional[str]:
    """``None`` where a bed can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "iproute2 (ip, ss) is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    try:
        os.makedirs("/etc/netns", exist_ok=True)  # where each host's /etc/hosts goes
    except OSError as exc:
        return f"cannot write /etc/netns: {exc}"
    probe = f"stprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class HostNet:
    """See the module docstring. ``hosts`` namespaces on one /24; the subnet's third byte
    comes from this process's id, so two test workers' beds never share addresses."""

    def __init__(self, hosts: int, tag: Optional[str] = None) -> None:
        self.hosts = hosts
        self.tag = tag or f"{os.getpid() % 10000}"
        self.net = f"10.213.{os.getpid() % 250 + 1}"
        self.bridge = f"stbr{self.tag}"
        self.names = [f"st{self.tag}h{i}" for i in range(hosts)]
        self.made: List[str] = []

    @property
    def driver(self) -> str:
        """This (root namespace) process's address on the bridge."""
        return f"{self.net}.1"

    def address(self, host: int) -> str:
        return f"{self.net}.{host + 2}"

    def enter(self, host: int) -> List[str]:
        """The command prefix that runs a command on ``host``: in its network namespace, and
        in a UTS namespace of its own named ``host<N>``, a name that resolves to its address
        there (Gloo's devices bind to what the host name resolves to where no interface is
        named)."""
        return ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', f"host{host}"]

    def start(self) -> "HostNet":
        self.stop()  # what a killed run of this process id left
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("addr", "add", f"{self.driver}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host, name in enumerate(self.names):
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("link", "add", f"{name}v", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", f"{name}v", "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        # what DNS gives on a cluster: every host's name resolves to its address (``ip netns
        # exec`` mounts /etc/netns/<name>/hosts over /etc/hosts)
        names = "".join(f"{self.address(h)} host{h}\n" for h in range(self.hosts))
        for name in self.names:
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as hosts:
                hosts.write("127.0.0.1 localhost\n::1 localhost\n" + names)
        return self

    def listeners(self, host: int) -> List[dict]:
        """The TCP sockets listening on ``host`` now: ``{"address", "port", "process", "pid"}``
        (``ss -tlnp`` in its namespace)."""
        out = subprocess.run(self.enter(host) + ["ss", "-tlnpH"], capture_output=True,
                             text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            address, _, port = fields[3].rpartition(":")
            users = line.split("users:", 1)[1] if "users:" in line else ""
            process = users.split('"')[1] if '"' in users else ""
            pid = int(users.split("pid=")[1].split(",")[0]) if "pid=" in users else 0
            found.append({"address": address.strip("[]"), "port": int(port),
                          "process": process, "pid": pid})
        return found

    def stop(self) -> None:
        """Kill what still runs in the namespaces, then remove them and the bridge."""
        for name in self.names:
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.made.clear()

    def __enter__(self) -> "HostNet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
