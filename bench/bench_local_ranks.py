"""What a task's local ranks cost to start: sparktrain's launch of one process per GPU
(``launch.local_ranks.run_places``) against ``torch.multiprocessing.spawn``, what a user would
write by hand, for 1 to 8 ranks, without Spark.

Each variant starts N fresh Python processes that form one gloo process group (sparktrain:
through rank 0's ``TCPStore`` and gather server, with its rank context, events and results
files; by hand: ``init_process_group`` with ``MASTER_ADDR``/``MASTER_PORT``), all-reduce one
tensor and return. The time is from the call to every rank's result being back. On a GPU
machine the same launch joins an NCCL group (``bench/gpu_check.py``'s ``local_ranks`` check).

Example::

    .venv/bin/python bench/bench_local_ranks.py --ranks 1,2,4,8 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def sparktrain_rank(ctx: Any) -> float:
    """A local rank: join the fit's group (as the ``torch`` engine does), all-reduce, leave."""
    import torch

    from sparktrain.launch.torch_ddp import TorchDDP

    engine = TorchDDP(ctx, torch.device("cpu"))
    total = float(engine.all_reduce_sum(torch.ones(1)))
    engine.close()
    return total


def spawned_rank(rank: int, world: int, port: int, folder: str) -> None:
    """``torch.multiprocessing.spawn``'s rank: the same work, rendezvous by environment."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    with open(os.path.join(folder, f"{rank}"), "w") as out:
        out.write(str(float(total)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_sparktrain(ranks: int) -> float:
    from sparktrain.launch.local_ranks import run_places
    from sparktrain.launch.rank_context import Place

    places = [Place(i, ranks, ["127.0.0.1"] * ranks, 1, {"gpu": [str(i)]}, 0, i, ranks)
              for i in range(ranks)]
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        results = run_places(sparktrain_rank, (folder, None, False, 1), places)
        seconds = time.perf_counter() - started
    assert [total for _, total in results] == [float(ranks)] * ranks, results
    return seconds


def time_spawn(ranks: int) -> float:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        mp.spawn(spawned_rank, args=(ranks, free_port(), folder), nprocs=ranks, join=True)
        seconds = time.perf_counter() - started
        totals = [float(open(os.path.join(folder, str(r))).read()) for r in range(ranks)]
    assert totals == [float(ranks)] * ranks, totals
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default=os.path.join(REPO, "bench", "local_ranks.png"))
    parser.add_argument("--json-out", default=os.path.join(REPO, "bench", "results",
                                                           "bench_local_ranks.json"))
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["SPARKTRAIN_FAKE_GPUS"] = "1"  # the places hold fake GPUs: train on the CPU
    rows: List[Dict[str, Any]] = []
    time_sparktrain(1), time_spawn(1)  # warm the page cache for both
    for ranks in (int(r) for r in args.ranks.split(",")):
        ours = [time_sparktrain(ranks) for _ in range(args.repeats)]
        spawn = [time_spawn(ranks) for _ in range(args.repeats)]
        row = {"ranks": ranks, "sparktrain_s": round(statistics.median(ours), 2),
               "spawn_s": round(statistics.median(spawn), 2)}
        row["ratio"] = round(row["spawn_s"] / row["sparktrain_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| ranks | sparktrain local ranks | torch.multiprocessing.spawn | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['sparktrain_s']} s | {row['spawn_s']} s | "
              f"{row['ratio']}× |")
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as out:
        json.dump({"rows": rows, "cpus": os.cpu_count(),
                   "load": os.getloadavg()[0]}, out, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ranks = [row["ranks"] for row in rows]
    ax.plot(ranks, [row["sparktrain_s"] for row in rows], "o-", label="sparktrain local ranks")
    ax.plot(ranks, [row["spawn_s"] for row in rows], "s--", label="torch.multiprocessing.spawn")
    ax.set_xlabel("ranks (processes) in one task")
    ax.set_ylabel("seconds to a formed group and back")
    ax.set_title(f"Starting a task's ranks ({os.cpu_count()} cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
