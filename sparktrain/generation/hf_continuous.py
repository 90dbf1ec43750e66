"""The continuous engine: transformers' continuous batching
(``transformers.generation.continuous_batching``; tested with transformers 5.24, and a
transformers without its ``ContinuousBatchingConfig`` is refused by name). Rows join the running
batch as others finish; the KV cache is paged, so a short answer frees its pages at once. The
manager and its generation thread are built once per Python worker and kept across tasks. A
``responseSchema`` is a processor inside the manager (:mod:`.cb_grammar`); stop strings cancel
a row as soon as its streamed text holds one.

Example::

    engine = ContinuousEngine(model, GenerationSettings(max_new_tokens=16), [2], 0, window=32)
    for done in engine.generate(requests): ...
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Dict, Iterable, Iterator, Set

from sparktrain.generation.engines import Completion, GenerationEngine, Request

#: tokens per page of the paged KV cache on a CPU (transformers' default, 256, sizes for GPUs)
CPU_PAGE = 32
#: the most tokens one forward step takes on a CPU (prefill chunks included)
CPU_BATCH_TOKENS = 2048


class ContinuousEngine(GenerationEngine):
    """Up to ``window`` rows in transformers' continuous batching manager at once."""

    follows_schema = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._manager: Any = None
        self._schema: Any = None  # cb_grammar.GrammarProcessor, with a responseSchema

    def _grammar(self) -> Any:
        """A context in which the manager is made with the schema's processor (if any)."""
        if not self.settings.json_schema:
            return contextlib.nullcontext()
        from sparktrain.generation import cb_grammar
        from sparktrain.generation import json_constraint as jc

        tokenizer = jc.json_tokenizer(self.tokenizer, self.model.config.vocab_size,
                                      self.eos_ids)
        top_p = self.settings.top_p if self.settings.sampling else 1.0
        self._schema = cb_grammar.GrammarProcessor(
            tokenizer, jc.compile_grammar(self.settings.json_schema), top_p)
        return cb_grammar.with_grammar(self.model, self._schema)

    def _start(self, context: int) -> Any:
        import transformers
        from transformers import GenerationConfig

        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            raise RuntimeError(
                f"engine='continuous' needs transformers' continuous batching with its "
                f"ContinuousBatchingConfig (transformers 5); this executor has transformers "
                f"{transformers.__version__}: upgrade it, or use engine='static'") from None

        settings = self.settings
        config = GenerationConfig(max_new_tokens=settings.max_new_tokens,
                                  do_sample=settings.sampling, eos_token_id=self.eos_ids,
                                  pad_token_id=self.pad_id)
        if settings.sampling:
            # with a schema, the nucleus is taken after its mask (cb_grammar)
            config.temperature, config.top_p, config.top_k = settings.temperature, \
                1.0 if settings.json_schema else settings.top_p, 0
        cache: Dict[str, Any] = dict(seed=settings.seed, max_requests_per_batch=self.window)
        if settings.json_schema:  # a Python processor that needs each row's last token
            cache.update(use_cuda_graph=False, use_async_batching=False)
        if next(self.model.parameters()).device.type == "cpu":
            # sized by the rows in flight: the default sizes by a share of the device's memory,
            # which on a CPU allocates gigabytes and takes seconds
            # which on a CPU allocates gigabytes and takes seconds. Twice what the rows in
            # flight can hold at their longest: a cache the scheduler fills stalls or evicts
            longest = min(context, settings.prompt_limit(context) + settings.max_new_tokens)
            cache.update(page_size=CPU_PAGE, max_batch_tokens=CPU_BATCH_TOKENS,
                         num_blocks=2 * self.window * math.ceil(longest / CPU_PAGE) + 1)
        with self._grammar():
            manager = self.model.init_continuous_batching(
                generation_config=config,
                continuous_batching_config=ContinuousBatchingConfig(**cache))
        if self._schema is not None:  # its (empty) row of the processors' argument tensor
            manager.logit_processor.tensors_required += 1
        # started from a daemon thread, so its generation thread is a daemon too (a thread
        # inherits it): a Python worker that exits does not wait for an idle engine
        starter = threading.Thread(target=_start_in_inference_mode, args=(manager,),
                                   daemon=True)
        starter.start()
        starter.join()
        return manager

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        if self._manager is None:
            context = getattr(self.model.config, "max_position_embeddings", 2048)
            self._manager = self._start(context)
        manager = self._manager
        pending = iter(requests)
        in_flight: Set[int] = set()
        # with stop strings, rows stream their tokens: a row whose text has one is cancelled
        # at once, not decoded on to its end-of-sequence token or maxNewTokens
        streaming = bool(self.settings.stop)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < self.window:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                    break
                manager.add_request(request.input_ids, request_id=str(request.key),
                                    max_new_tokens=self.settings.max_new_tokens,
                                    streaming=streaming)
                in_flight.add(request.key)
            if not in_flight:
                return
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped with rows "
                                       "still in flight (its generation thread ended); see "
                                       "the executor's log for its error")
                continue
            key = int(result.request_id)
            if key not in in_flight:  # a row cancelled at its stop string: already answered
                continue
            if not result.is_finished():
                if not (streaming and self.has_stop(result.generated_tokens)):
                    continue
                manager.cancel_request(result.request_id)
            in_flight.discard(key)
            left = self._schema.errors.pop(result.request_id, None) if self._schema else None
            if self._schema is not None:
                self._schema.forget(result.request_id)
            if result.error is not None or left is not None:
                yield Completion(key, error=str(left or result.error))
            else:
                yield self.finish(key, result.generated_tokens)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.stop(block=True, timeout=10)
            self._manager = None


def _start_in_inference_mode(manager: Any) -> None:
    """The manager's loop runs in inference mode when its starter does (no autograd graph)."""
    import torch

    with torch.inference_mode():
        manager.start()
