"""``TextGenerator``: a fitted causal language model writes an answer for every row of a
DataFrame, as a Spark ML transformer (saved and loaded with a pipeline, usable over Spark
Connect).

Example::

    generator = TextGenerator(model=fitted, tokenizer=tokenizer,
                              promptTemplate="Q: {question}\\nA:", maxNewTokens=64)
    answers = generator.transform(df)   # adds "generated": text, finish_reason, token counts
    answers.select("id", "generated.text", "generated.error")
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import cloudpickle
from pyspark.ml import Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparktrain.estimators.persistence import (
    SessionWriter,
    ml_context,
    read_file,
    saved_root,
    write_file,
    write_model_files,
)
from sparktrain.generation.engines import check_engine, engine_class, shipped_engine
from sparktrain.generation.prompts import PromptSpec
from sparktrain.generation.response_schema import ResponseSchema, as_text
from sparktrain.generation.resume import answer_into
from sparktrain.generation.rows import WorkerPlan, context_length, generation_udf
from sparktrain.generation.settings import GenerationSettings
from sparktrain.model_files import ModelFile
from sparktrain.pickling import dumps

_CHAT = {"auto": None, "on": True, "off": False}
_INTEGERS = ("tinyint", "smallint", "int", "bigint")


def _param(name: str, doc: str, converter: Any) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


class TextGenerator(Model, MLWritable, MLReadable):
    """Generate text with a fine-tuned causal language model (a ``TorchModel`` from
    ``TorchEstimator.fit``, or a transformers model as it is) over a DataFrame.

    Each row's prompt is ``promptCol``'s text or ``promptTemplate`` over columns (``{name}``),
    wrapped in the tokenizer's chat template where it has one (``chatTemplate``: auto, on,
    off). ``transform`` adds ``outputCol``, a struct: ``text``, ``finish_reason`` (``stop``:
    an end-of-sequence token or a ``stop`` string; ``length``: ``maxNewTokens`` reached;
    ``error``), ``prompt_tokens``, ``completion_tokens`` and ``error`` (null where the row was
    answered). A row that cannot be answered (a prompt longer than the model's context, a null
    field, a row the engine rejects) gets its error and an empty text; the task's other rows
    are kept. Wrong settings (an unknown column, a bad template) fail before any job.

    ``responseSchema`` (a ``StructType``, DDL text, or a JSON schema) constrains decoding so
    that every answer is JSON valid for it, parsed into the struct's ``parsed`` field, typed
    (null where the answer did not end: ``finish_reason="length"``).

    Each Python worker loads the model once (a LoRA fine-tune merged into its base weights)
    and keeps its engine across tasks; ``engine``: ``"continuous"`` (transformers' continuous
    batching, ``maxRowsInFlight`` rows at once across a task's batches) or ``"static"``
    (padded batches of ``maxRowsInFlight`` rows through ``generate``), or one registered with
    ``register_generation_engine``. ``temperature=0`` (the default) decodes greedily: a rerun
    writes the same text. With sampling, each row is drawn from its own seed (``seedCol``'s
    value where set, else its prompt's tokens, with ``seed``): a row's text is the same on
    every rerun, whatever rows are decoded beside it.
    """

    promptCol = _param("promptCol", "the column holding each row's prompt",
                       TypeConverters.toString)
    promptTemplate = _param("promptTemplate", "a str.format template over columns, e.g. "
                            "'Q: {question}\\nA:'", TypeConverters.toString)
    outputCol = _param("outputCol", "the struct column the answers go to",
                       TypeConverters.toString)
    maxNewTokens = _param("maxNewTokens", "the most tokens an answer has", TypeConverters.toInt)
    temperature = _param("temperature", "0: greedy; above 0: sampling at this temperature",
                         TypeConverters.toFloat)
    topP = _param("topP", "nucleus sampling's probability mass", TypeConverters.toFloat)
    stop = _param("stop", "strings that end an answer", TypeConverters.toListString)
    seed = _param("seed", "the sampling seed", TypeConverters.toInt)
    seedCol = _param("seedCol", "an integer column: each row samples from its own seed (its "
                     "value with seed), whatever rows are decoded beside it",
                     TypeConverters.toString)
    maxPromptTokens = _param("maxPromptTokens", "longer prompts are row errors (0: the "
                             "model's context less maxNewTokens)", TypeConverters.toInt)
    chatTemplate = _param("chatTemplate", "auto, on or off: the tokenizer's chat template",
                          TypeConverters.toString)
    systemPrompt = _param("systemPrompt", "a system message before each prompt (chat)",
                          TypeConverters.toString)
    engine = _param("engine", "the generation engine's registered name",
                    TypeConverters.toString)
    maxRowsInFlight = _param("maxRowsInFlight", "rows a Python worker generates at once",
                             TypeConverters.toInt)
    useGpu = _param("useGpu", "generate on the task's GPU where Spark gives one (None: "
                    "where it does)", TypeConverters.toBoolean)
    responseSchema = _param("responseSchema", "the shape of every answer: a StructType, DDL "
                            "text or a JSON schema; answers are decoded to follow it",
                            as_text)

    def __init__(self, model: Any = None, tokenizer: Any = None, **params: Any) -> None:
        super().__init__()
        self._setDefault(outputCol="generated", maxNewTokens=128, temperature=0.0, topP=1.0,
                         stop=[], seed=0, maxPromptTokens=0, chatTemplate="auto",
                         engine="continuous", maxRowsInFlight=32)
        self._torch: Any = None
        self._tokenizer = tokenizer
        if model is not None:
            self.setModel(model)
        self._set(**params)

    # -- the model and the settings -------------------------------------------------------------
    def setModel(self, model: Any) -> "TextGenerator":
        """A ``TorchModel`` (fitted or loaded) or a transformers module."""
        from sparktrain.estimators.torch_model import TorchModel

        self._torch = model if isinstance(model, TorchModel) else TorchModel(model=model)
        return self

    def getModel(self) -> Any:
        """The transformers module (read from its weights file on first use)."""
        return None if self._torch is None else self._torch.getModel()

    def setTokenizer(self, tokenizer: Any) -> "TextGenerator":
        self._tokenizer = tokenizer
        return self

    def getTokenizer(self) -> Any:
        return self._tokenizer

    def setParams(self, **params: Any) -> "TextGenerator":
        return self._set(**params)

    def _prompt(self) -> PromptSpec:
        chat = self.getOrDefault("chatTemplate")
        if chat not in _CHAT:
            raise ValueError(f"chatTemplate must be one of {sorted(_CHAT)}, got {chat!r}")
        get = self._optional
        return PromptSpec(column=get("promptCol"), template=get("promptTemplate"),
                          chat=_CHAT[chat], system=get("systemPrompt"))

    def _optional(self, name: str) -> Any:
        return self.getOrDefault(name) if self.isDefined(name) else None

    def _settings(self) -> GenerationSettings:
        get = self.getOrDefault
        return GenerationSettings(max_new_tokens=get("maxNewTokens"),
                                  temperature=get("temperature"), top_p=get("topP"),
                                  stop=tuple(get("stop")), seed=get("seed"),
                                  max_prompt_tokens=get("maxPromptTokens"))

    def _shape(self, spark: Any = None) -> Optional[ResponseSchema]:
        """``responseSchema`` read (a DDL string with ``spark``'s parser), or None."""
        text = self._optional("responseSchema")
        if text is None:
            return None
        ddl = None if spark is None else (lambda t: spark.createDataFrame([], t).schema)
        return ResponseSchema.of(text, ddl)

    def _engine(self, shape: Optional[ResponseSchema]) -> str:
        """The engine's name: ``engine``; where it is not set and the default cannot do what
        ``responseSchema`` or ``seedCol`` asks (a default registered in its place), the static
        engine, which does both."""
        engine = self.getOrDefault("engine")
        check_engine(engine)
        needs = [(ability, param) for ability, param, asked in [
            ("follows_schema", "make answers follow responseSchema", shape is not None),
            ("seeds_rows", "seed each row by seedCol", self.isDefined("seedCol"))] if asked]
        missing = [param for ability, param in needs
                   if not getattr(engine_class(engine), ability, False)]
        if missing and self.isSet("engine"):
            raise ValueError(f"engine {engine!r} cannot {' or '.join(missing)} (see "
                             f"docs/generation.md); use engine='static' or leave engine unset")
        return "static" if missing else engine

    def plan(self, spark: Any = None) -> WorkerPlan:
        """What the executors get; every setting checked (``ValueError`` naming it)."""
        return self._plan(spark, self._shape(spark))

    def _plan(self, spark: Any, shape: Optional[ResponseSchema]) -> WorkerPlan:
        prompt, settings = self._prompt(), self._settings()
        engine = self._engine(shape)
        if shape is not None:
            from sparktrain.generation.json_constraint import compile_grammar

            compile_grammar(shape.json_schema)  # a schema it cannot follow: named before any job
            settings = dataclasses.replace(settings, json_schema=shape.json_schema)
        window = self.getOrDefault("maxRowsInFlight")
        if window < 1:
            raise ValueError(f"maxRowsInFlight must be >= 1, got {window}")
        if self._torch is None:
            raise ValueError("TextGenerator has no model; pass model= (a TorchModel or a "
                             "transformers causal language model)")
        if self._tokenizer is None:
            raise ValueError("TextGenerator has no tokenizer; pass tokenizer= (the one the "
                             "model was fine-tuned with)")
        prompt.uses_chat(self._tokenizer)
        if self._torch._model is not None and hasattr(self._torch._model, "config"):
            settings.prompt_limit(context_length(self._torch._model.config))  # before any job
        if spark is not None:
            self._torch._keep_in_file(spark)
        # sparktrain's pickling: a tokenizer class from the user's own module travels by value
        return WorkerPlan(self._torch.module_source(), dumps(self._tokenizer), prompt,
                          settings, shipped_engine(engine), window, self._optional("useGpu"),
                          seed_col=self._optional("seedCol"))

    def _transform(self, dataset: DataFrame) -> DataFrame:
        output = self.getOrDefault("outputCol")
        if output in dataset.columns:
            raise ValueError(f"outputCol {output!r} is already a column of the DataFrame; "
                             f"choose another with setParams(outputCol=...)")
        types = dict(dataset.dtypes)
        self._prompt().check(types)
        seed_col = self._optional("seedCol")
        if seed_col is not None and types.get(seed_col) not in _INTEGERS:
            found = f"it is {types[seed_col]}" if seed_col in types else \
                f"the DataFrame has no such column; its columns: {list(types)}"
            raise ValueError(f"seedCol {seed_col!r} must be an integer column; {found}")
        shape = self._shape(dataset.sparkSession)
        plan = dataclasses.replace(self._plan(dataset.sparkSession, shape), integers=tuple(
            name for name, kind in types.items() if kind in _INTEGERS))
        # a Python worker keeps an engine per key: any change of model or setting makes another
        key = hashlib.sha1(cloudpickle.dumps(plan)).hexdigest()
        udf = generation_udf(key, plan)
        answers = dataset.withColumn(output, udf(*[F.col(f"`{c}`") for c in plan.columns()]))
        if shape is None:
            return answers
        from pyspark.sql.types import StructType

        out = F.col(f"`{output}`")
        parsed = F.when(out["finish_reason"] == "stop", F.from_json(
            out["text"], StructType.fromJson(json.loads(shape.spark_type))))
        return answers.withColumn(output, out.withField("parsed", parsed))

    def answer_into(self, dataset: DataFrame, path: str, id_col: str, slices: int = 8) -> int:
        """Answer ``dataset`` into Parquet at ``path``, a slice of the ids per job, skipping
        ids already there: after a failure, the same call answers only what is missing
        (:func:`sparktrain.generation.resume.answer_into`)."""
        return answer_into(self, dataset, path, id_col, slices)

    # -- persistence ----------------------------------------------------------------------------
    def write(self) -> "_GeneratorWriter":
        return _GeneratorWriter(self)

    @classmethod
    def read(cls) -> "_GeneratorReader":
        return _GeneratorReader()


class _GeneratorWriter(SessionWriter):
    """Params in ``metadata``; the model's files under ``model/`` (weights streamed from the
    store), the tokenizer's ``save_pretrained`` files under ``tokenizer/``."""

    def saveImpl(self, path: str) -> None:
        generator = self.instance
        params = {p.name: generator.getOrDefault(p) for p in generator.params
                  if generator.isSet(p)}
        files = generator._torch._framework_files()
        with tempfile.TemporaryDirectory() as tmp:
            generator.getTokenizer().save_pretrained(tmp)
            tokenizer = {file.name: file.read_bytes() for file in sorted(Path(tmp).iterdir())}
        root = self._save_metadata(path, params, extraMetadata={
            "framework_files": sorted(files), "tokenizer_files": sorted(tokenizer)})
        write_model_files(root, files)
        for name, data in tokenizer.items():
            write_file(root, f"tokenizer/{name}", data)


class _GeneratorReader(MLReader):
    """Reads what :class:`_GeneratorWriter` wrote. The model's architecture is a pickle, which
    runs code: load only paths you trust."""

    def load(self, path: str) -> TextGenerator:
        from transformers import AutoTokenizer

        from sparktrain.estimators.torch_model import TorchModel

        metadata = DefaultParamsReader.loadMetadata(path, ml_context(self))
        root = saved_root(self.sparkSession, path)
        files = {name: ModelFile.of(f"{root}/model/{name}")
                 for name in metadata["framework_files"]}
        with tempfile.TemporaryDirectory() as tmp:
            for name in metadata["tokenizer_files"]:
                Path(tmp, name).write_bytes(read_file(root, f"tokenizer/{name}"))
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        generator = TextGenerator(model=TorchModel._from_framework_files(files),
                                  tokenizer=tokenizer)
        generator._resetUid(metadata["uid"])
        known = {p.name for p in generator.params}
        values: Dict[str, Any] = {k: v for k, v in metadata["paramMap"].items() if k in known}
        generator._set(**values)
        return generator
