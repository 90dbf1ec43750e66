"""Several Keras steps a call (``steps_per_execution``), without Spark: the stacked steps run
each batch once, in order, as one call per batch would; the default count per call."""
from __future__ import annotations

import numpy as np
import pytest

from sparktrain.loop.keras_loop import (  # neither imports TensorFlow
    MAX_STEPS_PER_EXECUTION,
    STACKED_BYTES,
    auto_steps_per_execution,
)
from sparktrain.strategies.keras_strategy import stack_batches, stacked_steps

tf = pytest.importorskip("tensorflow")


def _stateful_step(state):
    """A step whose result depends on the order of the batches (as an optimizer's updates do):
    ``state = state / 2 + sum(x * w)``; its statistics: rows, sum of y, the state after it."""
    def one_step(x, y, w):
        weights = tf.ones_like(y[0]) if w is None else w
        state.assign(state / 2 + tf.reduce_sum(x[0] * weights[:, None]) + tf.reduce_sum(x[1]))
        return tf.stack([tf.cast(tf.shape(y[0])[0], tf.float32), tf.reduce_sum(y[0]), state])
    return one_step


@pytest.mark.parametrize("weighted", [False, True])
def test_stacked_steps_equal_one_call_per_batch(weighted):
    rng = np.random.default_rng(0)
    batches = [([rng.random((4, 3), np.float32), rng.random((4,), np.float32)],
                [rng.random((4,), np.float32)],
                rng.random((4,), np.float32) if weighted else None) for _ in range(5)]

    stacked_state, single_state = tf.Variable(1.0), tf.Variable(1.0)
    stacked, single = stacked_steps(tf, _stateful_step(stacked_state)), \
        stacked_steps(tf, _stateful_step(single_state))
    zeros = tf.zeros([3])

    total = stacked(*stack_batches(tf, batches[:3]), zeros)
    total = stacked(*stack_batches(tf, batches[3:]), total)  # any count a call, one trace
    expected = zeros
    for batch in batches:
        expected = single(*stack_batches(tf, [batch]), expected)
    assert total.numpy()[0] == 20  # every row once
    np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-6)
    np.testing.assert_allclose(stacked_state.numpy(), single_state.numpy(), rtol=1e-6)


def test_default_steps_per_call_fill_the_stacking_budget():
    small = ([tf.zeros([256, 32])], [tf.zeros([256], tf.int64)], None)
    assert auto_steps_per_execution(small) == MAX_STEPS_PER_EXECUTION
    images = ([tf.zeros([64, 224, 224, 3])], [tf.zeros([64], tf.int64)], tf.zeros([64]))
    image_bytes = 64 * 224 * 224 * 3 * 4 + 64 * 8 + 64 * 4
    assert auto_steps_per_execution(images) == STACKED_BYTES // image_bytes == 1
    huge = ([tf.zeros([1, STACKED_BYTES // 2])], [tf.zeros([1])], None)
    assert auto_steps_per_execution(huge) == 1
