"""Hugging Face models as they are: columns a transformation creates (a tokenizer's), keyword
forward, the model's own loss, ModelOutput results, LoRA (peft), learning-rate schedules.

Models are built from configs and the tokenizer is trained in memory: nothing is downloaded.

Full tier: every test that fits
(test_bert_as_it_is_fits_with_its_own_loss_and_predicts_on_raw_text,
test_explicit_loss_on_the_logits_with_horovod_bf16_and_accumulation,
test_lora_adapters_train_and_frozen_weights_stay,
test_a_per_step_schedule_resumes_from_the_checkpoint). Only they train a Hugging Face model in
ranks: its own loss and ModelOutput in the loop, a saved model that tokenizes raw text again to
predict, Horovod with bf16 and accumulation on the logits, LoRA under FSDP with the frozen body
left out of the checkpoint, and a per-step lr_scheduler's state resumed (no quick test sets
one). The quick tier checks learn_inputs and ForwardRule without Spark, and the errors raised
before training."""
from __future__ import annotations

import glob
import io
import os

import numpy as np
import pytest
import torch

from sparktrain import TorchEstimator
from sparktrain.data.transform_inputs import learn_inputs
from sparktrain.errors import PreflightError
from sparktrain.estimators.torch import TorchModel
from sparktrain.loop.torch_forward import ForwardRule
from support import hf_models

pytest.importorskip("transformers")  # installed by the test set-up: never skipped there


@pytest.fixture(scope="module")
def tok():
    return hf_models.tokenizer()


@pytest.fixture(scope="module")
def text_df(spark):
    return spark.createDataFrame(hf_models.sentences(1200, seed=1), "text string, label long")


@pytest.fixture(scope="module")
def test_text(spark):
    return spark.createDataFrame(hf_models.sentences(300, seed=2), "text string, label long")


def bert_estimator(tok, store, **overrides):
    model = hf_models.tiny_bert(tok.vocab_size)
    params = dict(num_proc=2, store=store, model=model,
                  optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), loss=None,
                  transformation_fn=hf_models.Tokenize(tok),
                  feature_cols=["input_ids", "attention_mask"], label_cols=["label"],
                  batch_size=32, epochs=2, random_seed=3, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


# -- without Spark ------------------------------------------------------------------------------
def test_learned_inputs_are_the_columns_the_transformation_needs():
    def tokenize(batch):
        out = dict(batch)  # looks at every column, needs only "text" (and keeps "label")
        out["input_ids"] = np.array([[len(t)] for t in batch["text"]])
        return out

    sample = {"id": np.arange(2), "text": np.array(["a", "bb"], dtype=object),
              "label": np.array([0, 1]), "extra": np.zeros(2)}
    inputs, produced = learn_inputs(tokenize, sample, ["input_ids", "label"], keep=["label"])
    assert inputs == ["text", "label"]
    assert produced == ["id", "text", "label", "extra", "input_ids"]
    with pytest.raises(ValueError, match=r"\['mask'\] are neither in the DataFrame nor "
                                         r"produced by transformation_fn, which returned"):
        learn_inputs(tokenize, sample, ["input_ids", "mask"])


def test_forward_rule_keywords_positions_and_outputs(tok):
    bert = hf_models.tiny_bert(tok.vocab_size)
    rule = ForwardRule.for_model(bert, ["input_ids", "attention_mask"], labels=1,
                                 loss_given=False)
    assert rule.keywords and rule.model_loss
    ids = torch.tensor(hf_models.Tokenize(tok)({"text": np.array(["good app"])})["input_ids"])
    result = rule.call(bert, [ids, torch.ones_like(ids)], [torch.tensor([1])])
    assert rule.loss(result).dim() == 0 and rule.outputs(result)[0].shape == (1, 2)
    # peft's wrapper made without a task_type: forward(*args, **kwargs), read through
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(hf_models.tiny_bert(tok.vocab_size),
                             LoraConfig(r=2, target_modules=["query"]))
    assert ForwardRule.for_model(wrapped, ["input_ids", "attention_mask"], labels=1,
                                 loss_given=False).model_loss
    # named otherwise than forward's parameters: positional, as for any module
    linear = torch.nn.Linear(3, 1)
    assert not ForwardRule.for_model(linear, ["features"]).keywords
    keyed = ForwardRule(("x",), False, False, output_key="pooled")
    with pytest.raises(ValueError, match=r"entries \['logits'\], and output_key='pooled'"):
        keyed.outputs({"logits": torch.zeros(1)})


# -- with Spark ---------------------------------------------------------------------------------
@pytest.mark.full
def test_bert_as_it_is_fits_with_its_own_loss_and_predicts_on_raw_text(
        spark, tok, text_df, test_text, tmp_path):
    fitted = bert_estimator(tok, str(tmp_path / "store")).fit(text_df)
    history = fitted.getHistory()
    assert history["loss"][-1] < history["loss"][0]
    # predicts on the text alone: the saved transformation reads the column it was learned on
    predictions = fitted.transform(test_text.select("text", "label"))
    assert hf_models.accuracy(predictions) >= 0.9
    only_text = fitted.transform(test_text.select("text"))
    assert only_text.count() == 300
    fitted.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    again = loaded.transform(test_text.select("text", "label"))
    first = np.array([r["label__output"] for r in predictions.orderBy("text").collect()])
    second = np.array([r["label__output"] for r in again.orderBy("text").collect()])
    np.testing.assert_allclose(first, second, rtol=1e-5, atol=1e-6)


@pytest.mark.full
def test_explicit_loss_on_the_logits_with_horovod_bf16_and_accumulation(spark, tok, text_df,
                                                                         tmp_path):
    pytest.importorskip("horovod.torch")

    def accuracy(output, label):
        return (output.argmax(dim=1) == label).float().mean()

    fitted = bert_estimator(tok, str(tmp_path / "store"), loss=torch.nn.CrossEntropyLoss(),
                            metrics=[accuracy], backend="horovod", epochs=1,
                            validation=0.2, mixed_precision="bf16",
                            backward_passes_per_step=2).fit(text_df)
    history = fitted.getHistory()
    assert np.isfinite(history["loss"][0]) and 0.0 <= history["val_accuracy"][0] <= 1.0


@pytest.mark.full
def test_lora_adapters_train_and_frozen_weights_stay(spark, tok, text_df, test_text, tmp_path):
    from peft import LoraConfig, get_peft_model

    bert = hf_models.tiny_bert(tok.vocab_size)
    lora = get_peft_model(bert, LoraConfig(r=4, target_modules=["query", "value"],
                                           modules_to_save=["classifier"],
                                           task_type="SEQ_CLS"))
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    store = str(tmp_path / "store")
    fitted = bert_estimator(tok, store, model=lora, strategy="fsdp", epochs=1,
                            optimizer=torch.optim.AdamW(
                                [p for p in lora.parameters() if p.requires_grad], lr=5e-3),
                            run_id="lora").fit(text_df)
    trained = dict(fitted.getModel().named_parameters())
    for name, before in frozen.items():
        assert torch.equal(trained[name], before), name
    assert any(not torch.equal(p, dict(lora.named_parameters())[n])
               for n, p in trained.items() if "lora_" in n)
    # the checkpoint holds the adapters, the head and the optimizer, not the frozen body
    checkpoint = max(glob.glob(os.path.join(store, "runs", "lora", "**", "*.ckpt"),
                               recursive=True), key=os.path.getmtime)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["frozen_omitted"] and not set(frozen) & set(state["model"])
    full = io.BytesIO()
    torch.save(fitted.getModel().state_dict(), full)
    assert os.path.getsize(checkpoint) < len(full.getvalue()) / 2
    fitted.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.transform(test_text.select("text")).count() == 300


@pytest.mark.full
def test_a_per_step_schedule_resumes_from_the_checkpoint(spark, regression_df, tmp_path):
    from support.helpers import linear_estimator

    steps = []

    def halving(optimizer):  # the rate halves at every optimizer step
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)

    store = str(tmp_path / "store")
    df = regression_df.select("features", "label")
    for epochs in (1, 2):  # the second fit resumes the run after its first epoch
        fitted = linear_estimator(store, num_proc=2, epochs=epochs, batch_size=100,
                                  run_id="scheduled", lr_scheduler=halving).fit(df)
        steps.append(len(fitted.getHistory()["loss"]))
    assert steps == [1, 2]
    state = fitted.getOptimizer().state_dict()
    checkpoints = sorted(glob.glob(os.path.join(store, "runs", "scheduled", "**", "*.ckpt"),
                                   recursive=True), key=os.path.getmtime)
    schedule = torch.load(checkpoints[-1], map_location="cpu", weights_only=True)["scheduler"]
    per_epoch = schedule["last_epoch"] // 2
    assert per_epoch >= 1  # stepped per optimizer step, and on from the first fit's count
    lr = state["param_groups"][0]["lr"]
    assert lr == pytest.approx(0.05 * 0.5 ** schedule["last_epoch"])


def test_feature_column_nobody_produces_fails_before_training(spark, tok, text_df, tmp_path):
    est = bert_estimator(tok, str(tmp_path / "store"),
                         feature_cols=["input_ids", "token_type_ids"])
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] are neither in the DataFrame "
                                         r"nor produced by transformation_fn, which returned "
                                         r"\['input_ids', 'attention_mask', 'label'\]"):
        est.fit(text_df)
    assert not os.path.exists(str(tmp_path / "store"))


def test_output_without_logits_needs_output_key(spark, tok, text_df, tmp_path):
    est = bert_estimator(tok, str(tmp_path / "store"), loss=torch.nn.CrossEntropyLoss(),
                         output_key="hidden")
    with pytest.raises(PreflightError, match=r"entries \['logits'\], and "
                                             r"output_key='hidden' names none"):
        est.fit(text_df)


def test_loss_none_with_a_model_that_returns_no_loss(spark, tok, text_df, tmp_path):
    class NoLoss(torch.nn.Module):  # takes labels=, computes nothing with them
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(tok.vocab_size, 2)

        def forward(self, input_ids, attention_mask, labels=None):
            return {"logits": self.embed(input_ids)}

    model = NoLoss()
    est = bert_estimator(tok, str(tmp_path / "store"), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PreflightError, match="returned a dict with the entries \\['logits'\\] "
                                             "without a loss; pass loss="):
        est.fit(text_df)
    plain = torch.nn.Linear(3, 2)
    est = bert_estimator(tok, str(tmp_path / "store"), model=plain,
                         optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="loss is not set"):
        est.fit(text_df)
