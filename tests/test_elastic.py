"""Elastic training's rules without Spark: how many ranks a generation gets, the batch rule,
re-sharding across a change, and the epoch driver's regroup (real checkpoint files)."""
import math

import pytest

from sparktrain.data.reader import shard_range, steps_per_epoch
from sparktrain.launch.elastic import ElasticPlan, Generation, Regroup, for_rank
from sparktrain.launch.rank_context import RankContext
from sparktrain.loop.checkpoint import Checkpoints
from sparktrain.loop.epochs import EpochDriver


def test_a_generation_takes_the_free_slots_within_the_bounds():
    plan = ElasticPlan(num_proc=4, min_num_proc=2)
    assert [plan.ranks(slots) for slots in (9, 4, 3, 2, None)] == [4, 4, 3, 2, 4]
    with pytest.raises(RuntimeError, match=r"min_num_proc=2 needs 2 task slots .* the cluster "
                                           r"has 1 \(num_proc=4\): not waiting"):
        plan.ranks(1)
    assert not ElasticPlan(num_proc=3, min_num_proc=3).elastic
    with pytest.raises(ValueError, match="min_num_proc must be between 1 and num_proc=3, got 4"):
        ElasticPlan(num_proc=3, min_num_proc=4)
    with pytest.raises(ValueError, match="elastic_batch must be one of"):
        ElasticPlan(num_proc=3, min_num_proc=2, batch="local")
    # tasks of 4 ranks (one per GPU): generations grow and shrink by whole tasks
    gpus = ElasticPlan(num_proc=12, min_num_proc=4)
    assert [gpus.ranks(slots, per_task=4) for slots in (16, 12, 11, 8, 4)] == [12, 12, 8, 8, 4]


def test_the_global_batch_and_every_row_once_per_epoch_across_a_change():
    rows, batch, most = 10_007, 32, 4
    for ranks in (4, 3, 2):
        generation = Generation(0, most, ranks, "global")
        per_rank = generation.batch_size(batch)
        assert per_rank == math.ceil(batch * most / ranks)
        assert per_rank * ranks >= batch * most > (per_rank - 1) * ranks  # the global batch
        # steps per epoch (and so a per-step schedule) barely move with the ranks
        assert abs(steps_per_epoch(rows, ranks, per_rank) - math.ceil(rows / (batch * most))) <= 1
        # the shards cover the rows exactly once, whatever the number of ranks
        covered = [i for rank in range(ranks) for i in range(*shard_range(rows, rank, ranks))]
        assert covered == list(range(rows))
    assert Generation(0, most, 2, "rank").batch_size(batch) == batch


def test_scale_learning_rate_scales_by_the_global_batchs_ranks():
    from types import SimpleNamespace

    from sparktrain.launch.elastic import scaling_ranks

    assert scaling_ranks(SimpleNamespace(generation=None), 3) == 3  # not elastic
    keep = Generation(1, 4, 2, "global").to_json()
    assert scaling_ranks(SimpleNamespace(generation=keep), 2) == 4
    assert scaling_ranks(SimpleNamespace(generation=Generation(1, 4, 2, "rank").to_json()), 2) == 2


def test_a_rank_trains_its_generations_batch(tmp_path):
    from sparktrain.options.spec import LoopSpec

    spec = LoopSpec(columns=[], feature_cols=["x"],
                    label_cols=["y"], batch_size=32, val_batch_size=32, epochs=2, shuffle=False,
                    seed=None, verbose=0, backend="torch", strategy="ddp")
    ctx = RankContext(rank=0, world_size=3, hosts=["h"] * 3, cpus=1, resources={}, barrier=None)
    assert for_rank(spec, ctx) is spec  # not elastic: untouched
    ctx.generation = Generation(2, 4, 3, "global", str(tmp_path / "flag"))
    changed = for_rank(spec, ctx)
    assert changed.batch_size == 43 and Generation.from_json(changed.generation).index == 2


class _Training:
    """One rank's scripted training: loss 1 / (epoch + 1)."""

    def all_reduce_sum(self, values):
        return list(values)

    def train_epoch(self, epoch, reporter):
        return {"loss": 1.0 / (epoch + 1)}

    def evaluate(self, epoch):
        return {}

    def epoch_end(self, epoch, logs):
        return False

    def checkpoint(self, epoch, logs):
        return f"state-{epoch + 1}".encode(), {}


def test_ranks_regroup_after_the_epochs_checkpoint_and_the_next_generation_resumes(tmp_path):
    flag = tmp_path / "regroup-0"  # generation 0's (the driver writes one per generation)
    run = str(tmp_path / "run")
    lines = []

    def driver(index, ranks):
        return EpochDriver(rank=0, world_size=ranks, epochs=5, run_path=run, log=lines.append,
                           generation=Generation(index, 3, ranks, "global",
                                                 str(tmp_path / f"regroup-{index}")))

    first = driver(0, 2)

    class AskAfterTwo(_Training):
        def epoch_end(self, epoch, logs):
            if epoch == 1:
                flag.write_text("regroup")  # the driver's watcher, during epoch 2
            return False

    with pytest.raises(Regroup):
        first.run(AskAfterTwo())
    latest = Checkpoints(run).latest()
    assert latest.epochs_done == 2 and "stopped" not in latest.meta  # the fit goes on
    assert latest.meta["history"]["num_proc"] == [2.0, 2.0]
    assert lines[-1] == "regrouping after epoch 2: more task slots are free"

    second = driver(1, 3)
    assert second.resume_bytes() == b"state-2"
    assert second.run(_Training()) is None
    assert second.history["num_proc"] == [2.0, 2.0, 3.0, 3.0, 3.0]
    assert second.history["loss"] == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    assert [(a["generation"], a["ranks"], a["start_epoch"]) for a in second.attempts] == \
        [(0, 2, 0), (1, 3, 2)]


def test_no_regroup_after_the_last_epoch(tmp_path):
    flag = tmp_path / "regroup-0"
    flag.write_text("regroup")
    last = EpochDriver(rank=0, world_size=2, epochs=1, run_path=str(tmp_path / "run"),
                       log=lambda line: None, generation=Generation(0, 3, 2, "global", str(flag)))
    assert last.run(_Training()) is None


class _Slots:
    """The cluster's slot count over time: ``counts`` one per look (the last repeats), as
    executors are lost and a cluster manager starts replacements."""

    def __init__(self, *counts):
        self.counts, self.looks = list(counts), 0

    def now(self):
        self.looks += 1
        return self.counts[min(self.looks, len(self.counts)) - 1]


def test_after_a_loss_below_min_num_proc_the_next_generation_waits_for_replacements(spark):
    """Every executor lost at once (a NodeManager holding them all): the next generation
    waits up to the slot wait for the cluster manager's replacements, then starts with
    them; where none come, it has the count to fail with."""
    from sparktrain.launch.barrier import SLOT_WAIT_CONF
    from sparktrain.launch.elastic import _after_loss

    plan = ElasticPlan(num_proc=2, min_num_proc=1)
    spark.conf.set(SLOT_WAIT_CONF, "30")
    try:
        replaced = _Slots(0, 0, 1)
        assert _after_loss(spark, replaced, plan) == 1 and replaced.looks == 3
        assert _after_loss(spark, _Slots(2), plan) == 2  # enough at once: no wait
        spark.conf.set(SLOT_WAIT_CONF, "2")
        assert _after_loss(spark, _Slots(0), plan) == 0  # none came: the count to fail with
    finally:
        spark.conf.unset(SLOT_WAIT_CONF)
    with pytest.raises(RuntimeError, match="min_num_proc=1 needs 1 task slots"):
        plan.ranks(0)
