"""The ``horovod`` backend for PyTorch: Horovod over Gloo inside the Spark barrier tasks.

No home-made rendezvous: the barrier task of partition 0 runs Horovod's own HTTP
``RendezvousServer`` (what ``horovodrun``'s Gloo launcher runs on its driver), initialised with
Horovod's ``get_host_assignments`` over the hosts of the barrier tasks; its port reaches the
other tasks through ``BarrierTaskContext.allGather``; each task takes the environment Horovod's
launcher would give it (``create_slot_env_vars`` + ``create_run_env_vars``: rank, size,
local/cross rank and size, hostname, rendezvous address, controller and CPU operations
``gloo``, network interface) and calls ``hvd.init()``.

Learning rate: used as given, as Horovod's Spark estimators do (no scaling by the number of
processes). ``hvd.DistributedOptimizer`` averages gradients; parameters and optimizer state are
broadcast from rank 0 before the first step.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Tuple

import torch

from sparktrain.launch.barrier import RankContext


def _interface_for(ip: str) -> str:
    """Name of the network interface that holds ``ip`` (Gloo binds its devices to it)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    if ip.startswith("127."):
        return "lo"
    raise RuntimeError(f"no network interface holds {ip}; set HOROVOD_GLOO_IFACE")


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


class HorovodTorch:
    """Horovod (Gloo) for one rank; same interface as :class:`~.torch_ddp.TorchDDP`."""

    name = "horovod"

    def __init__(self, ctx: RankContext, device: torch.device) -> None:
        import horovod.torch as hvd
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer

        self.device = device
        ips = [socket.gethostbyname(h) for h in ctx.hosts]
        slot, plan = slot_for(ips, ctx.rank)
        self._server = None
        if ctx.rank == 0:
            self._server = RendezvousServer()
            port = self._server.start()
            self._server.init(plan)
        ports = ctx.all_gather(str(port) if self._server is not None else "")
        env: Dict[str, str] = {k: str(v) for k, v in create_slot_env_vars(slot).items()}
        env.update({k: str(v) for k, v in create_run_env_vars(
            ips[0], [_interface_for(ips[ctx.rank])], int(ports[0])).items()})
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        hvd.init()
        self.hvd = hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()

    def wrap(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def close(self) -> None:
        try:
            self.hvd.shutdown()
        finally:
            if self._server is not None:
                self._server.stop()
                self._server = None
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
