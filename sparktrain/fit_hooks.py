"""Hooks around every estimator fit, so that plug-ins (MLflow tracking) follow fits without the
estimators importing them (issue #26: imports run one way, estimators never up into a plug-in).

A hook is a function ``hook(estimator)`` returning a context manager that wraps the whole fit
and yields a :class:`FitListener`; the fit calls the listener's methods as it goes. Hooks are
registered by name, as a function or a ``"module:function"`` string imported at the first fit
(:func:`sparktrain.plugins.load`). MLflow's is registered here by its string, so
``mlflow_logging=True`` or ``mlflow.autolog()`` work without importing :mod:`sparktrain.mlflow`.

Example (a hook of your own)::

    @contextmanager
    def timing(estimator):
        started = time.time()
        yield FitListener()
        print(type(estimator).__name__, "took", time.time() - started)

    register_fit_hook("timing", timing)
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Union

from sparktrain.plugins import load


class FitListener:
    """What a fit tells a hook, in order; every method does nothing here (override some)."""

    def started(self, run_id: str, store: Any, spark: Any) -> None:
        """Params checked, the run named: training is about to start."""

    def on_progress(self, event: Dict[str, Any]) -> None:
        """A progress event from the ranks (``start``, ``epoch``: see
        :mod:`sparktrain.estimators.progress`)."""

    def trained(self, result: Dict[str, Any]) -> None:
        """Rank 0's result: history, stop reason, attempts."""

    def fitted(self, model: Any, dataset: Any) -> None:
        """The fitted model, and the DataFrame it was fitted on."""


Hook = Callable[[Any], ContextManager[FitListener]]

#: name -> hook, or its "module:function"; entered in this order around every fit
FIT_HOOKS: Dict[str, Union[str, Hook]] = {
    # logs a fit to MLflow when mlflow_logging/autolog says so (imports no MLflow otherwise)
    "mlflow": "sparktrain.mlflow.tracking:track_fit",
}


def register_fit_hook(name: str, hook: Union[str, Hook]) -> None:
    """Enter ``hook`` (a function or its ``"module:function"``) around every later fit in this
    process; a hook registered under the same name before is replaced."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a fit hook's name must be a non-empty string, got {name!r}")
    if not (isinstance(hook, str) or callable(hook)):
        raise TypeError(f"register a fit hook as a function or a 'module:function' string, "
                        f"got {type(hook).__name__}")
    FIT_HOOKS[name] = hook


class _Listeners(FitListener):
    """Several hooks' listeners as one: each method calls them all, in registration order."""

    def __init__(self, listeners: List[FitListener]) -> None:
        self.listeners = listeners

    def started(self, run_id: str, store: Any, spark: Any) -> None:
        for listener in self.listeners:
            listener.started(run_id, store, spark)

    def on_progress(self, event: Dict[str, Any]) -> None:
        for listener in self.listeners:
            listener.on_progress(event)

    def trained(self, result: Dict[str, Any]) -> None:
        for listener in self.listeners:
            listener.trained(result)

    def fitted(self, model: Any, dataset: Any) -> None:
        for listener in self.listeners:
            listener.fitted(model, dataset)


@contextmanager
def fit_hooks(estimator: Any) -> Iterator[FitListener]:
    """Every registered hook entered around one fit of ``estimator``; yields their listener.

    An error in the fit reaches each hook's context manager (last registered first), as in
    nested ``with`` blocks.
    """
    with ExitStack() as stack:
        listeners = []
        for hook in list(FIT_HOOKS.values()):
            listeners.append(stack.enter_context(load(hook)(estimator)))
        yield listeners[0] if len(listeners) == 1 else _Listeners(listeners)
