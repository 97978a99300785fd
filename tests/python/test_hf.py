"""Trainer settings mapped onto recipes (trainmem.hf)."""
import pytest

import trainmem

transformers = pytest.importorskip("transformers")


def args(**kw):
    return transformers.TrainingArguments(output_dir="/tmp/trainmem-hf-test", report_to=[], **kw)


def test_a_typical_trainer_run_maps_and_estimates():
    # bf16=True needs a GPU to construct TrainingArguments; its to_dict() is accepted the same way.
    d = args(per_device_train_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=True,
             optim="adamw_torch").to_dict()
    d["bf16"] = True
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=512)
    assert knobs == {"batch": 2, "grad_accum": 4, "seq": 512, "precision": "bf16-mixed", "optimizer": "adamw",
                     "checkpointing": "full"}
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    assert est.recipe["grad_accum"] == 4 and est.recipe["checkpointing"] == "full"


def test_defaults_and_dtypes():
    knobs = trainmem.hf.recipe_from_training_arguments(args(), model_dtype="bfloat16")
    assert knobs["optimizer"] == "adamw-fused"  # the Trainer's default optim in transformers 5
    assert knobs["precision"] == "bf16-true"
    assert knobs["batch"] == 8
    d = args(optim="adamw_bnb_8bit").to_dict()
    d["fp16"] = True
    knobs = trainmem.hf.recipe_from_training_arguments(d)
    assert knobs["precision"] == "fp16-mixed" and knobs["optimizer"] == "adamw-8bit"


@pytest.mark.parametrize("kw,message", [
    ({"optim": "lion_8bit"}, "not modelled"),
    ({"optim": "sgd"}, "no momentum"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant"),
])
def test_unmodelled_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        trainmem.hf.recipe_from_training_arguments(args(**kw))


def test_sharding_is_refused_not_ignored():
    with pytest.raises(ValueError, match="deepspeed"):
        trainmem.hf.recipe_from_training_arguments({"deepspeed": {"zero_optimization": {"stage": 3}}})
    with pytest.raises(ValueError, match="fsdp"):
        trainmem.hf.recipe_from_training_arguments({"fsdp": "full_shard"})
