"""Generation in transform: a fine-tuned causal language model answers every row.

The model is a tiny Llama built from a config that learns to count ("count 3 from 7 :" ->
"8 9 10", then its end-of-sequence token), so answers have mixed lengths and can be checked
exactly; the tokenizer is a word list: nothing is downloaded."""
from __future__ import annotations

import copy
import json
import pathlib

import numpy as np
import pytest
import torch

from sparktrain import TextGenerator, TorchEstimator, register_generation_engine
from sparktrain.estimators.torch_model import TorchModel
from sparktrain.generation.engines import Completion, GenerationEngine, engine_class
from sparktrain.generation.prompts import PromptSpec
from sparktrain.generation.rows import Worker, WorkerPlan, answer_batches, load_worker
from sparktrain.generation.settings import GenerationSettings
from support import hf_models

pytest.importorskip("transformers")  # installed by the test set-up: never skipped there


@pytest.fixture(scope="module")
def tok():
    return hf_models.count_tokenizer()


@pytest.fixture(scope="module")
def counter():
    """The tiny Llama trained to count, in this process (a few seconds)."""
    return hf_models.train_counting()


_ENGINES = []  # built by _worker in the running test: closed after it


@pytest.fixture(autouse=True)
def _close_engines():
    """An engine left open keeps its generation thread and cache over the shared model; the
    next engine on that model must not meet them (executors hold one engine at a time)."""
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def _worker(model, tok, engine="continuous", window=8, limit=40, seed_col=None, **settings):
    options = GenerationSettings(**dict(dict(max_new_tokens=12), **settings))
    built = engine_class(engine)(model, options, [tok.eos_token_id], tok.pad_token_id, window,
                                 tokenizer=tok)
    _ENGINES.append(built)
    return Worker(built, tok, PromptSpec(column="prompt"), options, limit, seed_col)


def _answers(worker, prompts, batch=5):
    batches = [{"prompt": prompts[i:i + batch]} for i in range(0, len(prompts), batch)]
    outs = list(answer_batches(iter(batches), worker))
    assert [len(o["text"]) for o in outs] == [len(b["prompt"]) for b in batches]
    return {name: [v for o in outs for v in o[name]] for name in outs[0]}


# -- without Spark ------------------------------------------------------------------------------
def test_prompt_spec_reads_columns_and_names_what_is_wrong():
    spec = PromptSpec(template="count {k} from {start} : {k}")
    assert spec.columns() == ["k", "start"]
    assert spec.render({"k": [3, None], "start": [7, 1]}) == [
        ("count 3 from 7 : 3", None), (None, "column 'k' is null in this row")]
    spec.check({"k": "int", "start": "bigint", "id": "bigint"})
    with pytest.raises(ValueError, match=r"reads column 'start', which the DataFrame does not "
                                         r"have; its columns: \['id', 'k'\]"):
        spec.check({"k": "int", "id": "bigint"})
    with pytest.raises(ValueError, match="promptCol 'k' must be a string column, found int"):
        PromptSpec(column="k").check({"k": "int"})
    with pytest.raises(ValueError, match="set exactly one of promptCol"):
        PromptSpec(column="a", template="{a}")
    with pytest.raises(ValueError, match="positional field"):
        PromptSpec(template="count {} from {start}")
    with pytest.raises(ValueError, match="names no column"):
        PromptSpec(template="no fields")
    with pytest.raises(ValueError, match="not a valid str.format template"):
        PromptSpec(template="count {k")


def test_settings_are_checked_where_they_are_set():
    for bad, message in ((dict(max_new_tokens=0), "maxNewTokens must be a positive integer"),
                         (dict(temperature=-1), "temperature must be >= 0"),
                         (dict(top_p=0), r"topP must be in \(0, 1\]"),
                         (dict(stop=("",)), "stop must hold non-empty strings")):
        with pytest.raises(ValueError, match=message):
            GenerationSettings(**bad)
    settings = GenerationSettings(max_new_tokens=8, stop=(" 9", "!"))
    assert settings.cut_at_stop("7 8 9 10") == ("7 8", True)
    assert settings.prompt_limit(64) == 56
    with pytest.raises(ValueError, match="maxNewTokens=8 leaves no room"):
        settings.prompt_limit(8)
    assert GenerationSettings(max_new_tokens=8, max_prompt_tokens=10).prompt_limit(64) == 10


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_engines_answer_every_row_in_order_and_keep_row_errors(counter, tok, engine):
    rows = hf_models.count_rows(60, seed=11)
    worker = _worker(counter, tok, engine, limit=6)
    prompts = [p for p, _ in rows] + [None, "count 2 from 3 : 4 5 6 7"]  # null, too long
    out = _answers(worker, prompts)
    assert out["text"][:60] == [a for _, a in rows]          # learned, greedy, exact
    assert out["finish_reason"][:60] == ["stop"] * 60
    assert out["completion_tokens"][:60] == [len(a.split()) for _, a in rows]
    assert out["prompt_tokens"][:2] == [5, 5] and out["error"][:60] == [None] * 60
    assert out["text"][60:] == ["", ""] and out["finish_reason"][60:] == ["error", "error"]
    assert out["error"][60] == "column 'prompt' is null in this row"
    assert out["error"][61].startswith("the prompt has 9 tokens; at most 6 fit")
    short = _answers(_worker(counter, tok, engine, max_new_tokens=2, stop=(" 5",)),
                     ["count 6 from 1 :", "count 6 from 3 :"])
    assert short["text"] == ["2 3", "4"] and short["finish_reason"] == ["length", "stop"]
    # a stop string ends decoding, not only the text: 4 tokens ("4 5 6 7"), not 8
    stopped = _answers(_worker(counter, tok, engine, stop=(" 7",)),
                       ["count 8 from 3 :", "count 2 from 0 :", "count 3 from 5 :"], batch=3)
    assert stopped["text"] == ["4 5 6", "1 2", "6"], stopped
    assert stopped["completion_tokens"] == [4, 2, 2] and set(stopped["finish_reason"]) == {
        "stop"}


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_a_sampled_row_writes_the_same_text_whatever_rows_are_beside_it(engine):
    tok = hf_models.byte_tokenizer()
    model = hf_models.untrained_llama(len(tok))
    prompts = [f"row {i}" for i in range(12)]

    def sampled(order, window, batch, seed=0):
        worker = _worker(model, tok, engine, window=window, temperature=1.0, seed=seed)
        texts = _answers(worker, [prompts[i] for i in order], batch=batch)["text"]
        _ENGINES.pop().close()  # one engine on the model at a time, as in an executor
        return {i: text for i, text in zip(order, texts, strict=True)}

    first = sampled(list(range(12)), window=8, batch=5)
    assert len(set(first.values())) == 12                    # sampled: every row its own
    assert sampled(list(range(11, -1, -1)), window=3, batch=4) == first  # other neighbours
    other = sampled(list(range(12)), window=8, batch=5, seed=1)
    assert sum(other[i] != first[i] for i in range(12)) >= 10
    # seedCol: one prompt four times, each row drawn from its own value; a null is a row error
    worker = _worker(model, tok, engine, seed_col="s", temperature=1.0)
    out = next(answer_batches(iter([{"prompt": ["same"] * 4, "s": [1, 2, 1, None]}]), worker))
    assert out["text"][0] == out["text"][2] != out["text"][1]
    assert out["error"][3] == "column 's' is null in this row"


def test_continuous_batching_admits_the_next_batch_before_the_first_is_answered(counter, tok):
    pulled = []

    def batches():
        for i in range(4):
            pulled.append(("in", i))
            yield {"prompt": ["count 8 from 1 :", "count 1 from 1 :"]}

    worker = _worker(counter, tok, "continuous", window=6)
    for _ in answer_batches(batches(), worker):
        pulled.append(("out",))
    first_out = pulled.index(("out",))
    assert ("in", 2) in pulled[:first_out], pulled   # 6 rows in flight: 3 batches' worth


def test_a_lora_fine_tune_generates_merged(counter, tok):
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(copy.deepcopy(counter),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plan = WorkerPlan(TorchModel(model=adapted).module_source(),
                      __import__("cloudpickle").dumps(tok), PromptSpec(column="prompt"),
                      GenerationSettings(max_new_tokens=10))
    worker = load_worker(plan)
    assert not hasattr(worker.engine.model, "peft_config")     # merged into the base weights
    rows = hf_models.count_rows(10, seed=3)
    assert _answers(worker, [p for p, _ in rows])["text"] == [a for _, a in rows]
    worker.engine.close()


class _Echo(GenerationEngine):
    """A registered engine: answers each prompt with its own last token."""

    def generate(self, requests):
        for request in requests:
            yield Completion(request.key, [request.input_ids[-1]], ended=True)


def test_a_registered_engine_answers_rows(tok):
    register_generation_engine("echo-test", _Echo)
    worker = _worker(torch.nn.Linear(1, 1), tok, "echo-test")
    assert _answers(worker, ["count 2 from 9 :"])["text"] == [":"]
    with pytest.raises(TypeError, match="must subclass"):
        register_generation_engine("bad", int)
    with pytest.raises(ValueError, match=r"engine 'nope' is not a registered generation "
                                         r"engine; registered: \[.*'continuous'"):
        engine_class("nope")


def test_a_response_schema_is_read_both_ways_and_named_where_it_cannot_be_followed():
    from pyspark.sql import types as T

    from sparktrain.generation.json_constraint import compile_grammar
    from sparktrain.generation.response_schema import ResponseSchema, as_text

    inner = T.StructType([T.StructField("x", T.DoubleType())])
    spark_type = T.StructType([
        T.StructField("ok", T.BooleanType(), False), T.StructField("n", T.ByteType(), False),
        T.StructField("day", T.DateType(), False), T.StructField("inner", inner),
        T.StructField("tags", T.ArrayType(T.StringType()), False),
        T.StructField("scores", T.MapType(T.StringType(), T.LongType()), False)])
    shape = ResponseSchema.of(as_text(spark_type))          # the param holds the type's JSON
    schema = json.loads(shape.json_schema)
    assert schema["required"] == ["ok", "n", "day", "inner", "tags", "scores"]
    assert schema["additionalProperties"] is False
    props = schema["properties"]
    assert props["n"] == {"type": "integer", "minimum": -128, "maximum": 127}
    assert props["day"] == {"type": "string", "format": "date"}
    assert props["inner"]["anyOf"][1] == {"type": "null"}   # nullable: null allowed
    assert props["scores"]["additionalProperties"]["type"] == "integer"
    assert T.StructType.fromJson(json.loads(shape.spark_type)) == spark_type
    compile_grammar(shape.json_schema)

    from_json_schema = ResponseSchema.of({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "n": {"type": ["integer", "null"]},
        "xs": {"type": "array", "items": {"type": "number"}},
        "meta": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "maybe": {"anyOf": [{"type": "object", "properties": {"a": {"const": 1}}},
                            {"type": "null"}]}}})
    assert T.StructType.fromJson(json.loads(from_json_schema.spark_type)).simpleString() == (
        "struct<answer:string,n:bigint,xs:array<double>,meta:map<string,boolean>,"
        "either:string,maybe:struct<a:bigint>>")

    for wrong, message in [
            (T.StructType([T.StructField("blob", T.BinaryType())]),
             r"responseSchema.blob: binary has no JSON form"),
            (T.StructType([T.StructField("m", T.MapType(T.IntegerType(), T.StringType()))]),
             r"responseSchema.m: a map's keys must be strings"),
            (T.ArrayType(T.StringType()), r"must be a struct \(an answer is a JSON object\), "
                                          r"got array<string>"),
            ({"type": "string"}, r"JSON schema must describe an object"),
            ("answer string", r"DDL text needs a Spark session")]:
        with pytest.raises(ValueError, match=message):
            ResponseSchema.of(wrong)
    with pytest.raises(ValueError, match=r"responseSchema cannot be followed: .*strin"):
        compile_grammar(json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}))


ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "n", "tags"],
          "properties": {"answer": {"enum": ["yes", "no"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 6}}}}


@pytest.mark.parametrize("engine,temperature", [("static", 0.0), ("static", 1.0),
                                                ("continuous", 0.0), ("continuous", 1.0)])
def test_answers_follow_a_json_schema_even_from_an_untrained_model(engine, temperature):
    tok = hf_models.byte_tokenizer()
    model = hf_models.untrained_llama(len(tok))
    prompts = [f"row {i}: answer in JSON" for i in range(20)]
    free = _answers(_worker(model, tok, engine, max_new_tokens=40), prompts[:4])
    assert not any(text.startswith("{") for text in free["text"])      # noise without it
    _ENGINES.pop().close()  # one engine on the model at a time, as in an executor
    worker = _worker(model, tok, engine, max_new_tokens=80, temperature=temperature,
                     top_p=0.9, json_schema=json.dumps(ANSWER))
    out = _answers(worker, prompts)
    assert set(out["finish_reason"]) == {"stop"} and set(out["error"]) == {None}, out
    for text in out["text"]:
        value = json.loads(text)
        assert list(value) == ["answer", "n", "tags"] and value["answer"] in ("yes", "no")
        assert 0 <= value["n"] <= 99 and len(value["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 6 for t in value["tags"])


# -- in Spark -----------------------------------------------------------------------------------
def test_a_lora_fine_tune_then_generation_in_a_pipeline(spark, store, tok, counter, tmp_path):
    """LoRA adapters on the counting model, fine-tuned on 2 ranks to count by twos (the same
    prompts, a new answer), then generation over a DataFrame in a saved and reloaded pipeline:
    greedy and seeded sampled answers alike after the reload; row errors kept."""
    from peft import LoraConfig, get_peft_model
    from pyspark.ml import PipelineModel

    train = spark.createDataFrame(hf_models.count_rows(4000, seed=1, step=2),
                                  "prompt string, answer string")
    lora = get_peft_model(copy.deepcopy(counter), LoraConfig(
        task_type="CAUSAL_LM", r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]))
    fitted = TorchEstimator(
        num_proc=2, store=store, model=lora, loss=None,
        optimizer=torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2),
        transformation_fn=hf_models.CountTokenize(tok),
        feature_cols=["input_ids", "attention_mask"], label_cols=["labels"],
        batch_size=32, epochs=5, random_seed=1, verbose=0).fit(train)
    rows = [(i, int(p.split()[1]), int(p.split()[3]), a)
            for i, (p, a) in enumerate(hf_models.count_rows(40, seed=2, step=2))]
    df = spark.createDataFrame(rows + [(40, None, 1, ""), (41, 30, 1, "")],
                               "id long, k int, start int, expected string").repartition(3)
    generator = TextGenerator(model=fitted, tokenizer=tok, maxNewTokens=10, maxPromptTokens=8,
                              promptTemplate="count {k} from {start} :")
    with pytest.raises(ValueError, match=r"reads column 'begin', which the DataFrame does not"):
        generator.copy({generator.promptTemplate: "count {k} from {begin} :"}).transform(df)
    out = {r["id"]: r for r in generator.transform(df).select("id", "expected",
                                                              "generated.*").collect()}
    exact = np.mean([out[i]["text"] == out[i]["expected"] for i in range(40)])
    assert exact >= 0.9, [(out[i]["text"], out[i]["expected"]) for i in range(40)
                          if out[i]["text"] != out[i]["expected"]]   # by twos: the adapters'
    assert out[40]["error"] == "column 'k' is null in this row"
    assert out[41]["error"] is None                 # unlike anything trained on, still answered
    short = generator.copy({generator.maxPromptTokens: 4}).transform(df.limit(2))
    assert [r["error"] for r in short.select("generated.error").collect()] == [
        "the prompt has 5 tokens; at most 4 fit (the model's context less maxNewTokens, or "
        "maxPromptTokens)"] * 2
    # a prompt longer than the model's context (64 tokens, less maxNewTokens): an error row,
    # the rows beside it answered
    long_prompt = " ".join(["count 1 from 1 :"] * 12)                  # 60 tokens
    mixed = spark.createDataFrame([("count 2 from 5 :",), (long_prompt,)], "prompt string")
    by_column = generator.copy({generator.maxPromptTokens: 0})
    by_column.clear(by_column.promptTemplate)
    answered = by_column.setParams(promptCol="prompt").transform(mixed) \
        .select("generated.text", "generated.error").collect()
    assert answered[0]["text"] == "7 9" and answered[0]["error"] is None
    assert answered[1]["error"].startswith("the prompt has 60 tokens; at most 54 fit")
    # sampled, each row from its own seed: the same texts over other partitions and batches
    sampling = generator.copy({generator.temperature: 1.5, generator.seedCol: "id",
                               generator.outputCol: "sampled"})
    spread = dict(sampling.transform(df).select("id", "sampled.text").collect())
    together = sampling.copy({sampling.maxRowsInFlight: 5}).transform(df.coalesce(1))
    assert spread == dict(together.select("id", "sampled.text").collect())
    with pytest.raises(ValueError, match="seedCol 'expected' must be an integer column; it is "
                                         "string"):
        sampling.copy({sampling.seedCol: "expected"}).transform(df)
    # the other engine draws each row from the same seed alike (up to numerical near-ties)
    static = dict(sampling.copy({sampling.engine: "static"}).transform(df)
                  .select("id", "sampled.text").collect())
    assert sum(static[i] == spread[i] for i in spread) >= 0.9 * len(spread), (static, spread)
    # the pipeline saved and loaded: the same greedy and the same seeded sampled answers
    PipelineModel([generator, sampling]).write().overwrite().save(str(tmp_path / "gen"))
    loaded = PipelineModel.load(str(tmp_path / "gen"))
    assert isinstance(loaded.stages[0], TextGenerator)
    assert loaded.stages[1].getOrDefault("seedCol") == "id"
    again = loaded.transform(df).select("id", "generated.text", "sampled.text").collect()
    assert {r[0]: r[1] for r in again} == {i: r["text"] for i, r in out.items()}
    assert {r[0]: r[2] for r in again} == spread


#: while this file exists, _Flaky fails (a fixed path: executors see this module's constants)
FLAKY_MARKER = "/tmp/sparktrain-test-generation-flaky"


class _Flaky(GenerationEngine):
    """A registered engine (its class travels to the executors): echoes each prompt's last
    token, and fails on the word "39" while :data:`FLAKY_MARKER` exists."""

    def generate(self, requests):
        import os

        for request in requests:
            if os.path.exists(FLAKY_MARKER) and 46 in request.input_ids:  # "39"
                raise RuntimeError("boom: the engine failed mid-job")
            yield Completion(request.key, [request.input_ids[-1]], ended=True)


def test_a_long_job_answers_every_row_once_across_a_failure(spark, tok, tmp_path):
    from pyspark.sql import functions as F

    assert tok.convert_tokens_to_ids("39") == 46
    marker = pathlib.Path(FLAKY_MARKER)
    marker.write_text("")
    register_generation_engine("flaky-test", _Flaky)
    # the failing row in the last of 4 slices: the three before it are written first
    boom = spark.range(1000).where(F.pmod(F.hash("id"), F.lit(4)) == 3).first()["id"]
    rows = [(i, f"count 1 from {39 if i == boom else i % 30} :") for i in range(300)]
    df = spark.createDataFrame(rows, "id long, prompt string")
    generator = TextGenerator(model=hf_models.tiny_llama(), tokenizer=tok, promptCol="prompt",
                              engine="flaky-test", maxNewTokens=4)
    with pytest.raises(ValueError, match="maxNewTokens=128 leaves no room for a prompt in the "
                                         "model's context of 64 tokens"):
        generator.copy({generator.maxNewTokens: 128}).transform(df)
    out = str(tmp_path / "answers")
    try:
        with pytest.raises(Exception, match="boom: the engine failed mid-job"):
            generator.answer_into(df, out, "id", slices=4)
    finally:
        marker.unlink()
    before = spark.read.parquet(out).count()
    assert 0 < before < 300                       # three slices kept, the failed one left none
    assert generator.answer_into(df, out, "id", slices=4) == 4
    answered = spark.read.parquet(out).collect()
    assert sorted(r["id"] for r in answered) == list(range(300))     # each exactly once
    assert {r["text"] for r in answered} == {":"} and {r["finish_reason"] for r in answered} == {
        "stop"}
    with pytest.raises(ValueError, match="id_col 'key' is not a column"):
        generator.answer_into(df, out, "key")


def test_a_response_schema_types_the_answers_column(spark, tmp_path):
    """An untrained model over a DataFrame: every answer parses into the StructType, typed, in
    both engines; a schema with no JSON form is refused before any job."""
    from pyspark.ml import PipelineModel
    from pyspark.sql import types as T

    tok = hf_models.byte_tokenizer()
    shape = T.StructType([
        T.StructField("ok", T.BooleanType(), False), T.StructField("n", T.ByteType(), False),
        T.StructField("day", T.DateType(), False),
        T.StructField("inner", T.StructType([T.StructField("flag", T.BooleanType())])),
        T.StructField("m", T.ShortType(), False)])
    generator = TextGenerator(model=hf_models.untrained_llama(len(tok)), tokenizer=tok,
                              promptCol="prompt", maxNewTokens=120, responseSchema=shape)
    df = spark.createDataFrame([(i, f"row {i}") for i in range(24)],
                               "id long, prompt string").repartition(3)
    before = len(spark.sparkContext.statusTracker().getJobIdsForGroup(None)) \
        if hasattr(spark, "sparkContext") else None
    with pytest.raises(ValueError, match=r"responseSchema.blob: binary has no JSON form"):
        generator.copy({generator.responseSchema: "blob binary"}).transform(df)
    if before is not None:
        assert len(spark.sparkContext.statusTracker().getJobIdsForGroup(None)) == before
    answers = generator.transform(df)
    # from_json makes every field nullable (Spark's JsonToStructs): the same types
    assert answers.schema["generated"].dataType["parsed"].dataType.simpleString() == \
        shape.simpleString()
    rows = answers.select("id", "generated.*").collect()
    assert {r["finish_reason"] for r in rows} == {"stop"} and len(rows) == 24
    for row in rows:
        assert row["parsed"] is not None and json.loads(row["text"])["n"] == row["parsed"]["n"]
        assert -128 <= row["parsed"]["n"] <= 127 and row["parsed"]["day"].year >= 1
    PipelineModel([generator]).write().overwrite().save(str(tmp_path / "gen"))
    loaded = PipelineModel.load(str(tmp_path / "gen")).stages[0]
    again = loaded.transform(df).select("id", "generated.parsed").collect()
    assert {r["id"]: r["parsed"] for r in again} == {r["id"]: r["parsed"] for r in rows}
    static = generator.copy({generator.engine: "static"}).transform(df)
    assert static.where("generated.parsed IS NOT NULL").count() == 24
    ddl = generator.copy({generator.responseSchema: "ok boolean not null, n smallint not null"})
    parsed = ddl.transform(df.limit(4)).select("generated.parsed.*")
    assert parsed.dtypes == [("ok", "boolean"), ("n", "smallint")] and parsed.count() == 4
