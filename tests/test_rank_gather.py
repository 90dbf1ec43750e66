"""The ranks' own all_gather (sparktrain.launch.rank_gather), without Spark: real sockets and
threads standing in for the ranks, a real local filesystem for the published address."""
import socket
import threading
import time

import fsspec
import pytest

from sparktrain.launch.rank_gather import NO_SERVER, GatherServer, RankGather, connect, publish


def _ranks(world_size: int, tmp_path, rounds, fail_rank=None):
    """Run ``world_size`` rank threads: rank 0 serves and publishes, the others connect
    through the published file; each gathers ``rounds(rank)`` messages; at the message
    "leave", ``fail_rank`` drops its connection without a goodbye (its process died). Returns
    per rank the answers or the exception, and the ranks reported lost."""
    fs, path = fsspec.filesystem("file"), str(tmp_path / "gather-7")
    results, lost = {}, []

    def rank_main(rank: int) -> None:
        server = None
        try:
            if rank == 0:
                server = GatherServer(world_size, "127.0.0.1", on_lost=lost.append)
                publish(fs, path, server.address)
                gather = RankGather(server.address, 0)
            else:
                time.sleep(0.05 * rank)  # ranks arrive at different times
                gather = connect(fs, path, rank)
            answers = []
            for message in rounds(rank):
                if rank == fail_rank and message == "leave":
                    gather._sock.close()  # as when its process dies: no goodbye
                    answers.append("left")
                    break
                answers.append(gather(message))
            gather.close()
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
    return results, lost


def test_every_rank_gets_every_message_in_rank_order(tmp_path):
    results, lost = _ranks(3, tmp_path, lambda rank: [f"a{rank}", "", f"c{rank}" * 1000])
    for rank in range(3):
        assert results[rank] == [["a0", "a1", "a2"], ["", "", ""],
                                 ["c0" * 1000, "c1" * 1000, "c2" * 1000]]
    assert lost == []  # every rank said goodbye


def test_a_rank_that_dies_is_reported_and_fails_the_others_at_once(tmp_path):
    start = time.monotonic()
    results, lost = _ranks(3, tmp_path, lambda rank: ["first", "leave", "never"], fail_rank=2)
    assert results[2] == [["first"] * 3, "left"]
    assert lost == [2]
    for rank in (0, 1):
        assert isinstance(results[rank], ConnectionError), results[rank]
        assert "rank 2's process ended" in str(results[rank])
    assert time.monotonic() - start < 10


def test_rank_0_dying_is_seen_by_the_others_between_gathers():
    listener = socket.create_server(("127.0.0.1", 0))
    lost = []
    gather = RankGather(f"127.0.0.1 {listener.getsockname()[1]} {'2' * 32}", 1,
                        on_lost=lost.append)
    accepted, _ = listener.accept()
    time.sleep(0.5)
    assert lost == []  # quiet: nothing to see
    accepted.close()  # rank 0's process died: its end of the connection goes, no goodbye
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [0]
    gather.close()
    listener.close()


def test_a_stranger_without_the_secret_is_not_counted(tmp_path):
    server = GatherServer(2, "127.0.0.1")
    try:
        host, port, _ = server.address.split()
        with pytest.raises(ConnectionRefusedError):  # it listens on rank 0's address only
            socket.create_connection(("127.0.0.2", int(port)), timeout=5)
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


def test_a_rank_closes_while_its_other_thread_waits_in_a_gather(tmp_path):
    """A rank that fails while a helper thread of its own waits in a gather (the parameter-
    server roles watch their server that way) closes at once; the helper's wait ends."""
    fs, path = fsspec.filesystem("file"), str(tmp_path / "gather-8")
    server = GatherServer(3, "127.0.0.1")
    try:
        publish(fs, path, server.address)
        gather = connect(fs, path, 1)
        ended = []

        def helper() -> None:  # rank 2 never comes: this gather waits until the close
            try:
                gather("waiting")
            except Exception as exc:  # noqa: BLE001 - checked below
                ended.append(exc)
        thread = threading.Thread(target=helper, daemon=True)
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        gather.close()
        assert time.monotonic() - start < 3.0
        thread.join(5)
        assert not thread.is_alive() and isinstance(ended[0], ConnectionError), ended
    finally:
        server.close()
