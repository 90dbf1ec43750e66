"""Decode worker pool: order, shared memory round trip, determinism, the memory bound, failures."""
from __future__ import annotations

import io
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from sparktrain.data.workers import SHM_PREFIX, DecodePool, DecodeWorkerError, TransformationFailed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(pid=None):
    """Shared memory blocks left by pools of process ``pid`` (this one by default)."""
    prefix = f"{SHM_PREFIX}{(pid or os.getpid()):x}_"
    if not os.path.isdir("/dev/shm"):
        return []
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


@pytest.fixture(autouse=True)
def no_leftover_blocks():
    yield
    assert blocks() == []


def numbered(n, **extra):
    return [dict({"i": np.array([i])}, **extra) for i in range(n)]


def gone(pid):
    """True when process ``pid`` has exited (a zombie waiting for its reaper counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return True


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        DecodePool(lambda b: b, workers=0)
    with pytest.raises(ValueError, match="start_method"):
        DecodePool(lambda b: b, workers=1, start_method="thread")


def test_results_in_input_order_with_varying_sizes():
    def fn(batch):
        i = int(batch["i"][0])
        time.sleep(0.002 * (i % 4))  # so that later batches often finish first
        n = len(batch["x"])
        return {"i": batch["i"], "x": batch["x"].astype(np.float32) * 2,
                "image": np.full((n, 3, 4), i, np.uint8), "mask": batch["x"] > 3,
                "empty": np.zeros((0, 5)), "scalar": np.array(i, np.int16),
                "text": np.array([f"row{i}"] * n), "strided": np.arange(4 * n)[::4],
                "objects": np.array([b"raw"] * n, dtype=object), "meta": {"i": i}}

    batches = [{"i": np.array([i]), "x": np.arange(i % 7 + 1)} for i in range(50)]
    with DecodePool(fn, workers=2, seed=0) as pool:
        out = list(pool.map(iter(batches)))
    assert [int(b["i"][0]) for b in out] == list(range(50))
    for i, b in enumerate(out):
        n = i % 7 + 1
        assert list(b) == ["i", "x", "image", "mask", "empty", "scalar", "text", "strided",
                           "objects", "meta"]  # key order kept
        np.testing.assert_array_equal(b["x"], np.arange(n, dtype=np.float32) * 2)
        assert b["x"].dtype == np.float32 and b["x"].flags.writeable and b["x"].flags.owndata
        assert b["image"].shape == (n, 3, 4) and (b["image"] == i).all()
        np.testing.assert_array_equal(b["mask"], np.arange(n) > 3)
        assert b["empty"].shape == (0, 5)
        assert b["scalar"].shape == () and b["scalar"] == i and b["scalar"].dtype == np.int16
        assert b["text"].dtype.kind == "U" and list(b["text"]) == [f"row{i}"] * n
        np.testing.assert_array_equal(b["strided"], np.arange(0, 4 * n, 4))
        assert b["objects"].dtype == object and list(b["objects"]) == [b"raw"] * n
        assert b["meta"] == {"i": i}


def test_non_dict_results_pass_through():
    with DecodePool(lambda b: [int(b["i"][0]), "text"], workers=1) as pool:
        assert list(pool.map(numbered(3))) == [[0, "text"], [1, "text"], [2, "text"]]


def test_png_bytes_decoded_with_pillow_in_workers():
    from PIL import Image

    images = np.random.default_rng(0).integers(0, 256, size=(12, 8, 10, 3), dtype=np.uint8)
    encoded = np.empty(len(images), dtype=object)
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded[i] = buffer.getvalue()

    def decode(batch):
        from PIL import Image

        pixels = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in batch["image"]]
        return {"image": np.stack(pixels), "label": batch["label"]}

    batches = [{"image": encoded[i:i + 4], "label": np.arange(i, i + 4)} for i in range(0, 12, 4)]
    with DecodePool(decode, workers=2) as pool:
        out = list(pool.map(batches))
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in out]), images)
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in out]), np.arange(12))


def run_epochs(workers, seed, epochs=(0, 1), start_method=None):
    def augment(batch):  # local, so it travels by value: workers need not import this module
        """Random crops and flips from the global RNGs the pool seeds."""
        n = len(batch["x"])
        return {"crop": np.random.randint(0, 1000, size=n),
                "flip": np.array([random.random() for _ in range(n)]), "x": batch["x"]}

    batches = [{"x": np.arange(i + 2)} for i in range(12)]
    with DecodePool(augment, workers=workers, seed=seed, start_method=start_method) as pool:
        return [list(pool.map(batches, epoch)) for epoch in epochs]


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True))


def test_augmentations_do_not_depend_on_the_number_of_workers():
    one = run_epochs(1, seed=11)
    three = run_epochs(3, seed=11)
    assert same(one[0], three[0]) and same(one[1], three[1])
    assert not same(one[0], one[1])  # each epoch draws afresh
    assert same(run_epochs(2, seed=11, epochs=(1,))[0], one[1])
    assert not same(run_epochs(1, seed=12, epochs=(0,))[0], one[0])
    assert same(run_epochs(1, seed=11, epochs=(0,), start_method="spawn")[0], one[0])


def tracked(n, reads, consumed):
    """``n`` batches; notes how many results were consumed when each batch was read."""
    for i in range(n):
        reads.append((i, len(consumed)))
        yield {"i": np.array([i])}


@pytest.mark.parametrize("max_bytes, bound", [(1, 1), (3000, 3), (1 << 30, 4)])
def test_batches_in_flight_bounded_by_bytes_and_workers(max_bytes, bound):
    # every result is exactly 1000 bytes; 2 workers allow at most 4 in flight
    reads, consumed = [], []

    def fn(b):
        return {"out": np.full(1000, b["i"][0] % 256, np.uint8)}

    with DecodePool(fn, workers=2, max_bytes=max_bytes) as pool:
        for batch in pool.map(tracked(30, reads, consumed)):
            consumed.append(int(batch["out"][0]))
    assert consumed == list(range(30))
    in_flight = [i + 1 - done for i, done in reads]  # read = dispatched at once
    assert max(in_flight) == bound


def test_exception_in_fn_raises_transformation_failed_with_remote_traceback():
    def fn(batch):
        i = int(batch["i"][0])
        if i == 3:
            raise ValueError(f"cannot decode row {i}")
        return {"i": batch["i"]}

    pool = DecodePool(fn, workers=2, name="transformation_fn (train)")
    seen = []
    with pytest.raises(TransformationFailed) as info:
        for batch in pool.map(numbered(10)):
            seen.append(int(batch["i"][0]))
    assert seen == [0, 1, 2]  # raised in its batch's turn
    text = str(info.value)
    assert "transformation_fn (train) raised ValueError: cannot decode row 3" in text
    assert 'raise ValueError(f"cannot decode row {i}")' in text  # the user's line
    assert info.value.exc_type == "ValueError"
    assert "Traceback (most recent call last)" in info.value.remote_traceback
    again = pickle.loads(pickle.dumps(info.value))
    assert again.remote_traceback == info.value.remote_traceback and str(again) == text
    with pytest.raises(TransformationFailed, match="closed after an error"):
        next(pool.map(numbered(1)))
    pool.close()  # idempotent


def test_killed_worker_raises_decode_worker_error_and_closes_the_pool():
    def fn(batch):
        if int(batch["i"][0]) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"pid": np.array(os.getpid())}

    pool = DecodePool(fn, workers=2)
    pids = set()
    with pytest.raises(DecodeWorkerError) as info:
        for batch in pool.map(numbered(10)):
            pids.add(int(batch["pid"]))
    text = str(info.value)
    assert re.search(r"decode worker \d \(pid \d+\) of transformation_fn was killed by SIGKILL "
                     r"while batch 4 of epoch 0 was assigned to it", text), text
    assert "OOM killer" in text and "native decoder" in text
    if sys.platform.startswith("linux"):
        assert all(gone(pid) for pid in pids)  # the other worker was stopped too
    with pytest.raises(DecodeWorkerError):
        next(pool.map(numbered(1)))


def test_early_stop_discards_in_flight_and_pool_stays_usable():
    def fn(batch):
        return {"i": batch["i"], "big": np.full(50_000, int(batch["i"][0]))}

    def broken():
        yield from numbered(3)
        raise OSError("the store went away")

    with DecodePool(fn, workers=2) as pool:
        results = pool.map(numbered(20))
        assert [int(next(results)["i"][0]) for _ in range(3)] == [0, 1, 2]
        results.close()
        assert blocks() == []
        with pytest.raises(OSError, match="went away"):
            list(pool.map(broken()))
        assert blocks() == []
        out = list(pool.map(numbered(6), epoch=1))
        assert [int(b["i"][0]) for b in out] == list(range(6))
        assert all((b["big"] == k).all() for k, b in enumerate(out))
        left_open = pool.map(numbered(20))  # never finished nor closed: the next map drops it
        next(left_open)
        assert [int(b["i"][0]) for b in pool.map(numbered(4))] == [0, 1, 2, 3]
        with pytest.raises(RuntimeError, match="later map"):
            next(left_open)
    with pytest.raises(RuntimeError, match="closed"):
        next(pool.map(numbered(1)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver is the Linux default")
def test_workers_come_from_the_fork_server_without_torch():
    def fn(batch):
        return {"parent": np.array(os.getppid()), "torch": np.array("torch" in sys.modules)}

    with DecodePool(fn, workers=1) as pool:
        out = next(pool.map(numbered(1)))
    assert int(out["parent"]) != os.getpid()  # forked by the fork server, not by us
    assert not out["torch"]


SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from sparktrain.data.workers import DecodePool, DecodeWorkerError, TransformationFailed

    def fn(batch):
        i = int(batch["i"][0])
        if i == 5:
            raise KeyError("five")
        if i == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": np.full(10_000, i)}

    if __name__ == "__main__":
        batches = [{"i": np.array([i])} for i in range(10)]
        pool = DecodePool(fn, workers=2)
        assert len(list(pool.map(batches[:5]))) == 5
        it = pool.map(batches[:5])
        next(it)
        it.close()
        try:  # not past batch 6: a worker killed at 7 could be noticed before 5's error
            list(pool.map(batches[:7]))
        except TransformationFailed:
            pass
        pool = DecodePool(fn, workers=2)
        try:
            list(pool.map(batches[6:]))
        except DecodeWorkerError:
            pass
        print("done", os.getpid())
""")


def test_no_resource_tracker_warnings_or_leftovers_at_exit(tmp_path):
    script = tmp_path / "use_pool.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("done"), proc.stderr
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    assert blocks(int(proc.stdout.split()[1])) == []


def encode_on_threads(batch):
    """Encode a batch with a Hugging Face tokenizer; the worker's thread count before and after
    (tokenizers starts its Rust thread pool on the first parallel encode)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "good": 1, "bad": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    before = len(os.listdir("/proc/self/task"))
    ids = [e.ids for e in tok.encode_batch([str(t) for t in batch["text"]])]
    return {"ids": np.array(ids), "threads": np.array([before, len(os.listdir("/proc/self/task"))]),
            "env": np.array(os.environ.get("TOKENIZERS_PARALLELISM", ""))}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_tokenizers_encode_on_one_thread_in_workers_unless_the_environment_says(monkeypatch):
    pytest.importorskip("tokenizers")
    batch = {"text": np.array(["good bad good"] * 512, dtype=object)}
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    # spawn: the worker starts from this environment (a fork server keeps the one it began with)
    with DecodePool(encode_on_threads, workers=1, start_method="spawn") as pool:
        out = next(pool.map([batch]))
    assert str(out["env"]) == "false" and "TOKENIZERS_PARALLELISM" not in os.environ
    assert out["ids"].shape == (512, 3)
    before, after = out["threads"]
    assert after == before  # no Rust thread pool next to the pool of processes
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # asked for: the pool is there
    with DecodePool(encode_on_threads, workers=1, start_method="spawn") as pool:
        out = next(pool.map([batch]))
    before, after = out["threads"]
    assert str(out["env"]) == "true" and after > before
