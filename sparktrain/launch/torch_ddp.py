"""The ``torch`` backend: a ``torch.distributed`` process group formed from the barrier tasks.

Rendezvous needs no port guessing: rank 0 opens a ``TCPStore`` on a free port of its
executor's address, the port and a per-fit secret travel to the other ranks through
``BarrierTaskContext.allGather``, and every rank joins with ``init_process_group(store=...)``.
Gloo on CPU, NCCL when the rank has a GPU.

What listens, and where (see docs/security.md):

- rank 0's ``TCPStore`` listens on its executor's address only (the address Spark gives for the
  task), never on all interfaces: sparktrain binds the socket itself and hands it to the store.
- Gloo's own sockets bind to the interface that holds the rank's executor address
  (``GLOO_SOCKET_IFNAME``, unless you set it or ``TORCH_GLOO_SOCKET_IFNAME`` yourself).
- Every rendezvous key lives under a random per-fit prefix (``PrefixStore``). This keeps fits
  and stray clients from colliding with this fit's keys; it is *not* authentication:
  ``TCPStore`` has no access control and answers ``list_keys`` to any client that connects,
  and Gloo's connections are unauthenticated plain TCP. Anyone who can reach an executor's
  address while a fit runs can read or disturb it; keep executors on a network only the
  cluster reaches, as for any ``torch.distributed`` job.

Example (executor side)::

    dist = TorchDDP(rank_ctx, torch.device("cpu"))
    model, optimizer = dist.wrap(model, optimizer)
    ...
    dist.close()
"""
from __future__ import annotations

import inspect
import os
import secrets
import socket
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Deque, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from sparktrain.launch.engine import TorchEngine
from sparktrain.launch.rank_context import RankContext

TIMEOUT = timedelta(minutes=30)
_GLOO_IFNAME_VARS = ("TORCH_GLOO_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_DDP_OPTIONS = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters

# Tensors handed to our own collectives stay referenced here, beyond the group's lifetime.
# Gloo's worker threads drop their reference to a finished op's tensors a moment after the op
# completes; if Python has already freed the tensor by then, that drop needs the GIL. When the
# process group is destroyed at that moment (its destructor joins the threads while holding the
# GIL), the two wait for each other forever. Seen here as a hang at the end of a fit.
_KEEP_ALIVE: Deque[torch.Tensor] = deque(maxlen=16)


def interface_for(host: str) -> Optional[str]:
    """Name of the network interface that holds ``host``'s IPv4 address, or ``None``."""
    import psutil

    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return "lo" if ip.startswith("127.") else None


def listen_on(host: str) -> socket.socket:
    """A TCP socket bound to ``host`` (not to all interfaces) on a free port, listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"rank 0 cannot listen on its executor's address {host!r} (the "
                           f"address Spark reports for the task): {exc}") from None
    return sock


def _master_store(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0's ``TCPStore`` server, listening on ``host`` only.

    ``TCPStore`` binds all interfaces when it opens its own socket; given ``master_listen_fd``
    it serves on a socket bound here instead (both its libuv and its classic backend honour
    it) and takes the descriptor over: it closes it when the store goes away.
    """
    sock = listen_on(host)
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=TIMEOUT,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def _gloo_interface(host: str) -> Iterator[None]:
    """Make Gloo bind its sockets to the interface of ``host`` (the rank's executor address)
    while the group forms, unless the user chose an interface; without it Gloo uses whatever
    the machine's hostname resolves to."""
    name = None if any(os.environ.get(v) for v in _GLOO_IFNAME_VARS) else interface_for(host)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def has_state_buffers(model: torch.nn.Module) -> bool:
    """Whether ``model`` has buffers that are part of its state (``state_dict``), which DDP
    must keep equal over the ranks by broadcasting rank 0's before every forward (BatchNorm's
    running statistics). Non-persistent buffers are not state: constants made from the config
    (a transformer's position ids, causal masks, rotary frequencies), equal on every rank, so
    broadcasting them each step is a wasted collective (3% of a BERT rank's CPU time here, and
    one more wait for the slower rank)."""
    state = model.state_dict(keep_vars=True)
    return any(name in state for name, _ in model.named_buffers())


def _buffer_options(model: torch.nn.Module) -> Dict[str, Any]:
    """DDP's keyword that turns off the buffer broadcast before every forward, for a model
    whose buffers are all constants (:func:`has_state_buffers`); ``{}`` (DDP's defaults) for a
    model without buffers or with state buffers. torch >= 2.13 renamed the per-forward half of
    ``broadcast_buffers`` ``forward_sync_buffers`` and deprecated the old name."""
    if not any(True for _ in model.buffers()) or has_state_buffers(model):
        return {}
    name = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_OPTIONS \
        else "broadcast_buffers"
    return {name: False}


class TorchDDP(TorchEngine):
    """Process group + ``DistributedDataParallel`` wrapping for one rank."""

    fp16_loss_scaling = True  # GradScaler scales the loss; DDP all-reduces scaled gradients
    torch_distributed = True  # the default process group: FSDP shards over it

    def __init__(self, ctx: RankContext, device: torch.device) -> None:
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, device
        master = ctx.hosts[0]
        server = _master_store(master, ctx.world_size) if ctx.rank == 0 else None
        # allGather goes through Spark's driver (authenticated when spark.authenticate is on):
        # the port and the secret prefix reach exactly this fit's tasks.
        sent = f"{server.port} {secrets.token_hex(16)}" if server is not None else ""
        port, secret = ctx.all_gather(sent)[0].split()
        base = server if server is not None else dist.TCPStore(
            master, int(port), ctx.world_size, is_master=False, timeout=TIMEOUT)
        store = dist.PrefixStore(f"sparktrain-{secret}", base)
        backend = "nccl" if device.type == "cuda" else "gloo"
        with _gloo_interface(ctx.hosts[ctx.rank]):
            dist.init_process_group(backend, store=store, rank=ctx.rank,
                                    world_size=ctx.world_size, timeout=TIMEOUT)
        self._store: Optional[dist.PrefixStore] = store  # rank 0's server must outlive the group

    def wrap(self, model: torch.nn.Module, optimizer: Any, backward_passes_per_step: int = 1,
             compression: Optional[str] = None, broadcast: bool = True
             ) -> Tuple[torch.nn.Module, Any]:
        """DDP-wrap ``model`` (rank 0's parameters are broadcast on construction unless
        ``broadcast=False``: every rank loaded the same weights).

        ``backward_passes_per_step`` is accepted for the shared interface; with DDP the
        training loop accumulates gradients itself (``no_sync`` on all but the last pass).
        ``compression="fp16"`` registers DDP's ``fp16_compress_hook``: gradient buckets are
        cast to float16, all-reduced and cast back, what Horovod's ``Compression.fp16`` does.
        """
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        if compression not in (None, "fp16"):
            raise ValueError(f"gradient compression {compression!r}; expected None or 'fp16'")
        if self.world_size == 1 or not any(p.requires_grad for p in model.parameters()):
            return model, optimizer
        ids = [self.device.index] if self.device.type == "cuda" else None
        # init_sync=False skips the shape check and the broadcast of every parameter and
        # buffer, frozen ones included (torch's DistributedDataParallel docs); a torch without
        # the option broadcasts, which costs memory, not correctness
        skip = not broadcast and "init_sync" in _DDP_OPTIONS
        sync: Dict[str, Any] = {"init_sync": False} if skip else {}
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=ids, **_buffer_options(model), **sync)
        if compression == "fp16":
            # PyTorch's built-in DDP communication hook: casts each gradient bucket to float16,
            # all-reduces it (divided by the world size) and casts the result back.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        return ddp, optimizer

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            _KEEP_ALIVE.append(tensor)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
