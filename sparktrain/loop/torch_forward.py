"""How a torch model is called, and which of its outputs the loss, metrics and ``transform`` use.

The rule (docs/huggingface.md), the same in training, in the driver's preflight and in
``TorchModel.transform``:

* **Keywords or positions.** When every feature column's name is a parameter of the model's
  ``forward``, the model is called by keyword (``model(input_ids=..., attention_mask=...)``);
  otherwise positionally, ``model(*features)`` in ``feature_cols`` order.
* **The model's own loss.** ``loss=None`` with one label column and a ``forward`` that takes
  ``labels``: the label is passed as ``labels=`` and the output's ``loss`` is what training
  minimizes (Hugging Face's convention). Evaluation does the same, so ``val_loss`` is the
  model's loss too.
* **Outputs.** A tensor, or a tuple/list of tensors (one per label column), is used as it is.
  A dict or a ``ModelOutput`` gives its ``output_key`` entry (default ``"logits"``): what a
  given ``loss`` and the metrics receive, and what ``transform`` writes.

Importing this module does not import torch.

Example::

    rule = ForwardRule.for_model(bert, ["input_ids", "attention_mask"], labels=1,
                                 loss_given=False)
    result = rule.call(bert, [ids, mask], [label])   # bert(input_ids=, attention_mask=, labels=)
    rule.loss(result), rule.outputs(result)          # result.loss, [result.logits]
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sparktrain.faults import mark_user_error

#: the output entry used by default when a model returns a dict or a ModelOutput
DEFAULT_OUTPUT_KEY = "logits"


def forward_parameters(model: Any) -> Tuple[List[str], bool]:
    """The named parameters of ``model.forward`` and whether it takes ``**kwargs``; a wrapper
    whose ``forward(*args, **kwargs)`` passes them on to its ``get_base_model()`` (peft's
    ``PeftModel`` made without a ``task_type``) has its base model's."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError, AttributeError):
        return [], False
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    named = [n for n, k in kinds.items()
             if k in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    passes_on = inspect.Parameter.VAR_KEYWORD in kinds.values()
    base = getattr(model, "get_base_model", None)
    if not named and passes_on and callable(base) and base() is not model:
        return forward_parameters(base())
    return named, passes_on


def takes_labels(model: Any) -> bool:
    """True when the model's ``forward`` has a ``labels`` parameter (it can compute its loss)."""
    return "labels" in forward_parameters(model)[0]


@dataclass(frozen=True)
class ForwardRule:
    """The calling convention for one model and its columns (see the module)."""

    feature_names: Tuple[str, ...]
    keywords: bool
    model_loss: bool
    output_key: Optional[str] = None

    @classmethod
    def for_model(cls, model: Any, feature_names: Sequence[str], labels: int = 0,
                  loss_given: bool = True, output_key: Optional[str] = None) -> "ForwardRule":
        """The rule for ``model`` fed ``feature_names``; ``labels`` label columns, and
        whether a loss was given (otherwise the model computes its own, when it can)."""
        named, _ = forward_parameters(model)
        keywords = bool(feature_names) and all(name in named for name in feature_names)
        model_loss = not loss_given and labels == 1 and "labels" in named
        return cls(tuple(feature_names), keywords, model_loss, output_key)

    def call(self, model: Any, features: Sequence[Any], labels: Sequence[Any] = ()) -> Any:
        """Run ``model`` on ``features`` (and ``labels=`` when the model computes the loss)."""
        if not self.keywords:
            if self.model_loss and labels:
                return model(*features, labels=labels[0])
            return model(*features)
        kwargs = dict(zip(self.feature_names, features, strict=True))
        if self.model_loss and labels:
            kwargs["labels"] = labels[0]
        return model(**kwargs)

    def outputs(self, result: Any) -> List[Any]:
        """The output tensor(s) in ``result`` (see the module)."""
        if isinstance(result, dict):  # ModelOutput is an OrderedDict
            key = self.output_key or DEFAULT_OUTPUT_KEY
            if key not in result or result[key] is None:
                given = f"output_key={self.output_key!r}" if self.output_key else \
                    f"no output_key (default {DEFAULT_OUTPUT_KEY!r})"
                raise mark_user_error(ValueError(
                    f"the model returned a {type(result).__name__} with the entries "
                    f"{[k for k in result if result[k] is not None]}, and {given} names none of "
                    f"them: set output_key to the entry the loss, metrics and transform use"),
                    "the model's outputs")
            return [result[key]]
        if self.output_key is not None:
            raise mark_user_error(ValueError(
                f"output_key={self.output_key!r} is set, but the model returned a "
                f"{type(result).__name__}, not a dict or ModelOutput"), "the model's outputs")
        return list(result) if isinstance(result, (list, tuple)) else [result]

    def loss(self, result: Any) -> Any:
        """The loss the model computed (``model_loss``): its output's ``loss``."""
        value = result.get("loss") if isinstance(result, dict) else getattr(result, "loss", None)
        if value is None:
            entries = f" with the entries {list(result)}" if isinstance(result, dict) else ""
            raise mark_user_error(ValueError(
                f"loss=None: the model was called with labels= but returned a "
                f"{type(result).__name__}{entries} without a loss; pass loss=... (it receives "
                f"the output {self.output_key or DEFAULT_OUTPUT_KEY!r}), or use a model that "
                f"computes its loss from labels="), "the model's loss")
        return value
