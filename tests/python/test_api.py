"""The Python API returns what the CLI prints."""
import json
import subprocess

import pytest

trainmem = pytest.importorskip("trainmem")


def test_python_matches_cli(trainmem_bin):
    est = trainmem.estimate("llama-3.2-1b", batch=2, seq=512, checkpointing="full")
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "llama-3.2-1b", "--batch", "2", "--seq", "512",
                                     "--checkpointing", "full", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert est.to_dict()["peak_allocated_bytes"] == cli["peak_allocated_bytes"]
    assert est.to_dict() == cli


def test_phases_match_the_cli(run):
    """phases=True is --phases: every phase of every micro-batch, setup first, and a step's peak
    is its highest phase's."""
    est = trainmem.estimate("qwen3-0.6b", seq=256, grad_accum=2, phases=True)
    cli = json.loads(run("estimate", "qwen3-0.6b", "--seq", "256", "--grad-accum", "2", "--phases", "--json").stdout)
    assert est.to_dict() == cli
    assert [(p["step"], p["micro_batch"], p["phase"]) for p in est.phases][:4] == [
        (0, 0, "setup"), (1, 1, "forward"), (1, 1, "loss"), (1, 1, "backward")]
    for s in est.steps:
        assert max(p["peak_allocated_bytes"] for p in est.phases if p["step"] == s["step"]) == s["peak_allocated_bytes"]
    assert "phases" not in trainmem.estimate("qwen3-0.6b", seq=256).to_dict()


def test_an_unset_seq_stays_within_gpt2s_positions(run):
    """Without seq, GPT-2 takes its 1,024 positions (a generation leaves room for new_tokens - 1),
    a rotary model 2048; the CLI and fit do the same. A seq given past them is refused."""
    assert trainmem.estimate("gpt2").recipe["seq"] == 1024
    assert json.loads(run("estimate", "gpt2", "--json").stdout)["recipe"]["seq"] == 1024
    assert trainmem.estimate("gpt2", mode="inference", new_tokens=100).recipe["seq"] == 925
    assert trainmem.estimate("qwen3-0.6b").recipe["seq"] == 2048
    assert "seq 1024," in str(trainmem.fit("gpt2", gpu="t4-16gb", top=1))
    with pytest.raises(ValueError, match="seq: 2048 is past the model's 1024 positions"):
        trainmem.estimate("gpt2", seq=2048)


def test_load_in_8bit_keyword_matches_the_cli(run):
    est = trainmem.estimate("llama-3.2-1b", mode="inference", seq=64, new_tokens=4, load_in_8bit=True)
    cli = json.loads(run("estimate", "llama-3.2-1b", "--inference", "--load-in-8bit", "--seq", "64",
                         "--new-tokens", "4", "--json").stdout)
    assert est.to_dict() == cli and est.recipe["load_in_8bit"] is True
    with pytest.raises(ValueError, match="load_in_8bit: must be True or False"):
        trainmem.estimate("llama-3.2-1b", mode="inference", load_in_8bit="yes")


def test_fit_refuses_no_gpus_and_an_empty_global_batch():
    with pytest.raises(ValueError, match="gpus: must be a positive integer, got 0"):
        trainmem.fit("qwen3-4b", gpus=0)
    with pytest.raises(ValueError, match="global_batch: must be a positive integer, got 0"):
        trainmem.fit("qwen3-4b", global_batch=0)


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        trainmem.estimate("nope")
    with pytest.raises(ValueError, match="batch: must be a positive integer, got 0"):
        trainmem.estimate("gpt2", batch=0)
    with pytest.raises(ValueError, match="precision: unknown value"):
        trainmem.estimate("gpt2", precision="int3")
    with pytest.raises(ValueError, match="seq: must be a positive integer"):
        trainmem.estimate("gpt2", seq=1.5)


@pytest.mark.parametrize("call, message", [
    # The engine's message echoes a path that is not UTF-8: decoded with backslashreplace.
    (lambda: trainmem.estimate(b"/tmp/\xff/config.json"), r"'/tmp/\\xff/config.json': No such file"),
    (lambda: trainmem.fit(b"\xff"), "unknown model"),
    # A NUL would cut the path (or a knob) short where the engine reads it.
    (lambda: trainmem.estimate("gpt2\x00/junk"), "cannot hold a NUL byte"),
    (lambda: trainmem.estimate("gpt2", precision="fp32\x00x"), "precision: .* is not a value trainmem reads"),
    (lambda: trainmem.estimate("gpt2", precision="\udcff"), "precision: .* is not a value trainmem reads"),
    (lambda: trainmem.estimate("gpt2", seq=16, rank=2**63), "rank: must be a rank number"),
    (lambda: trainmem.estimate("gpt2", seq=16, lora_rank=8, lora_dropout=10**400), "lora_dropout: .* too large"),
])
def test_odd_python_values_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_str_is_the_terminal_picture():
    text = str(trainmem.estimate("gpt2", batch=1, seq=128))
    assert "peak allocated" in text and "activations" in text


def test_models_catalog():
    names = {m["name"] for m in trainmem.models()}
    assert {"gpt2", "llama-3.1-70b", "qwen3-4b", "gemma-2-2b", "phi-3-mini-4k-instruct"} <= names


def test_paths_that_are_not_utf8_and_path_objects(tmp_path):
    import os
    import pathlib

    cfg = json.loads(pathlib.Path(__file__).resolve().parents[2].joinpath("data/models/gpt2.json").read_text())
    name = tmp_path / os.fsdecode(b"cfg\xff.json")
    name.write_text(json.dumps(cfg))
    by_str = trainmem.estimate(str(name), seq=64)
    by_path = trainmem.estimate(name, seq=64)
    by_bytes = trainmem.estimate(os.fsencode(name), seq=64)
    assert by_str.peak_allocated_bytes == by_path.peak_allocated_bytes == by_bytes.peak_allocated_bytes
    assert by_str.parameters == 124439808
    with pytest.raises(ValueError, match="model: expected a name or a path"):
        trainmem.estimate(42)


def test_lora_knobs_are_checked():
    with pytest.raises(ValueError, match="lora_dropout: set without lora_rank"):
        trainmem.estimate("gpt2", lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_targets: 'nope' names no linear layer"):
        trainmem.estimate("gpt2", lora_rank=8, lora_targets="nope")
    with pytest.raises(ValueError, match="peft has no default target modules for phi3"):
        trainmem.estimate("phi-3-mini-4k-instruct", lora_rank=8)


def test_qlora_keywords_match_the_cli(run):
    knobs = dict(lora_rank=8, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                 precision="bf16-true", seq=256)
    est = trainmem.estimate("llama-3.2-1b", **knobs)
    cli = json.loads(run("estimate", "llama-3.2-1b", "--lora", "8", "--qlora", "--precision", "bf16-true",
                         "--seq", "256", "--json").stdout)
    assert est.peak_allocated_bytes == cli["peak_allocated_bytes"]
    assert est.recipe["bnb_4bit_quant_type"] == "nf4" and est.recipe["load_in_4bit"] is True
    with pytest.raises(ValueError, match="load_in_4bit: must be True or False"):
        trainmem.estimate("llama-3.2-1b", lora_rank=8, load_in_4bit="yes", precision="bf16-true")
    # QLoRA under autocast: the 4-bit matmuls in autocast's dtype.
    assert trainmem.estimate("llama-3.2-1b", lora_rank=8, load_in_4bit=True,
                             precision="bf16-mixed").recipe["precision"] == "bf16-mixed"
    # Without a precision a 4-bit base runs in bf16-true, its matmuls' dtype.
    assert trainmem.estimate("llama-3.2-1b", lora_rank=8, load_in_4bit=True).recipe["precision"] == "bf16-true"
    # Qwen2's biased q/k/v are quantized too (Note [Quantized linear biases]), no longer refused.
    q25 = trainmem.estimate("qwen2.5-0.5b", lora_rank=8, load_in_4bit=True, precision="bf16-true")
    assert q25.recipe["load_in_4bit"] is True and q25.peak_allocated_bytes > 0


def test_data_parallel_keywords(trainmem_bin):
    est = trainmem.estimate("gpt2", seq=128, gpus=2, parallel="fsdp")
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "gpt2", "--seq", "128", "--gpus", "2", "--parallel",
                                     "fsdp", "--json"], capture_output=True, text=True, check=True).stdout)
    assert est.to_dict() == cli
    assert est.recipe["parallel"] == "fsdp" and est.recipe["gpus"] == 2
    with pytest.raises(ValueError, match="gpus: 2 GPUs need a data-parallel wrapper"):
        trainmem.estimate("gpt2", gpus=2)
    with pytest.raises(ValueError, match="gpus: must be a positive integer"):
        trainmem.estimate("gpt2", gpus=True, parallel="ddp")
    plan = trainmem.fit("gpt2", gpu="rtx-4090", seq=256, gpus=2, global_batch=8, parallel="fsdp", top=2)
    assert plan.gpus == 2 and all(p["recipe"]["parallel"] == "fsdp" for p in plan.plans)


def test_tensor_parallel_keyword(trainmem_bin):
    est = trainmem.estimate("llama-3.2-1b", seq=128, precision="fp32", optimizer="sgd", tp=2)
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "llama-3.2-1b", "--seq", "128", "--precision", "fp32",
                                     "--optimizer", "sgd", "--tp", "2", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert est.to_dict() == cli
    assert est.recipe["tp"] == 2 and "parallel" not in est.recipe
    with pytest.raises(ValueError, match="tp: must be a positive integer"):
        trainmem.estimate("llama-3.2-1b", tp=True)
    with pytest.raises(ValueError, match="tensor parallelism combined with data parallelism"):
        trainmem.estimate("llama-3.2-1b", precision="fp32", tp=2, gpus=2, parallel="ddp")


def test_loss_parallel_keyword(trainmem_bin):
    kw = dict(seq=128, precision="fp32", optimizer="sgd", tp=2)
    est = trainmem.estimate("mistral-7b-v0.3", loss_parallel=True, **kw)
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "mistral-7b-v0.3", "--seq", "128", "--precision", "fp32",
                                     "--optimizer", "sgd", "--tp", "2", "--loss-parallel", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert est.to_dict() == cli and est.recipe["loss_parallel"] is True
    assert "loss_parallel" not in trainmem.estimate("mistral-7b-v0.3", **kw).recipe
    with pytest.raises(ValueError, match="loss_parallel: must be True or False"):
        trainmem.estimate("mistral-7b-v0.3", loss_parallel=1, **kw)
    with pytest.raises(ValueError, match="tied embeddings is not modelled"):
        trainmem.estimate("llama-3.2-1b", loss_parallel=True, **kw)


def test_attention_mask_keyword(run):
    """attention_mask is --attention-mask; padding under SDPA saves a float mask per layer
    (Note [Padding masks]), a mask of ones under SDPA is skipped as none."""
    kw = dict(seq=1024, batch=4)
    padded = trainmem.estimate("llama-3.2-1b", attention_mask="padded", **kw)
    cli = json.loads(run("estimate", "llama-3.2-1b", "--seq", "1024", "--batch", "4", "--attention-mask", "padded",
                         "--json").stdout)
    assert padded.to_dict() == cli and padded.recipe["attention_mask"] == "padded"
    plain = trainmem.estimate("llama-3.2-1b", **kw)
    ones = trainmem.estimate("llama-3.2-1b", attention_mask="ones", **kw)
    assert "attention_mask" not in plain.recipe
    assert ", attention_mask padded" in str(padded) and "attention_mask" not in str(plain)
    # The batch's [4, 1024] int64 mask is all that ones adds at the peak; padding adds 16 layers'
    # bf16 [4, 1, 1024, 1024] masks at least.
    assert ones.peak_allocated_bytes - plain.peak_allocated_bytes <= 4 * 1024 * 8
    assert padded.peak_allocated_bytes - plain.peak_allocated_bytes >= 16 * 4 * 1024 * 1024 * 2
    with pytest.raises(ValueError, match="attention_mask: unknown value 'left'"):
        trainmem.estimate("llama-3.2-1b", attention_mask="left")
    with pytest.raises(ValueError, match="attention_mask: padded with attention flash is not modelled"):
        trainmem.estimate("llama-3.2-1b", attention_mask="padded", attention="flash")


def test_pipeline_keywords(trainmem_bin):
    kw = dict(seq=256, precision="bf16-true", optimizer="sgd", grad_accum=4, pp=2)
    est = trainmem.estimate("mistral-7b-v0.3", **kw)
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "mistral-7b-v0.3", "--seq", "256", "--precision",
                                     "bf16-true", "--optimizer", "sgd", "--grad-accum", "4", "--pp", "2", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert est.to_dict() == cli
    assert est.recipe["pp"] == 2 and est.recipe["pp_schedule"] == "1f1b"
    gpipe = trainmem.estimate("mistral-7b-v0.3", **kw, pp_schedule="gpipe")
    assert gpipe.recipe["pp_schedule"] == "gpipe"
    inter = trainmem.estimate("mistral-7b-v0.3", **kw, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2)
    assert inter.recipe["pp_stages_per_rank"] == 2 and [r["rank"] for r in inter.ranks] == [0, 1]
    with pytest.raises(ValueError, match="pp_stages_per_rank: 2 needs a multi-stage schedule"):
        trainmem.estimate("mistral-7b-v0.3", **kw, pp_stages_per_rank=2)
    with pytest.raises(ValueError, match="pp: must be a positive integer"):
        trainmem.estimate("mistral-7b-v0.3", pp=True)
    with pytest.raises(ValueError, match="ties lm_head to the embedding"):
        trainmem.estimate("llama-3.2-1b", precision="fp32", grad_accum=2, pp=2)
    # PP x DP: gpus is the data-parallel degree; the ranks are stage x gpus + dp rank, each stage
    # replayed once; the same object as the CLI's.
    dp = trainmem.estimate("mistral-7b-v0.3", **kw, gpus=2, parallel="ddp")
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "mistral-7b-v0.3", "--seq", "256", "--precision",
                                     "bf16-true", "--optimizer", "sgd", "--grad-accum", "4", "--pp", "2", "--gpus", "2",
                                     "--parallel", "ddp", "--json"], capture_output=True, text=True, check=True).stdout)
    assert dp.to_dict() == cli
    assert [r["rank"] for r in dp.ranks] == [0, 2] and dp.peak_allocated_bytes > est.peak_allocated_bytes
    assert trainmem.estimate("mistral-7b-v0.3", **kw, gpus=2, parallel="ddp", rank=3).rank == 3
    with pytest.raises(ValueError, match="other than DDP or FSDP2 is not modelled"):
        trainmem.estimate("mistral-7b-v0.3", **kw, gpus=2, parallel="zero2")
    # PP x FSDP2: each stage sharded over its replicas (Note [Pipeline with FSDP2]); only FSDP2's defaults.
    fsdp = trainmem.estimate("mistral-7b-v0.3", **kw, gpus=2, parallel="fsdp")
    assert [r["rank"] for r in fsdp.ranks] == [0, 2] and fsdp.peak_allocated_bytes < dp.peak_allocated_bytes
    with pytest.raises(ValueError, match="with parallel fsdp and gpus 1"):
        trainmem.estimate("mistral-7b-v0.3", **kw, parallel="fsdp")
    # PP x TP (Note [Pipeline with tensor parallelism]): the ranks are the stages; also under FSDP2.
    tp = trainmem.estimate("mistral-7b-v0.3", **kw, tp=2, sequence_parallel=True)
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "mistral-7b-v0.3", "--seq", "256", "--precision",
                                     "bf16-true", "--optimizer", "sgd", "--grad-accum", "4", "--pp", "2", "--tp", "2",
                                     "--sequence-parallel", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert tp.to_dict() == cli and tp.recipe["tp"] == 2 and [r["rank"] for r in tp.ranks] == [0, 1]
    assert tp.peak_allocated_bytes < est.peak_allocated_bytes
    tpdp = trainmem.estimate("mistral-7b-v0.3", **kw, tp=2, gpus=2, parallel="fsdp")
    assert [r["rank"] for r in tpdp.ranks] == [0, 2]
    # ... and with loss parallelism: the last stage holds vocab / tp rows of lm_head.
    lp = trainmem.estimate("mistral-7b-v0.3", **kw, tp=2, sequence_parallel=True, loss_parallel=True, rank=1)
    assert tp.ranks[1]["peak_allocated_bytes"] > lp.peak_allocated_bytes
    with pytest.raises(ValueError, match="not modelled with tensor parallelism"):
        trainmem.estimate("mistral-7b-v0.3", **kw, tp=2, gpus=4, parallel="fsdp", fsdp_replicate=2)


def test_fsdp_variant_keywords(trainmem_bin):
    kw = dict(seq=128, gpus=4, parallel="fsdp", precision="fp32", fsdp_reshard_after_forward=False,
              fsdp_replicate=2, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    est = trainmem.estimate("gpt2", **kw)
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "gpt2", "--seq", "128", "--gpus", "4", "--parallel",
                                     "fsdp", "--precision", "fp32", "--fsdp-reshard-after-forward", "false",
                                     "--fsdp-replicate", "2", "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype",
                                     "fp32", "--json"], capture_output=True, text=True, check=True).stdout)
    assert est.to_dict() == cli
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward: must be True or False"):
        trainmem.estimate("gpt2", gpus=2, parallel="fsdp", fsdp_reshard_after_forward="no")
    with pytest.raises(ValueError, match="fsdp_replicate: must be a positive integer"):
        trainmem.estimate("gpt2", gpus=2, parallel="fsdp", fsdp_replicate=0)


def test_zero_through_python_matches_cli(trainmem_bin):
    est = trainmem.estimate("gpt2", seq=64, precision="bf16-master", gpus=4, parallel="zero2")
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "gpt2", "--seq", "64", "--precision", "bf16-master",
                                     "--gpus", "4", "--parallel", "zero2", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert est.to_dict() == cli
    assert cli["recipe"]["parallel"] == "zero2" and cli["recipe"]["gpus"] == 4
    # The worst of the 4 ranks, each replayed; rank= shows one of them.
    assert [r["rank"] for r in est.ranks] == [0, 1, 2, 3]
    worst = max(est.ranks, key=lambda r: (r["peak_reserved_bytes"], r["peak_allocated_bytes"], -r["rank"]))
    assert est.rank == worst["rank"] and est.peak_reserved_bytes == worst["peak_reserved_bytes"]
    one = trainmem.estimate("gpt2", seq=64, precision="bf16-master", gpus=4, parallel="zero2", rank=3)
    assert one.rank == 3 and one.peak_allocated_bytes == est.ranks[3]["peak_allocated_bytes"]
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        trainmem.estimate("gpt2", seq=64, precision="bf16-master", gpus=4, parallel="zero2", rank=4)
    with pytest.raises(ValueError, match="rank: must be a rank number"):
        trainmem.estimate("gpt2", gpus=4, parallel="ddp", rank=-1)
    assert "rank" not in trainmem.estimate("gpt2", seq=64).to_dict()
    with pytest.raises(ValueError, match="precision: bf16-mixed under parallel zero3 is not modelled"):
        trainmem.estimate("gpt2", gpus=2, parallel="zero3", precision="bf16-mixed")
    # Without a precision, ZeRO runs DeepSpeed's bf16 mode.
    assert trainmem.estimate("gpt2", seq=64, gpus=2, parallel="zero3").recipe["precision"] == "bf16-master"
    with pytest.raises(ValueError, match="precision: bf16-mixed under parallel zero1 is not modelled"):
        trainmem.estimate("gpt2", gpus=2, parallel="zero1", precision="bf16-mixed")


def test_ddp_gradient_as_bucket_view(trainmem_bin):
    """The Python knob is the CLI's flag: the same object, the .grads views of the buckets, so a
    rank holds its gradients once (the optimizer's peak of a two-micro-batch fp32 AdamW step), and
    it stays a DDP knob."""
    kw = dict(seq=256, precision="fp32", grad_accum=2, gpus=2, parallel="ddp", gpu="h100-80gb")
    plain = trainmem.estimate("qwen3-0.6b", **kw)
    view = trainmem.estimate("qwen3-0.6b", **kw, ddp_gradient_as_bucket_view=True)
    assert view.recipe["ddp_gradient_as_bucket_view"] is True and "ddp_gradient_as_bucket_view" not in plain.recipe
    assert view.breakdown_at_peak["gradients"] < plain.breakdown_at_peak["gradients"]
    assert view.peak_allocated_bytes < plain.peak_allocated_bytes
    cli = json.loads(subprocess.run([trainmem_bin, "estimate", "qwen3-0.6b", "--seq", "256", "--precision", "fp32",
                                     "--grad-accum", "2", "--gpus", "2", "--parallel", "ddp",
                                     "--ddp-gradient-as-bucket-view", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert view.to_dict() == cli
    with pytest.raises(ValueError, match="needs parallel ddp"):
        trainmem.estimate("qwen3-0.6b", gpus=2, parallel="fsdp", ddp_gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match="must be True or False"):
        trainmem.estimate("qwen3-0.6b", gpus=2, parallel="ddp", ddp_gradient_as_bucket_view="yes")
