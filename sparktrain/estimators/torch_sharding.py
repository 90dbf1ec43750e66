"""Old home of the FSDP helpers, kept so existing imports work: the strategy now lives in
:mod:`sparktrain.strategies.torch_fsdp`, blocks and activation checkpointing in
:mod:`sparktrain.strategies.torch_blocks`."""
from sparktrain.strategies.torch_blocks import (DEFAULT_MIN_PARAMS, blocks,  # noqa: F401
                                                checkpoint_activations, local_parameter_count)
from sparktrain.strategies.torch_fsdp import FullySharded  # noqa: F401
