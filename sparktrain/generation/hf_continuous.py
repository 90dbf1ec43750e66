"""The continuous engine: transformers' continuous batching
(``transformers.generation.continuous_batching``; tested with transformers 5.24, and a
transformers without its ``ContinuousBatchingConfig`` is refused by name). Rows join the running
batch as others finish; the KV cache is paged, so a short answer frees its pages at once. The
manager and its generation thread are built once per Python worker and kept across tasks. A
``responseSchema`` and sampling from each row's seed are processors inside the manager
(:mod:`.cb_processors`); stop strings cancel
a row as soon as its streamed text holds one.

Example::

    engine = ContinuousEngine(model, GenerationSettings(max_new_tokens=16), [2], 0, window=32)
    for done in engine.generate(requests): ...
"""
from __future__ import annotations

import math
import threading
from typing import Any, Dict, Iterable, Iterator, List, Set

from sparktrain.generation.engines import Completion, GenerationEngine, Request

#: tokens per page of the paged KV cache on a CPU (transformers' default, 256, sizes for GPUs)
CPU_PAGE = 32
#: the most tokens one forward step takes on a CPU (prefill chunks included)
CPU_BATCH_TOKENS = 2048


class ContinuousEngine(GenerationEngine):
    """Up to ``window`` rows in transformers' continuous batching manager at once."""

    follows_schema = True
    seeds_rows = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._manager: Any = None
        self._schema: Any = None  # cb_processors.GrammarProcessor, with a responseSchema
        self._sampler: Any = None  # cb_processors.SeededSampler, with sampling

    def _processors(self) -> List[Any]:
        """sparktrain's processors for the manager (:mod:`.cb_processors`): the schema's,
        then the sampler (the manager itself then decodes greedily)."""
        settings = self.settings
        if not settings.json_schema and not settings.sampling:
            return []
        from sparktrain.generation import cb_processors
        from sparktrain.generation import json_constraint as jc

        if settings.json_schema:
            self._schema = cb_processors.GrammarProcessor(*jc.compiled(
                self.tokenizer, self.model.config.vocab_size, self.eos_ids,
                settings.json_schema))
        if settings.sampling:
            self._sampler = cb_processors.SeededSampler(settings.temperature, settings.top_p,
                                                        settings.seed)
        return [p for p in (self._schema, self._sampler) if p is not None]

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
        # greedy over the processed scores: with sampling, SeededSampler has already chosen
        config = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        processors = self._processors()
        cache: Dict[str, Any] = dict(max_requests_per_batch=self.window)
        if processors:  # Python processors that need each row's last token
            cache.update(use_cuda_graph=False, use_async_batching=False)
        if next(self.model.parameters()).device.type == "cpu":
            # sized by the rows in flight: the default sizes by a share of the device's memory,
            # which on a CPU allocates gigabytes and takes seconds. Twice what the rows in
            # flight can hold at their longest: a cache the scheduler fills stalls or evicts
            longest = min(context, settings.prompt_limit(context) + settings.max_new_tokens)
            cache.update(page_size=CPU_PAGE, max_batch_tokens=CPU_BATCH_TOKENS,
                         num_blocks=2 * self.window * math.ceil(longest / CPU_PAGE) + 1)
        if processors:
            from sparktrain.generation.cb_processors import with_processors

            with with_processors(self.model, processors):
                manager = self.model.init_continuous_batching(
                    generation_config=config,
                    continuous_batching_config=ContinuousBatchingConfig(**cache))
            # a row each of the processors' argument tensor (theirs are empty)
            manager.logit_processor.tensors_required += len(processors)
        else:
            manager = self.model.init_continuous_batching(
                generation_config=config,
                continuous_batching_config=ContinuousBatchingConfig(**cache))
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
                if self._sampler is not None and request.seed is not None:
                    self._sampler.seeds[str(request.key)] = request.seed
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
            for processor in (self._schema, self._sampler):
                if processor is not None:
                    processor.forget(result.request_id)
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
