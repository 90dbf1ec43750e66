"""The ranks' own all_gather (sparktrain.launch.rank_gather), without Spark: real sockets and
threads standing in for the ranks, a real local filesystem for the published address."""
import socket
import threading
import time

import fsspec
import pytest

from sparktrain.launch.rank_gather import (NO_SERVER, GatherServer, RankGather, connect,
                                           publish)


def _ranks(world_size: int, tmp_path, rounds, fail_rank=None):
    """Run ``world_size`` rank threads: rank 0 serves and publishes, the others connect
    through the published file; each gathers ``rounds(rank)`` messages. Returns per rank the
    answers or the exception."""
    fs, path = fsspec.filesystem("file"), str(tmp_path / "gather-7")
    results = {}

    def rank_main(rank: int) -> None:
        server = None
        try:
            if rank == 0:
                server = GatherServer(world_size, "127.0.0.1")
                publish(fs, path, server.address)
                gather = RankGather(server.address, 0)
            else:
                time.sleep(0.05 * rank)  # ranks arrive at different times
                gather = connect(fs, path, rank)
            answers = []
            for message in rounds(rank):
                if rank == fail_rank and message == "leave":
                    gather.close()  # the rank's process died mid-fit
                    answers.append("left")
                    break
                answers.append(gather(message))
            results[rank] = answers
        except Exception as exc:  # noqa: BLE001 - checked by the test
            results[rank] = exc
        finally:
            if server is not None:
                server.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return results


def test_every_rank_gets_every_message_in_rank_order(tmp_path):
    results = _ranks(3, tmp_path, lambda rank: [f"a{rank}", "", f"c{rank}" * 1000])
    for rank in range(3):
        assert results[rank] == [["a0", "a1", "a2"], ["", "", ""],
                                 ["c0" * 1000, "c1" * 1000, "c2" * 1000]]


def test_a_rank_that_leaves_fails_the_others_at_once(tmp_path):
    start = time.monotonic()
    results = _ranks(3, tmp_path, lambda rank: ["first", "leave", "never"], fail_rank=2)
    assert results[2] == [["first"] * 3, "left"]
    for rank in (0, 1):
        assert isinstance(results[rank], ConnectionError), results[rank]
        assert "a rank left the launch" in str(results[rank])
    assert time.monotonic() - start < 10


def test_a_stranger_without_the_secret_is_not_counted(tmp_path):
    server = GatherServer(2, "127.0.0.1")
    try:
        host, port, _ = server.address.split()
        stranger = RankGather(f"{host} {port} {'0' * 32}", 1)  # wrong secret, rank 1's place
        ranks = {}

        def rank1() -> None:
            ranks[1] = RankGather(server.address, 1)("one")

        thread = threading.Thread(target=rank1)
        thread.start()
        assert RankGather(server.address, 0)("zero") == ["zero", "one"]
        thread.join(10)
        assert ranks[1] == ["zero", "one"]
        with pytest.raises(ConnectionError):
            stranger("let me in")
    finally:
        server.close()


def test_a_stale_address_is_skipped_and_no_server_means_spark(tmp_path):
    fs, path = fsspec.filesystem("file"), str(tmp_path / "gather-3")
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    stale_port = gone.getsockname()[1]
    gone.close()  # an earlier attempt's server: its port now refuses
    publish(fs, path, f"127.0.0.1 {stale_port} {'1' * 32}")
    server = GatherServer(1, "127.0.0.1")
    found = {}
    thread = threading.Thread(target=lambda: found.update(gather=connect(fs, path, 0)))
    thread.start()
    time.sleep(0.3)  # the reader has seen the stale address refused and polls on
    assert thread.is_alive()
    publish(fs, path, server.address)
    thread.join(10)
    assert found["gather"]("only") == ["only"]
    server.close()
    publish(fs, path, NO_SERVER)
    assert connect(fs, path, 1) is None
    with pytest.raises(RuntimeError, match="gave no gather address"):
        connect(fs, str(tmp_path / "never"), 1, wait=0.2)
