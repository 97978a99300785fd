"""Trainer settings mapped onto recipes (trainmem.hf)."""
import os

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
    # Accelerate's native mixed precision converts the forward's half outputs to fp32; every
    # optimizer step clips (Note [Gradient clipping]).
    assert knobs == {"batch": 2, "grad_accum": 4, "seq": 512, "precision": "bf16-mixed", "optimizer": "adamw",
                     "checkpointing": "full", "fp32_outputs": True, "clip_grad_norm": True}
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


def test_a_half_model_with_adapters_under_autocast():
    """from_pretrained(dtype=torch.bfloat16), LoRA through peft, bf16=True: the frozen bf16 model and
    fp32 adapters under bf16 autocast (measured: cpu-*-lora*-loadbf16-*); without bf16=True the
    adapters run in fp32 (bf16-true)."""
    d = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    d["bf16"] = True
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=256, model_dtype="bfloat16", peft=True)
    assert (knobs["precision"], knobs["load_dtype"]) == ("bf16-mixed", "bf16")
    est = trainmem.estimate("llama-3.2-1b", lora_rank=16, **knobs)
    assert est.recipe["load_dtype"] == "bf16"
    # The frozen weights are bf16: half the fp32-loaded model's, and no autocast copies of them.
    fp32 = trainmem.estimate("llama-3.2-1b", lora_rank=16, **{k: v for k, v in knobs.items() if k != "load_dtype"})
    assert est.breakdown_at_peak["weights"] < 0.6 * fp32.breakdown_at_peak["weights"]
    plain = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    assert trainmem.hf.recipe_from_training_arguments(plain, model_dtype="bfloat16", peft=True)["precision"] == "bf16-true"


def test_a_half_model_trained_whole_under_autocast():
    """from_pretrained(dtype=torch.bfloat16) trained whole with bf16=True: bf16 weights, gradients and
    states under bf16 autocast (measured: cpu-*-bf16mixed-loadbf16-*), but under FSDP, where
    Accelerate casts the trainable parameters to fp32 first; fp16=True over a float16 model fails
    in the GradScaler."""
    d = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    d["bf16"] = True
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=256, model_dtype="bfloat16")
    assert (knobs["precision"], knobs["load_dtype"]) == ("bf16-mixed", "bf16")
    est = trainmem.estimate("gpt2", **knobs)
    true = trainmem.estimate("gpt2", **{**knobs, "precision": "bf16-true", "load_dtype": "auto", "fp32_outputs": False})
    assert est.breakdown_at_peak["weights"] == true.breakdown_at_peak["weights"]
    # GPT-2's LayerNorm runs in fp32 under autocast: its outputs, saved for the next matmul, are wider.
    assert est.peak_allocated_bytes > true.peak_allocated_bytes
    d["fsdp"], d["fsdp_config"] = "full_shard auto_wrap", {"fsdp_version": 2}
    fsdp = trainmem.hf.recipe_from_training_arguments(d, seq=256, model_dtype="bfloat16", gpus=2)
    assert fsdp["precision"] == "bf16-mixed" and "load_dtype" not in fsdp
    assert fsdp == trainmem.hf.recipe_from_training_arguments(d, seq=256, model_dtype="float32", gpus=2)
    d = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    d["fp16"] = True
    with pytest.raises(ValueError, match="refuses fp16 gradients"):
        trainmem.hf.recipe_from_training_arguments(d, model_dtype="float16")


@pytest.mark.parametrize("fsdp,expected", [
    ("full_shard auto_wrap", {"parallel": "fsdp"}),
    ("shard_grad_op auto_wrap", {"parallel": "fsdp", "fsdp_reshard_after_forward": False}),
    ("full_shard offload auto_wrap", {"parallel": "fsdp", "offload": "both"}),
    (True, {"parallel": "fsdp"}),
])
def test_fsdp_of_real_training_arguments(fsdp, expected):
    """transformers 5 keeps `fsdp` as True and moves the words into `fsdp_config` (version,
    reshard_after_forward, cpu_offload) whatever it was given; the mapping reads both forms."""
    a = args(fsdp=fsdp, fsdp_config={"fsdp_version": 2}, use_cpu=True)
    for given in (a, a.to_dict()):
        knobs = trainmem.hf.recipe_from_training_arguments(given, gpus=2)
        assert {k: knobs[k] for k in expected} == expected
        assert ("fsdp_reshard_after_forward" in knobs) == ("fsdp_reshard_after_forward" in expected)
        assert ("offload" in knobs) == ("offload" in expected)


def test_fsdp_config_keys_with_the_prefix():
    # A hand-written dict as a Trainer config file spells it: "fsdp_" prefixes mean the same.
    d = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                       "fsdp_cpu_offload": True}}
    knobs = trainmem.hf.recipe_from_training_arguments(d, gpus=2)
    assert (knobs["fsdp_reshard_after_forward"], knobs["offload"]) == (False, "both")


@pytest.mark.parametrize("kw,message", [
    ({"optim": "lion_8bit"}, "not modelled"),
    ({"optim": "sgd"}, "no momentum"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 2}}, "every_n_layers"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}}, "offload"),
])
def test_unmodelled_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        trainmem.hf.recipe_from_training_arguments(args(**kw))


def test_the_trainers_checkpointing_and_peft_s():
    """gradient_checkpointing=True is use_reentrant=False when the kwargs are empty (passed on as
    None) or say so, else torch's default, the reentrant variant; a 4-bit base prepared by
    prepare_model_for_kbit_training with its defaults is checkpointed with the non-reentrant
    variant (peft passes no kwargs, which transformers makes use_reentrant=False) when the Trainer
    does not checkpoint it itself, and without the Trainer's the caller must say."""
    ckpt = trainmem.hf.recipe_from_training_arguments
    with_kwargs = lambda kw: {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": kw}  # noqa: E731
    assert ckpt(args(gradient_checkpointing=True))["checkpointing"] == "full"
    assert ckpt(with_kwargs({}))["checkpointing"] == "full"
    assert ckpt(with_kwargs({"use_reentrant": False, "preserve_rng_state": False}))["checkpointing"] == "full"
    assert ckpt(with_kwargs({"preserve_rng_state": False}))["checkpointing"] == "full-reentrant"
    assert ckpt(with_kwargs('{"use_reentrant": true}'))["checkpointing"] == "full-reentrant"
    with pytest.raises(ValueError, match="early_stop"):
        ckpt(with_kwargs({"use_reentrant": False, "early_stop": False}))
    reentrant = ckpt(args(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}), seq=128)
    assert reentrant["checkpointing"] == "full-reentrant"
    assert trainmem.estimate("qwen3-0.6b", **reentrant).recipe["checkpointing"] == "full-reentrant"
    qlora = dict(seq=128, model_dtype="bfloat16", peft=True, quantization_config=QLORA)
    plain, checkpointed = args().to_dict(), args(gradient_checkpointing=True).to_dict()
    plain["bf16"] = checkpointed["bf16"] = True
    with pytest.raises(ValueError, match="pass kbit_gradient_checkpointing"):
        ckpt(plain, **qlora)
    assert ckpt(plain, kbit_gradient_checkpointing=True, **qlora)["checkpointing"] == "full"
    assert ckpt(plain, kbit_gradient_checkpointing=False, **qlora)["checkpointing"] == "none"
    assert ckpt(plain, prepare_kbit_training=False, **qlora)["checkpointing"] == "none"
    assert ckpt(checkpointed, **qlora)["checkpointing"] == "full"
    # Non-reentrant, so also under DDP with the find_unused_parameters the Trainer sets for a peft
    # model (the reentrant variant fails there: "ready only once").
    ddp = ckpt(plain, kbit_gradient_checkpointing=True, gpus=2, **qlora)
    assert (ddp["parallel"], ddp["checkpointing"], ddp["ddp_find_unused_parameters"]) == ("ddp", "full", True)
    assert trainmem.estimate("qwen3-0.6b", lora_rank=8, **ddp).recipe["parallel"] == "ddp"
    with pytest.raises(ValueError, match="ready only once"):
        ckpt({**plain, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
             gpus=2, **qlora)
    knobs = ckpt(plain, kbit_gradient_checkpointing=True, **qlora)
    assert trainmem.estimate("qwen3-0.6b", lora_rank=8, **knobs).peak_allocated_bytes > 0


def test_accumulation_under_the_trainers_no_sync():
    """The Trainer runs every micro-batch but the last under accelerator.no_sync unless
    sync_each_batch: DDP's no_sync (ddp_no_sync, measured: parallel/cpu-ddp-*-nosync-*); FSDP2's
    set_requires_gradient_sync(False) (fsdp_no_sync, measured: parallel/cpu-fsdp-*-nosync-*)."""
    ckpt = dict(gradient_checkpointing=True)
    knobs = trainmem.hf.recipe_from_training_arguments(args(gradient_accumulation_steps=4, **ckpt), gpus=2, seq=64)
    assert knobs["ddp_no_sync"] is True
    assert trainmem.estimate("qwen3-0.6b", **knobs).recipe["ddp_no_sync"] is True
    assert "ddp_no_sync" not in trainmem.hf.recipe_from_training_arguments(args(**ckpt), gpus=2)
    assert "ddp_no_sync" not in trainmem.hf.recipe_from_training_arguments(args(gradient_accumulation_steps=4), gpus=1)
    each = args(gradient_accumulation_steps=4, accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})
    assert "ddp_no_sync" not in trainmem.hf.recipe_from_training_arguments(each, gpus=2)
    fsdp = args(gradient_accumulation_steps=4, fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2}).to_dict()
    knobs = trainmem.hf.recipe_from_training_arguments(fsdp, gpus=2, seq=64)
    assert knobs["fsdp_no_sync"] is True
    assert trainmem.estimate("qwen3-0.6b", **knobs).recipe["fsdp_no_sync"] is True
    fsdp["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert "fsdp_no_sync" not in trainmem.hf.recipe_from_training_arguments(fsdp, gpus=2)
    # accelerator_config's num_steps is the Trainer's accumulation; split batches are refused.
    steps = args(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 3}})
    assert trainmem.hf.recipe_from_training_arguments(steps)["grad_accum"] == 3
    with pytest.raises(ValueError, match="split_batches"):
        trainmem.hf.recipe_from_training_arguments(args(accelerator_config={"split_batches": True}))


def test_the_precision_accelerate_reads_from_its_environment(monkeypatch):
    # TrainingArguments reads ACCELERATE_MIXED_PRECISION into mixed_precision when bf16 / fp16 are unset.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    a = args()
    assert a.mixed_precision == "bf16"
    assert trainmem.hf.recipe_from_training_arguments(a)["precision"] == "bf16-mixed"
    # to_dict() drops mixed_precision: the variable is read for a dict
    assert trainmem.hf.recipe_from_training_arguments(a.to_dict())["precision"] == "bf16-mixed"


def test_ddp_find_unused_parameters_as_the_trainer_sets_it():
    # Trainer._build_accelerator_args: the argument when set; else True for a peft model, and for a
    # PreTrainedModel that is not checkpointed.
    plain, ckpt = args(), args(gradient_checkpointing=True)
    assert trainmem.hf.recipe_from_training_arguments(plain, gpus=2)["ddp_find_unused_parameters"] is True
    assert "ddp_find_unused_parameters" not in trainmem.hf.recipe_from_training_arguments(ckpt, gpus=2)
    assert trainmem.hf.recipe_from_training_arguments(ckpt, gpus=2, peft=True)["ddp_find_unused_parameters"] is True
    off = args(ddp_find_unused_parameters=False)
    assert "ddp_find_unused_parameters" not in trainmem.hf.recipe_from_training_arguments(off, gpus=2, peft=True)
    assert "ddp_find_unused_parameters" not in trainmem.hf.recipe_from_training_arguments(plain, gpus=1)
    # transformers 5's own name for it, in a dict without the deprecated alias
    assert "ddp_find_unused_parameters" not in trainmem.hf.recipe_from_training_arguments(
        {"activation_checkpointing": True}, gpus=2)
    knobs = trainmem.hf.recipe_from_training_arguments(ckpt, gpus=2, peft=True, seq=128)
    est = trainmem.estimate("qwen3-0.6b", lora_rank=8, **knobs)
    assert est.recipe["ddp_find_unused_parameters"] is True


def test_fsdp_and_ddp_from_trainer_settings():
    d = args(per_device_train_batch_size=2).to_dict()
    assert trainmem.hf.recipe_from_training_arguments(d, gpus=4)["parallel"] == "ddp"
    assert "parallel" not in trainmem.hf.recipe_from_training_arguments(d, gpus=1)
    d.update(fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2})
    knobs = trainmem.hf.recipe_from_training_arguments(d, gpus=8, seq=256)
    assert knobs["parallel"] == "fsdp" and knobs["gpus"] == 8
    assert trainmem.estimate("qwen3-0.6b", **knobs).recipe["parallel"] == "fsdp"
    assert "fsdp_reshard_after_forward" not in knobs


@pytest.mark.parametrize("fsdp,config", [
    ("shard_grad_op auto_wrap", {"fsdp_version": 2}),
    ("full_shard", {"fsdp_version": 2, "reshard_after_forward": False}),
])
def test_shard_grad_op_is_reshard_after_forward_false(fsdp, config):
    # transformers' _apply_legacy_fsdp_to_config: shard_grad_op is FSDP2's reshard_after_forward=False
    knobs = trainmem.hf.recipe_from_training_arguments({"fsdp": fsdp, "fsdp_config": config}, gpus=2, seq=64)
    assert knobs["parallel"] == "fsdp" and knobs["fsdp_reshard_after_forward"] is False
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    assert est.recipe["fsdp_reshard_after_forward"] is False
    full = trainmem.estimate("qwen3-0.6b", **{**knobs, "fsdp_reshard_after_forward": True})
    assert est.peak_allocated_bytes >= full.peak_allocated_bytes


@pytest.mark.parametrize("fsdp,config,message", [
    ("full_shard", {"version": 1}, "FSDP1 (flat parameters) is not modelled"),
    ("full_shard", {"fsdp_version": 1}, "FSDP1 (flat parameters) is not modelled"),
    ("full_shard", {"activation_checkpointing": "true"}, "FSDP's own checkpoint_wrapper is not modelled"),
    ("full_shard", {"auto_wrap_policy": "SIZE_BASED_WRAP"}, "auto_wrap_policy='SIZE_BASED_WRAP'"),
    ("full_shard", {"reshard_after_forward": "sometimes"}, "reshard_after_forward='sometimes'"),
    ("full_shard", [1, 2], "fsdp_config: expected a dict"),
    ("hybrid_shard", {"fsdp_version": 2}, "hybrid sharding is FSDP1-only"),
    ("full_shard shard_grad_op", {"fsdp_version": 2}, "'full_shard' or 'shard_grad_op'"),
])
def test_unmodelled_fsdp_is_refused(fsdp, config, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        trainmem.hf.recipe_from_training_arguments({"fsdp": fsdp, "fsdp_config": config}, gpus=2)
    with pytest.raises(ValueError, match="pass gpus="):
        trainmem.hf.recipe_from_training_arguments({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}})


@pytest.mark.parametrize("fsdp,config", [
    ("full_shard offload auto_wrap", {"fsdp_version": 2}),
    ("full_shard", {"fsdp_version": 2, "cpu_offload": True}),
])
def test_fsdp_offload_is_cpu_offload_policy(fsdp, config):
    # transformers turns "offload" into fsdp_config cpu_offload, Accelerate into CPUOffloadPolicy()
    knobs = trainmem.hf.recipe_from_training_arguments({"fsdp": fsdp, "fsdp_config": config}, gpus=4, seq=256)
    assert knobs["parallel"] == "fsdp" and knobs["offload"] == "both"
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    plain = trainmem.estimate("qwen3-0.6b", **{k: v for k, v in knobs.items() if k != "offload"})
    assert est.recipe["offload"] == "both"
    # the shards, their gradients and the optimizer states leave the GPU for the host
    assert est.peak_allocated_bytes < plain.peak_allocated_bytes
    assert est.host_bytes["optimizer_states"] > 0 and est.host_bytes["weights"] > 0


ZERO2 = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 64,
         "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


def test_deepspeed_config_maps_onto_a_recipe(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(ZERO2))
    knobs = trainmem.hf.recipe_from_deepspeed_config(str(path), seq=512)
    assert knobs == {"parallel": "zero2", "batch": 4, "grad_accum": 2, "gpus": 8, "precision": "bf16-master",
                     "optimizer": "adamw", "seq": 512}
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    assert est.recipe["parallel"] == "zero2" and est.recipe["gpus"] == 8
    torch_adam = dict(ZERO2, optimizer={"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}})
    assert trainmem.hf.recipe_from_deepspeed_config(torch_adam)["optimizer"] == "adamw"
    fused = dict(ZERO2, optimizer={"type": "AdamW", "params": {"lr": 1e-4}})
    assert trainmem.hf.recipe_from_deepspeed_config(fused)["optimizer"] == "adamw-fused"


def test_deepspeed_offload_optimizer_maps_onto_offload():
    cfg = dict(ZERO2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
               optimizer={"type": "AdamW", "params": {"lr": 1e-4}})
    knobs = trainmem.hf.recipe_from_deepspeed_config(cfg, seq=256)
    assert knobs["offload"] == "optimizer" and knobs["optimizer"] == "adamw" and knobs["parallel"] == "zero2"
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    assert est.recipe["offload"] == "optimizer"
    assert est.breakdown_at_peak["optimizer_states"] == 0
    host = est.host_bytes
    assert host["measured"] is False and host["optimizer_states"] > 0
    assert host["total_bytes"] == host["pinned_bytes"] + host["pageable_bytes"]
    plain = trainmem.estimate("qwen3-0.6b", **{k: v for k, v in knobs.items() if k != "offload"})
    assert est.peak_allocated_bytes < plain.peak_allocated_bytes and not plain.host_bytes
    with pytest.raises(ValueError, match="refuses a client optimizer"):
        trainmem.hf.recipe_from_deepspeed_config(dict(cfg, optimizer=None))


@pytest.mark.parametrize("zero,offload", [
    ({"offload_optimizer": {"device": "cpu"}}, "optimizer"),
    ({"offload_param": {"device": "cpu"}}, "params"),
    ({"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}, "both"),
])
def test_deepspeed_stage3_offload_maps_onto_offload(zero, offload):
    # ZeRO-3's offload_optimizer / offload_param (Note [ZeRO-3 offload]): the knob names what is
    # on the host; offload_param alone keeps the config's optimizer on the GPU.
    cfg = dict(ZERO2, zero_optimization=dict(stage=3, **zero), optimizer={"type": "AdamW", "params": {"lr": 1e-4}})
    knobs = trainmem.hf.recipe_from_deepspeed_config(cfg, seq=128)
    assert knobs["parallel"] == "zero3" and knobs["offload"] == offload
    assert knobs["optimizer"] == ("adamw-fused" if offload == "params" else "adamw")
    est = trainmem.estimate("qwen3-0.6b", **knobs)
    assert est.recipe["offload"] == offload and est.host_bytes["total_bytes"] > 0
    assert (est.breakdown_at_peak["optimizer_states"] == 0) == (offload != "params")


def test_deepspeed_auto_values_come_from_the_trainer():
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"}}
    d = args(per_device_train_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=True,
             optim="sgd", optim_args="momentum=0.9").to_dict()
    d["bf16"] = True
    d["deepspeed"] = auto
    knobs = trainmem.hf.recipe_from_training_arguments(d, gpus=2, seq=128)
    assert knobs == {"parallel": "zero1", "batch": 2, "grad_accum": 4, "gpus": 2, "precision": "bf16-master",
                     "optimizer": "sgd", "checkpointing": "full", "seq": 128}
    with pytest.raises(ValueError, match="'auto' needs the Trainer's settings"):
        trainmem.hf.recipe_from_deepspeed_config(auto, gpus=2)


@pytest.mark.parametrize("change,message", [
    ({"zero_optimization": {"stage": 0}}, "stage 0"),
    ({"zero_optimization": {"stage": 4}}, "expected 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "under stage 3 only"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "offload to nvme is not modelled"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload to nvme is not modelled"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}},
     "offload_param.pin_memory=False"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio=0.5"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}, "reduce_bucket_size=200000000.0"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": True}}, "overlap_comm"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "fp16 with loss scaling"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
    ({"train_batch_size": 63}, "train_batch_size=63 is not a multiple of micro-batch 4 x accumulation 2"),
    ({"train_batch_size": None}, "the world size is not given"),
    ({"gradient_accumulation_steps": None}, "the world size is not given"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "expected a positive integer, got 2.5"),
    ({"zero_optimization": {"stage": 3, "overlap_comm": False}}, "overlap_comm=False"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, "fills it with the model's hidden_size²"),
    ({"zero_optimization": {"stage": 3, "max_live_parameters": 1e8}}, "max_live_parameters=100000000.0"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights=True"),
    ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "zero_optimization.zenflow: not modelled"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": True}}, "offload_optimizer: expected an object"),
    ({"zero_optimization": {"stage": "auto"}}, "'auto' is not a value the Trainer fills"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "without fp32 master weights"),
    ({"bf16": {"enabled": "maybe"}}, "bf16.enabled='maybe'"),
    ({"optimizer": "AdamW"}, "optimizer: expected an object"),
    ({"train_micro_batch_size_per_gpu": 0}, "expected a positive integer, got 0"),
])
def test_unmodelled_deepspeed_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        trainmem.hf.recipe_from_deepspeed_config(dict(ZERO2, **change))


def test_deepspeed_settles_its_batch_as_deepspeed_does():
    # DeepSpeedConfig._set_batch_related_parameters: two of the three give the third over the world size.
    base = {"zero_optimization": {"stage": 2}}
    def batch(gpus=None, **kw):
        k = trainmem.hf.recipe_from_deepspeed_config({**base, **kw}, gpus=gpus)
        return k["batch"], k["grad_accum"], k["gpus"]
    assert batch(2, train_batch_size=64, train_micro_batch_size_per_gpu=4) == (4, 8, 2)
    assert batch(2, train_batch_size=64, gradient_accumulation_steps=4) == (8, 4, 2)
    assert batch(2, train_batch_size=64) == (32, 1, 2)
    assert batch(2, train_micro_batch_size_per_gpu=4) == (4, 1, 2)
    assert batch(train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2) == (4, 2, 8)
    with pytest.raises(ValueError, match="DeepSpeed refuses it"):  # its _batch_assertion
        batch(2, train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="leaves no micro-batch"):
        batch(8, train_batch_size=4)


def test_deepspeed_under_the_trainer_fills_and_checks_as_it_does():
    ta = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": True, "optim": "adamw_torch"}
    # Only "auto" is filled: a missing accumulation is 1 for DeepSpeed (Accelerate's) but the run
    # accumulates the Trainer's micro-batches (Accelerate sets DeepSpeed's boundary from them), a
    # missing micro-batch leaves DeepSpeed without a batch; bf16 comes from Accelerate, which adds
    # the section (even beside an old "bfloat16" one, which DeepSpeed reads second).
    knobs = trainmem.hf.recipe_from_deepspeed_config(
        {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "bfloat16": {}}, gpus=2,
        training_arguments=ta)
    assert (knobs["batch"], knobs["grad_accum"], knobs["precision"]) == (2, 4, "bf16-master")
    # With bf16=False Accelerate's section says enabled false, so an old "bfloat16" one is not read.
    knobs = trainmem.hf.recipe_from_deepspeed_config(
        {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "bfloat16": {"enabled": True}},
        gpus=2, training_arguments={**ta, "bf16": False})
    assert knobs["precision"] == "fp32"
    with pytest.raises(ValueError, match="train_batch_size or train_micro_batch_size_per_gpu is needed"):
        trainmem.hf.recipe_from_deepspeed_config({"zero_optimization": {"stage": 2}}, gpus=2, training_arguments=ta)
    # "auto" is bf16 or bf16_full_eval (transformers' trainer_config_process)
    full_eval = {**ta, "bf16": False, "bf16_full_eval": True}
    base = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    assert trainmem.hf.recipe_from_deepspeed_config({**base, "bf16": {"enabled": "auto"}},
                                                    gpus=2, training_arguments=full_eval)["precision"] == "bf16-master"
    assert trainmem.hf.recipe_from_deepspeed_config({"zero_optimization": {"stage": 2}, "bfloat16": {"enabled": True},
                                                     "train_micro_batch_size_per_gpu": 1}, gpus=2)["precision"] == "bf16-master"
    for cfg, message in [({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4 and TrainingArguments"),
                         ({"bf16": {"enabled": False}}, "bf16.enabled=False and TrainingArguments bf16=True"),
                         ({"train_batch_size": 64}, "DeepSpeed refuses it")]:
        with pytest.raises(ValueError, match=__import__("re").escape(message)):
            trainmem.hf.recipe_from_deepspeed_config({**base, **cfg}, gpus=2, training_arguments=ta)
    with pytest.raises(ValueError, match="fp16 with loss scaling"):  # Accelerate adds the fp16 section
        trainmem.hf.recipe_from_deepspeed_config(base, gpus=2, training_arguments={**ta, "bf16": False, "fp16": True})


def test_deepspeed_deprecated_offload_booleans_and_settings_it_ignores():
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": "true", "overlap_comm": True,
        "stage3_gather_16bit_weights_on_model_save": True, "prefetch_bucket_size": 50_000_000},
        "optimizer": {"type": "AdamW"}}
    knobs = trainmem.hf.recipe_from_deepspeed_config(cfg, gpus=2)
    assert knobs["offload"] == "both" and knobs["optimizer"] == "adamw"


def test_trainer_settings_the_engine_does_not_model_are_refused():
    ta = {"per_device_train_batch_size": 2}
    for extra, message in [({"label_smoothing_factor": 0.1}, "LabelSmoother"),
                           ({"torch_compile": True}, "torch_compile=True"),
                           ({"ddp_bucket_cap_mb": 100}, "ddp_bucket_cap_mb=100"),
                           ({"ddp_broadcast_buffers": False}, "ddp_broadcast_buffers=False"),
                           ({"ddp_static_graph": True}, "ddp_static_graph=True"),
                           ({"optim": "sgd", "optim_args": "momentum=0"}, "SGD has no momentum by default"),
                           ({"per_device_train_batch_size": None}, "per_device_train_batch_size: expected a positive"),
                           ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": "{bad"}, "not JSON"),
                           ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": [1]}, "expected a dict"),
                           ({"fsdp": "full_shard", "deepspeed": {"zero_optimization": {"stage": 2}}},
                            "one or the other")]:
        with pytest.raises(ValueError, match=__import__("re").escape(message)):
            trainmem.hf.recipe_from_training_arguments({**ta, **extra}, gpus=2)
    # at the defaults, and one GPU (no DDP), they pass
    assert trainmem.hf.recipe_from_training_arguments({**ta, "ddp_bucket_cap_mb": 25, "ddp_static_graph": False},
                                                      gpus=2)["parallel"] == "ddp"
    assert "parallel" not in trainmem.hf.recipe_from_training_arguments({**ta, "ddp_bucket_cap_mb": 100})
    sgd = trainmem.hf.recipe_from_training_arguments({**ta, "optim": "sgd", "optim_args": "momentum=0.9, nesterov=True"})
    assert sgd["optimizer"] == "sgd"


def test_fsdp_cpu_offload_is_any_true_value_as_transformers_reads_it():
    # training_args.py: `if self.fsdp_config.get("cpu_offload", False)`, a plain truth test
    for value, offloaded in [(True, True), ("false", True), ("yes", True), (0, False), (False, False), ("", False)]:
        knobs = trainmem.hf.recipe_from_training_arguments({"fsdp": True, "fsdp_config": {"cpu_offload": value}},
                                                           gpus=2)
        assert (knobs.get("offload") == "both") == offloaded, value


def test_deepspeed_under_a_partial_trainer_dict_takes_the_trainers_defaults():
    auto = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto"}
    knobs = trainmem.hf.recipe_from_deepspeed_config(auto, gpus=2, training_arguments={"per_device_train_batch_size": 2})
    assert (knobs["batch"], knobs["grad_accum"]) == (2, 1)
    knobs = trainmem.hf.recipe_from_deepspeed_config(auto, gpus=2, training_arguments={})
    assert (knobs["batch"], knobs["grad_accum"]) == (8, 1)


def test_an_fsdp_run_without_a_version_is_fsdp2(tmp_path):
    # transformers' _process_fsdp_args: version 2 unless the config says 1; the config may be a file.
    assert trainmem.hf.recipe_from_training_arguments({"fsdp": "full_shard"}, gpus=2)["parallel"] == "fsdp"
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_reshard_after_forward": "off"}')
    knobs = trainmem.hf.recipe_from_training_arguments({"fsdp": True, "fsdp_config": str(path)}, gpus=2)
    # FSDP2's clip over DTensors is not modelled: no clip_grad_norm there.
    assert knobs == {"parallel": "fsdp", "fsdp_reshard_after_forward": False, "gpus": 2, "batch": 8, "grad_accum": 1,
                     "precision": "fp32", "optimizer": "adamw-fused", "checkpointing": "none", "use_cache": True}


def test_the_training_cache_the_trainer_leaves_on():
    """Without checkpointing a Trainer run keeps the config's use_cache (Note [A cache in training];
    measured: cpu-*-usecache-*), under DeepSpeed and with Liger's loss too (cpu-zero*-*-usecache-*,
    cpu-*-fusedloss-usecache-*); checkpointing or a config that turns it off do not."""
    hf = trainmem.hf.recipe_from_training_arguments
    knobs = hf(args(), seq=64)
    assert knobs["use_cache"] is True
    assert trainmem.estimate("qwen3-0.6b", **knobs).recipe["use_cache"] is True
    assert "use_cache" not in hf(args(), seq=64, model_use_cache=False)
    assert "use_cache" not in hf(args(gradient_checkpointing=True), seq=64)
    # sliding-window layers' caches copy the same (measured: cpu-gemma2w512l2-*-usecache-*)
    assert trainmem.estimate("gemma-2-2b", **knobs).recipe["use_cache"] is True
    liger = hf({"use_liger_kernel": True, "liger_kernel_config": LIGER_LOSS_ONLY}, seq=64)
    assert (liger["loss"], liger["use_cache"]) == ("fused", True)
    def deepspeed(stage):
        return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}

    zero = hf({"deepspeed": deepspeed(2)}, seq=64, gpus=2)
    assert (zero["parallel"], zero["use_cache"]) == ("zero2", True)
    assert trainmem.estimate("qwen3-0.6b", **zero).recipe["use_cache"] is True
    assert "use_cache" not in hf({"deepspeed": deepspeed(3), "gradient_checkpointing": True}, seq=64, gpus=2)


def test_unreadable_deepspeed_configs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        trainmem.hf.recipe_from_deepspeed_config(str(bad), gpus=2)
    with pytest.raises(ValueError, match="cannot read it"):
        trainmem.hf.recipe_from_deepspeed_config(str(tmp_path / "missing.json"), gpus=2)
    with pytest.raises(ValueError, match="expected a dict or a JSON file's path, got list"):
        trainmem.hf.recipe_from_deepspeed_config([{"zero_optimization": {"stage": 2}}], gpus=2)


QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}


def test_a_qlora_trainer_run_maps_its_bitsandbytes_config():
    d = args(per_device_train_batch_size=2, gradient_checkpointing=True, optim="adamw_torch").to_dict()
    d["bf16"] = True
    # The common recipe: from_pretrained(dtype=torch.bfloat16, quantization_config=...), then
    # prepare_model_for_kbit_training and bf16=True: a bf16 QuantState under bf16 autocast.
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=256, model_dtype="bfloat16", peft=True,
                                                       quantization_config=QLORA)
    assert knobs["precision"] == "bf16-mixed" and knobs["load_dtype"] == "bf16"
    assert knobs["load_in_4bit"] and knobs["bnb_4bit_quant_type"] == "nf4" and knobs["bnb_4bit_use_double_quant"]
    est = trainmem.estimate("qwen3-0.6b", lora_rank=16, **knobs)
    assert est.recipe["load_dtype"] == "bf16"
    # A float32-loaded base keeps the precision's dtype (load_dtype auto, not written).
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=256, peft=True, quantization_config=QLORA)
    assert knobs["precision"] == "bf16-mixed" and "load_dtype" not in knobs
    # The config object's to_dict() is read the same way.
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")
    knobs = trainmem.hf.recipe_from_training_arguments(d, model_dtype="bfloat16", peft=True, quantization_config=cfg)
    assert knobs["load_dtype"] == "bf16" and not knobs["bnb_4bit_use_double_quant"]
    # On a GPU without bf16 (a T4): dtype=torch.float16, fp16=True, compute dtype float16.
    d16 = args().to_dict()
    d16["fp16"] = True
    knobs = trainmem.hf.recipe_from_training_arguments(d16, model_dtype="float16", peft=True,
                                                       quantization_config={**QLORA, "bnb_4bit_compute_dtype": "float16"},
                                                       kbit_gradient_checkpointing=False)
    assert knobs["precision"] == "fp16-mixed" and knobs["load_dtype"] == "fp16"


def test_an_fsdp_qlora_run_with_bf16_quant_storage():
    """The FSDP-QLoRA Trainer recipe: a bf16-loaded base whose packed weights are stored as bf16,
    bf16=True, FSDP2 full sharding (measured: cpu-fsdp-*-qsbf16-*)."""
    d = args(per_device_train_batch_size=1, gradient_checkpointing=True, optim="adamw_torch").to_dict()
    d["bf16"], d["fsdp"], d["fsdp_config"] = True, "full_shard", {"fsdp_version": 2}
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype="bfloat16", bnb_4bit_quant_storage="bfloat16")
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=512, model_dtype="bfloat16", peft=True, gpus=2,
                                                       quantization_config=cfg)
    assert (knobs["parallel"], knobs["load_dtype"], knobs["bnb_4bit_quant_storage"]) == ("fsdp", "bf16", "bf16")
    # Accelerate's policy over it (measured: cpu-fsdp-*-qsbf16-*-bf16params-bf16reduce-*).
    assert (knobs["fsdp_param_dtype"], knobs["fsdp_reduce_dtype"]) == ("bf16", "bf16")
    policy = trainmem.estimate("llama-3.2-1b", lora_rank=16, **knobs)
    assert policy.recipe["fsdp_param_dtype"] == "bf16"
    plain = {k: v for k, v in knobs.items() if not k.startswith("fsdp_")}
    est = trainmem.estimate("llama-3.2-1b", lora_rank=16, **plain)
    assert policy.peak_allocated_bytes < est.peak_allocated_bytes  # the fp32 rest all-gathered in bf16
    assert est.recipe["bnb_4bit_quant_storage"] == "bf16"
    uint8 = trainmem.estimate("llama-3.2-1b", lora_rank=16, **{**plain, "bnb_4bit_quant_storage": "uint8"})
    # The same bytes: Llama-3.2-1B's projections have a multiple of 4 * 2 elements, so every shard
    # and gather holds what uint8 rows hold.
    assert est.peak_allocated_bytes == uint8.peak_allocated_bytes


def test_fsdp_with_bf16_is_autocast_over_accelerates_policy():
    """Accelerate's FSDP2 with mixed precision bf16: MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16) over fp32 shards, the forward still under autocast (measured:
    cpu-fsdp-*-bf16mixed-*-bf16params-bf16reduce-*). The bf16 all-gathers make the unsharded
    parameters half what autocast's copies of fp32 ones would be."""
    d = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    d["bf16"], d["fsdp"], d["fsdp_config"] = True, "full_shard auto_wrap", {"fsdp_version": 2}
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=1024, gpus=2)
    assert (knobs["precision"], knobs["fsdp_param_dtype"], knobs["fsdp_reduce_dtype"]) == ("bf16-mixed", "bf16", "bf16")
    policy = trainmem.estimate("llama-3.2-1b", **knobs)
    assert policy.recipe["fsdp_param_dtype"] == "bf16"
    plain = trainmem.estimate("llama-3.2-1b", **{k: v for k, v in knobs.items() if not k.startswith("fsdp_")})
    assert policy.peak_allocated_bytes < plain.peak_allocated_bytes
    # Over a peft model loaded in fp32 or in bf16 too (measured), and a bf16-stored 4-bit base; a uint8 one
    # Accelerate keeps out of fully_shard (not modelled: refused).
    assert trainmem.hf.recipe_from_training_arguments(d, gpus=2, peft=True)["fsdp_param_dtype"] == "bf16"
    half = trainmem.hf.recipe_from_training_arguments(d, seq=1024, gpus=2, peft=True, model_dtype="bfloat16")
    assert (half["load_dtype"], half["fsdp_param_dtype"]) == ("bf16", "bf16")
    assert trainmem.estimate("llama-3.2-1b", lora_rank=16, **half).recipe["fsdp_param_dtype"] == "bf16"
    with pytest.raises(ValueError, match="leaves uint8-stored 4-bit weights out of fully_shard"):
        trainmem.hf.recipe_from_training_arguments(d, gpus=2, peft=True, quantization_config=QLORA)
    qs = trainmem.hf.recipe_from_training_arguments(d, gpus=2, peft=True, model_dtype="bfloat16",
                                                    quantization_config={**QLORA, "bnb_4bit_quant_storage": "bfloat16"},
                                                    kbit_gradient_checkpointing=False)
    assert (qs["load_dtype"], qs["bnb_4bit_quant_storage"], qs["fsdp_param_dtype"]) == ("bf16", "bf16", "bf16")
    # Without bf16=True no policy: fp32 FSDP2.
    d["bf16"] = False
    assert "fsdp_param_dtype" not in trainmem.hf.recipe_from_training_arguments(d, gpus=2)


def test_an_unprepared_sharded_qlora_base():
    """TRL's SFTTrainer skips prepare_model_for_kbit_training for a base sharded by FSDP: what is
    not 4-bit stays bf16 (measured: cpu-*-noprep-*), so the residual stream and the logits are half."""
    d = args(per_device_train_batch_size=4, optim="adamw_torch").to_dict()
    d["bf16"], d["fsdp"], d["fsdp_config"] = True, "full_shard", {"fsdp_version": 2}
    cfg = {**QLORA, "bnb_4bit_quant_storage": "bfloat16"}
    kw = dict(seq=1024, model_dtype="bfloat16", peft=True, gpus=2, quantization_config=cfg,
              kbit_gradient_checkpointing=False)
    unprepared = trainmem.hf.recipe_from_training_arguments(d, prepare_kbit_training=False, **kw)
    assert unprepared["prepare_kbit_training"] is False
    prepared = trainmem.hf.recipe_from_training_arguments(d, **kw)
    assert "prepare_kbit_training" not in prepared
    # Without a policy (DDP, or FSDP2 run by hand) the prepared fp32 rest makes an fp32 residual stream.
    plain = lambda k: {key: v for key, v in k.items() if not key.startswith("fsdp_")}  # noqa: E731
    half = trainmem.estimate("llama-3.2-1b", lora_rank=16, **plain(unprepared))
    fp32 = trainmem.estimate("llama-3.2-1b", lora_rank=16, **plain(prepared))
    assert half.recipe["prepare_kbit_training"] is False
    assert half.breakdown_at_peak["activations"] < 0.7 * fp32.breakdown_at_peak["activations"]
    # Under Accelerate's bf16 policy (the Trainer's FSDP2) the policy casts the prepared rest to bf16
    # for the compute: the activations are the same, the prepared rest's shards fp32.
    half = trainmem.estimate("llama-3.2-1b", lora_rank=16, **unprepared)
    fp32 = trainmem.estimate("llama-3.2-1b", lora_rank=16, **prepared)
    assert half.breakdown_at_peak["activations"] == fp32.breakdown_at_peak["activations"]
    assert half.peak_allocated_bytes < fp32.peak_allocated_bytes
    # A float32-loaded base is the same model prepared or not: nothing to mark.
    kw["model_dtype"] = "float32"
    assert "prepare_kbit_training" not in trainmem.hf.recipe_from_training_arguments(d, prepare_kbit_training=False, **kw)


@pytest.mark.parametrize("change,kw,message", [
    ({"bnb_4bit_compute_dtype": "float32"}, {}, "bnb_4bit_compute_dtype=float32 under bf16-mixed"),
    ({"bnb_4bit_quant_storage": "float16"}, {}, "bnb_4bit_quant_storage=float16 is not modelled"),
    ({"load_in_4bit": False, "load_in_8bit": True}, {}, "load_in_8bit training"),
    ({}, {"model_dtype": "float16"}, "float16-loaded 4-bit base trained in bf16-mixed"),
    ({}, {"peft": False}, "pass peft="),
    (None, {}, r"expected a BitsAndBytesConfig or its to_dict\(\), got list"),
])
def test_unmodelled_qlora_settings_are_refused(change, kw, message):
    d = args().to_dict()
    d["bf16"] = True
    kw = {"model_dtype": "bfloat16", "peft": True, **kw}
    config = [QLORA] if change is None else {**QLORA, **change}
    with pytest.raises(ValueError, match=message):
        trainmem.hf.recipe_from_training_arguments(d, quantization_config=config, **kw)


@pytest.mark.parametrize("extra,message", [
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "grad_accum_dtype"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast"),
    ({"communication_data_type": "fp32"}, "communication_data_type"),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": False}}}, "single-tensor"),
])
def test_deepspeed_settings_that_change_the_optimizer_are_refused(extra, message):
    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2, **extra}
    with pytest.raises(ValueError, match=message):
        trainmem.hf.recipe_from_deepspeed_config(ds, gpus=2)


def test_deepspeed_torch_adam_is_torchs_adamw():
    def optimizer(params):
        ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": params}}
        return trainmem.hf.recipe_from_deepspeed_config(ds, gpus=2)["optimizer"]
    assert optimizer({}) == "adamw-fused"  # DeepSpeed's FusedAdam
    assert optimizer({"torch_adam": True}) == "adamw"
    assert optimizer({"torch_adam": True, "fused": True}) == "adamw-fused"


def test_accelerates_device_mesh_is_refused():
    d = args().to_dict()
    d["parallelism_config"] = {"dp_shard_size": 4, "cp_size": 2}
    with pytest.raises(ValueError, match="parallelism_config"):
        trainmem.hf.recipe_from_training_arguments(d, gpus=8)


def test_a_deepspeed_qlora_run_maps_onto_zero_over_a_4bit_base():
    # DeepSpeed's bf16 mode over a bf16-loaded base (what was measured: cpu-zero*-*qlora*).
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto"}
    d = args(per_device_train_batch_size=2, optim="adamw_torch").to_dict()
    d["bf16"], d["deepspeed"] = True, ds
    # peft's own checkpoint is the non-reentrant one, like the Trainer's.
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=128, model_dtype="bfloat16", peft=True, gpus=2,
                                                       quantization_config=QLORA, kbit_gradient_checkpointing=True)
    assert knobs["checkpointing"] == "full"
    d["gradient_checkpointing"] = True  # the Trainer's own (non-reentrant) replaces peft's
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=128, model_dtype="bfloat16", peft=True, gpus=2,
                                                       quantization_config=QLORA)
    assert knobs["checkpointing"] == "full"
    assert (knobs["parallel"], knobs["precision"], knobs["load_in_4bit"]) == ("zero3", "bf16-master", True)
    assert "load_dtype" not in knobs  # bf16-master's own parameter dtype is the bf16 load
    assert trainmem.estimate("qwen3-0.6b", lora_rank=8, **knobs).recipe["parallel"] == "zero3"
    # The ZeRO-3 QLoRA recipe stores the packed weights as bf16 (measured: cpu-zero3-*-qsbf16-*).
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=128, model_dtype="bfloat16", peft=True, gpus=2,
                                                       quantization_config={**QLORA, "bnb_4bit_quant_storage": "bfloat16"})
    assert knobs["bnb_4bit_quant_storage"] == "bf16"
    est = trainmem.estimate("qwen3-0.6b", lora_rank=8, **knobs)
    assert est.recipe["bnb_4bit_quant_storage"] == "bf16"
    with pytest.raises(ValueError, match="float32-loaded 4-bit base trained in bf16-master"):
        trainmem.hf.recipe_from_training_arguments(d, model_dtype="float32", peft=True, gpus=2,
                                                   quantization_config=QLORA)


def test_a_lora_config_maps_to_the_adapter_knobs():
    """peft's LoraConfig (or adapter_config.json's dict) gives lora_rank, lora_targets and
    lora_dropout; its scaling holds no memory. Passed as `peft`, it joins the Trainer's knobs."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, use_rslora=True,
                          target_modules=["v_proj", "q_proj", "o_proj"], task_type="CAUSAL_LM")
    knobs = trainmem.hf.recipe_from_lora_config(cfg)
    assert knobs == {"lora_rank": 16, "lora_targets": ["o_proj", "q_proj", "v_proj"], "lora_dropout": 0.05}
    assert trainmem.hf.recipe_from_lora_config(peft.LoraConfig(r=8)) == {"lora_rank": 8, "lora_targets": "default"}
    assert trainmem.hf.recipe_from_lora_config({"peft_type": "LORA", "r": 4, "target_modules": "all-linear",
                                                "bias": "none", "lora_alpha": 8})["lora_targets"] == "all-linear"
    est = trainmem.estimate("qwen3-0.6b", seq=128, batch=1, **knobs)
    assert est.recipe["lora_rank"] == 16
    assert est.recipe["lora_targets"] == ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj"]
    # A peft model under DDP: the Trainer's find_unused_parameters, and the adapters.
    d = args(per_device_train_batch_size=2, gradient_checkpointing=True, optim="adamw_torch").to_dict()
    knobs = trainmem.hf.recipe_from_training_arguments(d, seq=128, gpus=2, peft=cfg)
    assert knobs["ddp_find_unused_parameters"] is True and knobs["lora_rank"] == 16
    assert knobs == {**trainmem.hf.recipe_from_training_arguments(d, seq=128, gpus=2, peft=True),
                     **trainmem.hf.recipe_from_lora_config(cfg)}
    # A peft model's peft_config ({"default": LoraConfig}) is taken as its one adapter; None is no peft.
    assert trainmem.hf.recipe_from_training_arguments(d, seq=128, gpus=2, peft={"default": cfg}) == knobs
    assert "lora_rank" not in trainmem.hf.recipe_from_training_arguments(d, seq=128, peft=None)


@pytest.mark.parametrize("change, named", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"exclude_modules": ["k_proj"]}, "exclude_modules"),
    ({"target_modules": r".*\.q_proj"}, "regular expression"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"inference_mode": True}, "inference_mode"),
    ({"r": 0}, "r"),
    ({"lora_dropout": 1.5}, "lora_dropout"),
])
def test_lora_configs_that_are_not_modelled_are_refused(change, named):
    peft = pytest.importorskip("peft")
    d = peft.LoraConfig(r=8).to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=named):
        trainmem.hf.recipe_from_lora_config(d)
    with pytest.raises(ValueError, match="LoraConfig"):
        trainmem.hf.recipe_from_lora_config(42)


def test_every_trainer_step_clips_the_gradients():
    """transformers 5's Trainer calls clip_grad_norm_ at every optimizer step, also with
    max_grad_norm 0 (to log the norm): the recipe's clip_grad_norm, exact where measured
    (cpu-*-clip-*), except under DeepSpeed (its own clip) and FSDP2 (not modelled)."""
    hf = trainmem.hf.recipe_from_training_arguments
    plain = hf(args(max_grad_norm=0.0), seq=64)
    assert plain["clip_grad_norm"] is True
    est = trainmem.estimate("qwen3-0.6b", **plain)
    assert est.recipe["clip_grad_norm"] is True
    ddp = hf(args(), seq=64, gpus=2)
    assert (ddp["parallel"], ddp["clip_grad_norm"]) == ("ddp", True)
    zero = hf({"deepspeed": {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}}, seq=64,
              gpus=2)
    assert "clip_grad_norm" not in zero
    with pytest.raises(ValueError, match="clip_grad_norm"):
        trainmem.estimate("qwen3-0.6b", seq=64, parallel="zero2", gpus=2, clip_grad_norm=True)


@pytest.mark.parametrize("call, message", [
    (lambda h: h.recipe_from_deepspeed_config({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                                               "data_types": "bf16"}, seq=128, gpus=8), "data_types: expected an object"),
    (lambda h: h.recipe_from_deepspeed_config({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                                               "optimizer": {"type": "AdamW", "params": [1]}}, seq=128, gpus=8),
     "optimizer.params: expected an object"),
    (lambda h: h.recipe_from_training_arguments({"accelerator_config": {"gradient_accumulation_kwargs": [1]}}),
     "gradient_accumulation_kwargs: expected an object"),
    (lambda h: h.recipe_from_training_arguments({"fsdp": 5}, gpus=2), "fsdp: expected True"),
    (lambda h: h.recipe_from_training_arguments({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": None}}, gpus=2),
     "fsdp_version: expected 1 or 2"),
    (lambda h: h.recipe_from_quantization_config(QLORA, precision=["x"]), "not modelled"),
    (lambda h: h.recipe_from_training_arguments({}, seq=float("inf")), "seq: expected a positive integer"),
    (lambda h: h.recipe_from_training_arguments({}, seq=2048.7), "seq: expected a positive integer"),
    (lambda h: h.recipe_from_training_arguments("garbage"), "args: expected a TrainingArguments"),
    (lambda h: h.recipe_from_training_arguments({"bf16": "maybe"}), "bf16='maybe': expected true or false"),
])
def test_malformed_settings_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(trainmem.hf)


def test_settings_spelled_as_strings_read_as_transformers_reads_them(tmp_path):
    knobs = trainmem.hf.recipe_from_training_arguments({"bf16": "false", "gradient_checkpointing": "false"}, seq=128)
    assert knobs["precision"] == "fp32" and knobs["checkpointing"] == "none"
    with pytest.raises(ValueError, match="expected load_in_4bit=True"):
        trainmem.hf.recipe_from_quantization_config({**QLORA, "load_in_4bit": "false"}, precision="bf16-mixed")
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        trainmem.hf.recipe_from_deepspeed_config(str(fifo), gpus=2)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(ValueError, match="nested too deeply"):
        trainmem.hf.recipe_from_deepspeed_config(str(deep), gpus=2)


LIGER_LOSS_ONLY = {"rope": False, "rms_norm": False, "swiglu": False, "geglu": False, "layer_norm": False}


def test_liger_maps_its_fused_loss_and_refuses_its_other_kernels():
    """use_liger_kernel applies Liger's fused linear cross-entropy (the fused loss) and, by default,
    its RoPE, RMSNorm and SwiGLU/GeGLU kernels, which save other tensors than the ops they replace
    and are not modelled: refused unless liger_kernel_config turns them off."""
    hf = trainmem.hf.recipe_from_training_arguments
    with pytest.raises(ValueError, match="Liger's rope, rms_norm, swiglu, geglu, layer_norm kernels"):
        hf({"use_liger_kernel": True}, seq=64)
    with pytest.raises(ValueError, match="Liger's swiglu kernels"):
        hf({"use_liger_kernel": True, "liger_kernel_config": {**LIGER_LOSS_ONLY, "swiglu": True}}, seq=64)
    assert hf({"use_liger_kernel": True, "liger_kernel_config": LIGER_LOSS_ONLY}, seq=64)["loss"] == "fused"
    plain = hf({"use_liger_kernel": True, "liger_kernel_config": {**LIGER_LOSS_ONLY,
                                                                 "fused_linear_cross_entropy": False}}, seq=64)
    assert "loss" not in plain
    with pytest.raises(ValueError, match="cross_entropy: Liger's cross-entropy"):
        hf({"use_liger_kernel": True, "liger_kernel_config": {**LIGER_LOSS_ONLY, "cross_entropy": True,
                                                              "fused_linear_cross_entropy": False}}, seq=64)
