"""The pickled objects a fit ships to its ranks, one dataclass per framework.

The spec (:mod:`sparktrain.options.spec`) holds the plain values; the payload holds what only
pickles: the model, the optimizer, the loss, the user's functions, and the strategy (and, for
torch, engine) classes the driver resolved (so a strategy or an engine registered only in the
driver's process trains on the executors too). Both frameworks ship it the same way: the estimator
builds one, :meth:`Payload.dumps` makes the bytes (cloudpickle; your own code by value, see
:mod:`sparktrain.pickling`), the store carries them to the ranks, and the rank loop reads them
back with :meth:`Payload.loads`.

A leaf module (no framework, no ``pyspark.ml``): the estimators, the launchers, the strategies
and the rank loops all import it. Unpickling a payload imports the framework its objects
belong to, so each framework's payload is read only where that framework runs (a torch rank,
the Keras child process).

Example::

    blob = TorchPayload(model=shipped, loss=torch.nn.MSELoss(), strategy=DataParallel,
                        engine=TorchDDP).dumps()              # on the driver
    payload = TorchPayload.loads(blob)                        # on a rank
    payload.loss
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Type, TypeVar

P = TypeVar("P", bound="Payload")


@dataclass
class Payload:
    """What both frameworks' payloads have; subclasses add the framework's objects."""

    #: ``transformation_fn``: a dict of numpy columns -> a dict of numpy columns, or ``None``
    transformation_fn: Optional[Callable] = None
    callbacks: List[Any] = field(default_factory=list)
    #: the registered strategy's class (a ``TorchStrategy`` or ``KerasStrategy`` subclass)
    strategy: Optional[type] = None

    def dumps(self) -> bytes:
        """The bytes that travel to the ranks (cloudpickle, your own code by value)."""
        from sparktrain.pickling import dumps

        return dumps(self)

    @classmethod
    def loads(cls: Type[P], blob: bytes) -> P:
        """The payload :meth:`dumps` made; a ``TypeError`` if ``blob`` holds something else."""
        import cloudpickle

        payload = cloudpickle.loads(blob)
        if not isinstance(payload, cls):
            raise TypeError(f"expected a pickled {cls.__name__}, got "
                            f"{type(payload).__name__}")
        return payload


@dataclass
class TorchPayload(Payload):
    """One torch fit's objects (``TorchEstimator._payload``; read by
    :mod:`sparktrain.loop.torch_loop`).

    ``model`` is a :class:`~sparktrain.loop.torch_files.ShippedModule` (the module and its
    optimizer, pickled together so the optimizer keeps pointing at the module's parameters
    after unpickling; the weights stay in a file in the store) or a ``BuiltModule`` (a model
    callable the ranks call)."""

    model: Any = None
    loss: Any = None
    metrics: List[Any] = field(default_factory=list)
    #: the registered engine's class (a ``TorchEngine`` subclass, :mod:`sparktrain.launch.engine`)
    engine: Optional[type] = None
    # Horovod's params
    loss_constructors: Any = None
    train_minibatch_fn: Optional[Callable] = None
    # the strategy's
    strategy_options: Dict[str, Any] = field(default_factory=dict)
    fsdp_wrap: Any = None
    activation_checkpointing: Any = None
    lr_scheduler: Any = None


@dataclass
class KerasPayload(Payload):
    """One Keras fit's objects (``KerasEstimator._payload``; read in the Keras child process,
    :mod:`sparktrain.loop.keras_loop`, and by the parameter servers' workers). ``model`` is the
    ``.keras`` file's bytes; ``optimizer`` and ``loss`` are names or Keras' serialized form.
    The engine's class travels beside it to the Spark tasks (which start the child process and
    never unpickle this payload: it would import TensorFlow there)."""

    model: bytes = b""
    optimizer: Any = None
    loss: Any = None
    metrics: List[Any] = field(default_factory=list)
    custom_objects: Dict[str, Any] = field(default_factory=dict)
