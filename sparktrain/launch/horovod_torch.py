"""The ``horovod`` backend for PyTorch: Horovod over Gloo inside the Spark barrier tasks.

No home-made rendezvous: the barrier task of partition 0 runs Horovod's own HTTP
rendezvous server (what ``horovodrun``'s Gloo launcher runs on its driver), initialised with
Horovod's ``get_host_assignments`` over the hosts of the barrier tasks; its address reaches the
other tasks through ``BarrierTaskContext.allGather``; each task takes the environment Horovod's
launcher would give it (``create_slot_env_vars`` + ``create_run_env_vars``: rank, size,
local/cross rank and size, hostname, rendezvous address, controller and CPU operations
``gloo``, network interface) and calls ``hvd.init()``.

What listens, and where (see docs/security.md):

- The rendezvous server listens on rank 0's executor address only (Horovod's own server binds
  all interfaces on a random port), and answers only requests that carry a per-fit secret.
  Horovod's Gloo store builds its URLs as ``http://`` + ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` +
  ``:`` + port + ``/<scope>/<key>``, so an address of ``<ip>:<port>/<secret>`` makes every
  request ``/<secret>:<port>/<scope>/<key>``; the server checks and strips that first
  segment and refuses anything else (403), HEAD requests included. The secret reaches the
  ranks through ``allGather`` and their environment; it travels in plain HTTP, so it keeps
  out whoever cannot see the fit's traffic, not an eavesdropper on the executors' network.
- Gloo's sockets bind to the interface of each rank's executor address (``HOROVOD_GLOO_IFACE``).
  They are unauthenticated plain TCP, as in any Horovod job. One exception, Horovod's own:
  its process-set contexts (``GlooContext::InitializeForProcessSet`` in 0.28.1) make their
  device without that interface, so Gloo takes the first address the host's name resolves
  to. Across hosts that must be an address the others reach: :func:`check_host_name` says
  so before ``hvd.init()`` instead of letting Gloo abort the process.

Learning rate: used as given (Horovod's Spark estimators multiply it by ``hvd.size()``,
horovod/spark/torch/remote.py in 0.28.1; ``scale_learning_rate=True`` does that here).
``hvd.DistributedOptimizer`` averages gradients; parameters and optimizer state are broadcast
from rank 0 before the first step.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from sparktrain.faults import mark_user_error
from sparktrain.launch.engine import TorchEngine
from sparktrain.launch.rank_context import RankContext
from sparktrain.launch.torch_ddp import interface_for


def _interface_for(ip: str) -> str:
    """Name of the network interface that holds ``ip`` (Gloo binds its devices to it)."""
    name = interface_for(ip)
    if name is None:
        raise RuntimeError(f"no network interface holds {ip}; set HOROVOD_GLOO_IFACE")
    return name


def host_name_address() -> Optional[str]:
    """The address Gloo binds where no interface is named: the first that this machine's
    host name resolves to (gloo/transport/tcp's ``lookupAddrForHostname``), or None."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(found[0][4][0]) if found else None


def check_host_name(ips: List[str], rank: int) -> None:
    """Fail, not retried, where ranks span hosts and this host's name resolves to nothing or
    to a loopback address: Horovod's process-set Gloo context would listen there and the
    other hosts' ranks could not connect (Gloo aborts the process; see the module docstring).

    Example::

        check_host_name(["10.0.0.5", "10.0.0.6"], rank=1)   # on 10.0.0.6
    """
    if len(set(ips)) < 2:
        return
    address = host_name_address()
    if address is not None and not ipaddress.ip_address(address).is_loopback:
        return
    raise mark_user_error(RuntimeError(
        f"backend='horovod' with ranks on {len(set(ips))} hosts: this host's name "
        f"{socket.gethostname()!r} resolves to {address or 'no address'}, and Horovod "
        f"connects its process-set Gloo context through that address whatever "
        f"HOROVOD_GLOO_IFACE says, so ranks on other hosts cannot reach it. Make the host "
        f"name resolve to the executor's address ({ips[rank]}) in DNS or /etc/hosts (some "
        f"images map it to 127.0.1.1), or use backend='torch'"), "the executors' host names")


def slot_for(hosts: List[str], rank: int) -> Tuple[Any, List[Any]]:
    """Horovod's slot for barrier task ``rank``, and the whole allocation plan.

    Horovod numbers ranks host by host; a barrier task is matched to the slot with its host
    and its position among that host's tasks (in partition order).
    """
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    order = list(dict.fromkeys(hosts))
    plan = get_host_assignments([HostInfo(h, hosts.count(h)) for h in order], len(hosts))
    local = hosts[:rank].count(hosts[rank])
    slot = next(s for s in plan if s.hostname == hosts[rank] and s.local_rank == local)
    return slot, plan


class RendezvousServer:
    """Horovod's HTTP rendezvous (its ``RendezvousHTTPServer`` and ``RendezvousHandler``),
    bound to the IPv4 address ``host`` on a free port, answering only requests under
    ``/<secret>:<port>/``.

    Example::

        server = RendezvousServer("10.0.0.5", plan)
        os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = server.rendezvous_address
        os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(server.port)
        ...
        server.stop()
    """

    def __init__(self, host: str, plan: List[Any], secret: Optional[str] = None) -> None:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        class Handler(RendezvousHandler):
            path: str  # BaseHTTPRequestHandler's request path (horovod's base is untyped)

            def _authorized(self) -> bool:
                prefix = self.server.path_prefix.encode()
                path = self.path.encode("utf-8", "replace")
                if not hmac.compare_digest(path[:len(prefix)], prefix):
                    self.send_status_code(403)
                    return False
                self.path = "/" + path[len(prefix):].decode("utf-8", "replace")
                return True

            def do_GET(self) -> None:
                if self._authorized():
                    super().do_GET()

            def do_PUT(self) -> None:
                if self._authorized():
                    super().do_PUT()

            def do_DELETE(self) -> None:
                if self._authorized():
                    super().do_DELETE()

            def do_HEAD(self) -> None:  # SimpleHTTPRequestHandler's would describe local files
                self.send_status_code(403)

        self.host = host
        self.secret = secret or secrets.token_urlsafe(24)
        self._httpd = RendezvousHTTPServer((host, 0), Handler, 0)
        self.port = self._httpd.server_address[1]
        self._httpd.path_prefix = f"/{self.secret}:{self.port}/"
        self._httpd.init(plan)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="sparktrain-horovod-rendezvous", daemon=True)
        self._thread.start()

    @property
    def rendezvous_address(self) -> str:
        """The value for ``HOROVOD_GLOO_RENDEZVOUS_ADDR``: host, port and secret."""
        return f"{self.host}:{self.port}/{self.secret}"

    def stop(self) -> None:
        """Stop serving and close the listening socket (Horovod's own ``stop`` leaves it open)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class HorovodTorch(TorchEngine):
    """Horovod (Gloo) for one rank (a :class:`~sparktrain.launch.engine.TorchEngine`)."""

    # hvd.DistributedOptimizer all-reduces from backward hooks and waits in step(); AMP needs
    # optimizer.synchronize() before GradScaler.unscale_ and skip_synchronize() around its step
    # (Horovod's AMP example), which the shared loop does not do. bf16 needs no scaling.
    fp16_loss_scaling = False

    def __init__(self, ctx: RankContext, device: torch.device) -> None:
        import horovod.torch as hvd
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

        self.device, self.hvd = device, hvd
        ips = [socket.gethostbyname(h) for h in ctx.hosts]
        check_host_name(ips, ctx.rank)
        slot, plan = slot_for(ips, ctx.rank)
        self._server = RendezvousServer(ips[0], plan) if ctx.rank == 0 else None
        self._saved: Dict[str, Optional[str]] = {}
        try:
            # allGather goes through Spark's driver: address and secret reach this fit's tasks.
            server = self._server
            sent = f"{server.port} {server.rendezvous_address}" if server is not None else ""
            port, address = ctx.all_gather(sent)[0].split()
            env = {k: str(v) for k, v in create_slot_env_vars(slot).items()}
            env.update({k: str(v) for k, v in create_run_env_vars(
                address, [_interface_for(ips[ctx.rank])], int(port)).items()})
            self._saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            hvd.init()
        except BaseException:
            self._release()
            raise
        self.rank, self.world_size = hvd.rank(), hvd.size()

    def wrap(self, model: torch.nn.Module, optimizer: Any, backward_passes_per_step: int = 1,
             compression: Optional[str] = None, broadcast: bool = True
             ) -> Tuple[torch.nn.Module, Any]:
        """Broadcast rank 0's parameters (unless ``broadcast=False``: every rank loaded the
        same weights) and optimizer state; ``hvd.DistributedOptimizer``
        averages gradients once every ``backward_passes_per_step`` backward passes,
        compressed with ``hvd.Compression.fp16`` when ``compression="fp16"``."""
        hvd = self.hvd
        if compression not in (None, "fp16"):
            raise ValueError(f"gradient compression {compression!r}; expected None or 'fp16'")
        if broadcast:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        codec = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=codec,
                                               backward_passes_per_step=backward_passes_per_step)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def close(self) -> None:
        try:
            self.hvd.shutdown()
        finally:
            self._release()

    def _release(self) -> None:
        """Stop rank 0's rendezvous server and give the process its environment back."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = {}
