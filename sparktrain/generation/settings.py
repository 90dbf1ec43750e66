"""What to generate for each row: the decoding settings, checked where they are set.

Example::

    GenerationSettings(max_new_tokens=64, temperature=0.0, stop=("\\n\\n",))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings shared by every row of a ``transform``.

    ``temperature=0`` decodes greedily (the same text on every rerun); above 0 it samples,
    from the ``top_p`` nucleus, seeded by ``seed``. ``stop``: strings that end an answer
    (the answer is cut before the first one). ``max_prompt_tokens``: a longer prompt is a row
    error, not a job failure (0: the model's context less ``max_new_tokens``).
    ``json_schema``: where set, the JSON schema every answer follows
    (:mod:`~sparktrain.generation.response_schema`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: Tuple[str, ...] = ()
    seed: int = 0
    max_prompt_tokens: int = 0
    json_schema: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"maxNewTokens must be a positive integer, got "
                             f"{self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"topP must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 0:
            raise ValueError(f"maxPromptTokens must be an integer >= 0 (0: what the model's "
                             f"context leaves), got {self.max_prompt_tokens!r}")

    @property
    def sampling(self) -> bool:
        """Whether tokens are sampled (``temperature > 0``) rather than chosen greedily."""
        return self.temperature > 0

    def prompt_limit(self, context: int) -> int:
        """The most prompt tokens a row may have for a model whose context is ``context``;
        ``ValueError`` where ``max_new_tokens`` leaves no room for a prompt."""
        room = context - self.max_new_tokens
        if room < 1:
            raise ValueError(f"maxNewTokens={self.max_new_tokens} leaves no room for a prompt "
                             f"in the model's context of {context} tokens; set maxNewTokens "
                             f"below {context}")
        return min(self.max_prompt_tokens, room) if self.max_prompt_tokens else room

    def cut_at_stop(self, text: str) -> Tuple[str, bool]:
        """``(text before the first stop string, whether one was found)``.

        >>> GenerationSettings(stop=("\\n",)).cut_at_stop("yes\\nno")
        ('yes', True)
        """
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)
