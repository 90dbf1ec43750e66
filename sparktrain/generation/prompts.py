"""Where each row's prompt comes from: a column, or a template over columns; and the
tokenizer's chat template where the model has one.

Example::

    spec = PromptSpec(template="Q: {question}\\nA:")
    spec.columns()                                    # ['question']
    spec.check({"question": "string", "id": "bigint"})
    spec.render({"question": ["why?"]})               # ['Q: why?\\nA:']
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class PromptSpec:
    """A row's prompt: the ``column``'s text, or ``template`` with ``{field}`` for columns
    (``str.format`` syntax). ``chat``: wrap it as a user message in the tokenizer's chat
    template (``None``: where the tokenizer has one); ``system``: a system message first."""

    column: Optional[str] = None
    template: Optional[str] = None
    chat: Optional[bool] = None
    system: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.column is None) == (self.template is None):
            raise ValueError("set exactly one of promptCol (a column of prompts) and "
                             "promptTemplate (a template over columns, e.g. 'Q: {question}')")
        if self.template is not None:
            self.columns()  # a malformed template fails here, where it is set

    def columns(self) -> List[str]:
        """The DataFrame columns the prompt reads, in order of first use."""
        if self.column is not None:
            return [self.column]
        try:
            parsed = list(string.Formatter().parse(self.template or ""))
        except ValueError as e:
            raise ValueError(f"promptTemplate {self.template!r} is not a valid str.format "
                             f"template: {e}") from None
        names: List[str] = []
        for _, field, _, _ in parsed:
            if field is None:
                continue
            name = field.split(".")[0].split("[")[0]
            if not name or name.isdigit():
                raise ValueError(f"promptTemplate {self.template!r} has a positional field "
                                 f"{{{field}}}; name a column instead, e.g. {{question}}")
            if name not in names:
                names.append(name)
        if not names:
            raise ValueError(f"promptTemplate {self.template!r} names no column; use "
                             f"{{column}} for a column's value")
        return names

    def check(self, types: Mapping[str, str]) -> None:
        """``ValueError`` naming a column the prompt reads that ``types`` (column -> Spark
        simple type) lacks, or a prompt column that is not a string."""
        for name in self.columns():
            if name not in types:
                where = "promptCol" if self.column is not None else \
                    f"promptTemplate {self.template!r}"
                raise ValueError(f"{where} reads column {name!r}, which the DataFrame does not "
                                 f"have; its columns: {sorted(types)}")
        if self.column is not None and types[self.column] != "string":
            raise ValueError(f"promptCol {self.column!r} must be a string column, found "
                             f"{types[self.column]}")

    def render(self, batch: Mapping[str, Sequence[Any]]) -> List[Tuple[Optional[str],
                                                                         Optional[str]]]:
        """Each row's ``(prompt, None)``, or ``(None, error)`` where a field is null."""
        names = self.columns()
        rows = len(batch[names[0]])
        out: List[Tuple[Optional[str], Optional[str]]] = []
        for i in range(rows):
            values = {name: batch[name][i] for name in names}
            nulls = [name for name, value in values.items() if value is None]
            if nulls:
                out.append((None, f"column {nulls[0]!r} is null in this row"))
            elif self.column is not None:
                out.append((str(values[self.column]), None))
            else:
                out.append(((self.template or "").format(**values), None))
        return out

    def uses_chat(self, tokenizer: Any) -> bool:
        """Whether prompts go through ``tokenizer``'s chat template; ``ValueError`` where
        ``chat=True`` and it has none."""
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat and not has:
            raise ValueError("chatTemplate is on but the tokenizer has no chat template; set "
                             "tokenizer.chat_template, or turn chatTemplate off")
        return has if self.chat is None else bool(self.chat)

    def encode(self, tokenizer: Any, prompts: Sequence[str]) -> List[List[int]]:
        """Token ids of each prompt: through the chat template (with the generation prompt)
        where :meth:`uses_chat`, else as the tokenizer encodes text."""
        if not self.uses_chat(tokenizer):
            return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
        encoded = []
        for prompt in prompts:
            messages: List[Dict[str, str]] = [{"role": "system", "content": self.system}] \
                if self.system else []
            messages.append({"role": "user", "content": prompt})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            encoded.append(list(ids))
        return encoded
