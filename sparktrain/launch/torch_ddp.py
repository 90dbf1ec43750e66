"""The ``torch`` backend: a ``torch.distributed`` process group formed from the barrier tasks.

Rendezvous needs no port guessing: rank 0 opens a ``TCPStore`` on port 0 (the OS picks a free
one), the port travels to the other ranks through ``BarrierTaskContext.allGather``, and every
rank joins with ``init_process_group(store=...)``. Gloo on CPU, NCCL when the rank has a GPU.

Example (executor side)::

    dist = TorchDDP(rank_ctx, torch.device("cpu"))
    model, optimizer = dist.wrap(model, optimizer)
    ...
    dist.close()
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any, Deque, Tuple

import torch
import torch.distributed as dist

from sparktrain.launch.barrier import RankContext

TIMEOUT = timedelta(minutes=30)

# Tensors handed to our own collectives stay referenced here, beyond the group's lifetime.
# Gloo's worker threads drop their reference to a finished op's tensors a moment after the op
# completes; if Python has already freed the tensor by then, that drop needs the GIL. When the
# process group is destroyed at that moment (its destructor joins the threads while holding the
# GIL), the two wait for each other forever. Seen here as a hang at the end of a fit.
_KEEP_ALIVE: Deque[torch.Tensor] = deque(maxlen=16)


class TorchDDP:
    """Process group + ``DistributedDataParallel`` wrapping for one rank."""

    name = "torch"

    def __init__(self, ctx: RankContext, device: torch.device) -> None:
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, device
        master = ctx.hosts[0]
        store = None
        if ctx.rank == 0:
            store = dist.TCPStore(master, 0, ctx.world_size, is_master=True,
                                  timeout=TIMEOUT, wait_for_workers=False)
        ports = ctx.all_gather(str(store.port) if store is not None else "")
        if store is None:
            store = dist.TCPStore(master, int(ports[0]), ctx.world_size, is_master=False,
                                  timeout=TIMEOUT)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                                timeout=TIMEOUT)
        self._store = store  # rank 0's store must outlive the group

    def wrap(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        """DDP-wrap ``model`` (rank 0's parameters are broadcast on construction)."""
        if self.world_size == 1 or not any(p.requires_grad for p in model.parameters()):
            return model, optimizer
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids), optimizer

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            _KEEP_ALIVE.append(tensor)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
