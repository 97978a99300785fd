"""The trainmem command as a user drives it: output shape, JSON contract, bad input."""
import json

import pytest

CATEGORIES = ["weights", "optimizer_states", "gradients", "activations", "temporaries", "other"]


def test_estimate_json_contract(run):
    r = run("estimate", "qwen3-0.6b", "--batch", "2", "--seq", "256", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    j = json.loads(r.stdout)
    for key in ("parameters", "peak_allocated_bytes", "peak_reserved_bytes", "breakdown_at_peak",
                "peak", "recipe", "steps", "device", "source"):
        assert key in j
    assert list(j["breakdown_at_peak"]) == CATEGORIES
    assert sum(j["breakdown_at_peak"].values()) == j["peak_allocated_bytes"]
    assert j["peak_reserved_bytes"] >= j["peak_allocated_bytes"]
    assert j["parameters"] == 596049920
    assert set(j["peak"]) == {"step", "micro_batch", "phase", "op"}
    assert j["recipe"] == {"batch": 2, "seq": 256, "grad_accum": 1, "precision": "bf16-mixed",
                           "optimizer": "adamw", "checkpointing": "none", "attention": "sdpa",
                           "loss": "standard", "gpu": "h100-80gb", "allocator": "default",
                           "lora_rank": 0, "mode": "training", "steps": 2}
    assert [s["step"] for s in j["steps"]] == [1, 2]


def test_text_output_names_every_category_and_the_peak_op(run):
    r = run("estimate", "llama-3.2-1b", "--batch", "4", "--seq", "1024")
    assert r.returncode == 0, r.stderr
    for c in CATEGORIES:
        assert c in r.stdout
    assert "peak allocated" in r.stdout and "peak reserved" in r.stdout
    assert "peak at         step" in r.stdout


@pytest.mark.parametrize("model,header", [("llama-3.2-1b", "llama-3.2-1b — 1.24 B parameters"),
                                          ("gpt2", "gpt2 — 124.44 M parameters")])
def test_text_header_counts_parameters_in_a_readable_unit(run, model, header):
    r = run("estimate", model)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == header


def test_text_header_names_the_allocator_and_wrapper_settings_that_are_not_defaults(run):
    r = run("estimate", "llama-3.2-1b", "--gpus", "8", "--parallel", "fsdp", "--fsdp-replicate", "2",
            "--fsdp-reshard-after-forward", "false", "--precision", "fp32", "--fsdp-param-dtype", "bf16",
            "--fsdp-reduce-dtype", "fp32", "--allocator", "expandable")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].endswith(", expandable segments")
    assert lines[2] == ("fsdp: HSDP over 2 replica groups of 4, reshard_after_forward=False, "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    plain = run("estimate", "llama-3.2-1b", "--gpus", "8", "--parallel", "fsdp").stdout.splitlines()
    assert not plain[1].endswith("segments") and plain[2].startswith("data parallel: fsdp")
    ddp = run("estimate", "gpt2", "--gpus", "2", "--parallel", "ddp", "--ddp-gradient-as-bucket-view").stdout
    assert ddp.splitlines()[2] == "ddp: gradient_as_bucket_view=True"


def test_exit_code_says_whether_it_fits(run):
    big = run("estimate", "llama-3.1-70b", "--json", "--exit-code")
    assert big.returncode == 1 and json.loads(big.stdout)["fits"] is False
    small = run("estimate", "gpt2", "--json", "--exit-code")
    assert small.returncode == 0 and json.loads(small.stdout)["fits"] is True
    assert run("estimate", "llama-3.1-70b").returncode == 0  # without the flag, printing is success
    assert "fits" not in json.loads(run("estimate", "gpt2", "--gpu", "cpu", "--json").stdout)
    assert run("fit", "llama-3.1-70b", "--gpu", "rtx-4090", "--exit-code").returncode == 1
    assert run("fit", "gpt2", "--seq", "512", "--exit-code").returncode == 0
    assert run("estimate", "gpt2", "--batch", "0", "--exit-code").returncode == 2


def test_gemma2_runs_eager_attention_and_refuses_flash(run):
    # transformers has no SDPA for Gemma-2 (eager by default); flash_attention_2 is not modelled.
    default = json.loads(run("estimate", "gemma-2-2b", "--seq", "512", "--json").stdout)
    eager = json.loads(run("estimate", "gemma-2-2b", "--seq", "512", "--attention", "eager", "--json").stdout)
    assert default["recipe"]["attention"] == "eager" and default == eager
    r = run("estimate", "gemma-2-2b", "--attention", "flash")
    assert r.returncode == 2 and r.stdout == "" and "flash (flash_attention_2) for Gemma-2 is not modelled" in r.stderr
    fit = json.loads(run("fit", "gemma-2-2b", "--seq", "512", "--json").stdout)
    assert fit["changes"] and not [c for c in fit["changes"] if c["change"].startswith("attention")]


def test_hf_id_and_catalog_name_agree(run):
    a = json.loads(run("estimate", "Qwen/Qwen3-4B", "--json").stdout)
    b = json.loads(run("estimate", "qwen3-4b", "--json").stdout)
    a.pop("model"), b.pop("model")
    assert a == b


def test_config_path_and_model_directory(run, tmp_path):
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "data" / "models" / "qwen3-0.6b.json"
    cfg = tmp_path / "config.json"
    cfg.write_text(src.read_text())
    by_path = json.loads(run("estimate", cfg, "--json").stdout)
    by_dir = json.loads(run("estimate", tmp_path, "--json").stdout)
    by_name = json.loads(run("estimate", "qwen3-0.6b", "--json").stdout)
    assert by_path["peak_allocated_bytes"] == by_name["peak_allocated_bytes"]
    assert by_dir["peak_allocated_bytes"] == by_name["peak_allocated_bytes"]


def test_models_and_gpus_list(run):
    models = json.loads(run("models", "--json").stdout)
    assert len(models) >= 15
    assert {"name": "llama-3.1-8b", "hf_id": "meta-llama/Llama-3.1-8B", "family": "llama",
            "parameters": 8030261248} in models
    gpus = json.loads(run("gpus", "--json").stdout)
    assert any(g["name"] == "h100-80gb" for g in gpus)


def test_deterministic(run):
    a = run("estimate", "gpt2", "--batch", "8", "--seq", "1024", "--json").stdout
    b = run("estimate", "gpt2", "--batch", "8", "--seq", "1024", "--json").stdout
    assert a == b


def test_zero_estimate_is_one_rank_and_keeps_its_recipe(run):
    # ZeRO-2 shards gradients and optimizer states: more ranks, less per rank; the JSON recipe
    # carries gpus and parallel as trainmem-measure writes them (so compare re-estimates it).
    peaks = []
    for gpus in ("2", "4"):
        out = json.loads(run("estimate", "gpt2", "--seq", "64", "--precision", "bf16-master", "--gpus", gpus,
                             "--parallel", "zero2", "--json").stdout)
        assert out["recipe"]["parallel"] == "zero2" and out["recipe"]["gpus"] == int(gpus)
        peaks.append(out["peak_allocated_bytes"])
    assert peaks[1] < peaks[0]


def test_tensor_parallel_estimate_is_one_rank_and_keeps_its_recipe(run):
    # --tp 2 halves the projections of every decoder layer on a rank (their weights, gradients and
    # optimizer states); the JSON recipe carries tp as trainmem-measure writes it, and no gpus /
    # parallel keys (no data parallelism).
    base = ["estimate", "llama-3.2-1b", "--seq", "256", "--precision", "fp32", "--optimizer", "sgd", "--json"]
    one = json.loads(run(*base).stdout)
    two = json.loads(run(*base, "--tp", "2").stdout)
    assert two["recipe"]["tp"] == 2 and "tp" not in one["recipe"]
    assert "gpus" not in two["recipe"] and "parallel" not in two["recipe"]
    assert two["parameters"] == one["parameters"]
    assert two["peak_allocated_bytes"] < one["peak_allocated_bytes"]
    # Llama-3.2-1B's projections: 16 layers x (q 2048x2048, k and v 512x2048, o 2048x2048, gate,
    # up and down 8192x2048) = 973,078,528 fp32 elements, half of them on a rank; the embedding
    # (tied to lm_head) and the norms are whole.
    w1, w2 = one["breakdown_at_peak"]["weights"], two["breakdown_at_peak"]["weights"]
    assert w1 - w2 == 973_078_528 // 2 * 4
    # --sequence-parallel: the same weights, the norms and the residual stream on half the sequence
    # (the activations the layers keep for backward shrink), and the knob in the JSON recipe.
    sp = json.loads(run(*base, "--tp", "2", "--sequence-parallel").stdout)
    assert sp["recipe"]["sequence_parallel"] is True and "sequence_parallel" not in two["recipe"]
    assert sp["breakdown_at_peak"]["weights"] == w2


def test_loss_parallel_shards_lm_head_by_vocabulary(run):
    # --loss-parallel (Note [Loss parallel]): Mistral-7B's untied lm_head (32,768 x 4,096) is
    # Shard(0) over the 2 ranks, so a rank holds half of it, and the logits are vocab / 2 wide: the
    # peak drops; the knob is in the JSON recipe only when on.
    base = ["estimate", "mistral-7b-v0.3", "--seq", "256", "--precision", "fp32", "--optimizer", "sgd", "--tp", "2",
            "--json"]
    tp = json.loads(run(*base).stdout)
    lp = json.loads(run(*base, "--loss-parallel").stdout)
    assert lp["recipe"]["loss_parallel"] is True and "loss_parallel" not in tp["recipe"]
    assert tp["breakdown_at_peak"]["weights"] - lp["breakdown_at_peak"]["weights"] == 32_768 * 4_096 // 2 * 4
    assert lp["peak_allocated_bytes"] < tp["peak_allocated_bytes"]
    assert lp["parameters"] == tp["parameters"]
    sp = json.loads(run(*base, "--loss-parallel", "--sequence-parallel").stdout)
    assert sp["recipe"]["loss_parallel"] is True and sp["recipe"]["sequence_parallel"] is True


def test_context_parallel_estimate_is_one_rank_of_seq_over_cp_tokens(run):
    # --cp 2: a rank runs seq / 2 tokens with the whole model (weights unchanged) plus the ring's
    # buffers, so its peak lies between the one-GPU peaks at seq / 2 and at seq; the JSON recipe
    # carries cp only when it is more than 1.
    base = ["estimate", "llama-3.2-1b", "--precision", "bf16-true", "--optimizer", "sgd", "--json"]
    full = json.loads(run(*base, "--seq", "4096").stdout)
    half = json.loads(run(*base, "--seq", "2048").stdout)
    cp = json.loads(run(*base, "--seq", "4096", "--cp", "2").stdout)
    assert cp["recipe"]["cp"] == 2 and cp["recipe"]["seq"] == 4096 and "cp" not in full["recipe"]
    assert cp["breakdown_at_peak"]["weights"] == full["breakdown_at_peak"]["weights"]
    assert half["peak_allocated_bytes"] < cp["peak_allocated_bytes"] < full["peak_allocated_bytes"]


def test_pipeline_estimate_is_the_worst_stage_and_keeps_its_recipe(run):
    # --pp 2 over Mistral-7B (32 layers, untied): each stage holds 16 layers, stage 0 the embedding
    # and stage 1 the norm and lm_head; under 1F1B stage 0 keeps two micro-batches in flight. The
    # estimate is the worst stage, every stage under `ranks`; --rank names one.
    base = ["estimate", "mistral-7b-v0.3", "--seq", "1024", "--precision", "bf16-true", "--optimizer", "sgd",
            "--grad-accum", "4", "--json"]
    one = json.loads(run(*base).stdout)
    two = json.loads(run(*base, "--pp", "2").stdout)
    assert two["recipe"]["pp"] == 2 and two["recipe"]["pp_schedule"] == "1f1b" and "pp" not in one["recipe"]
    assert "gpus" not in two["recipe"] and "tp" not in two["recipe"]
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    assert two["peak_allocated_bytes"] == max(r["peak_allocated_bytes"] for r in two["ranks"])
    assert two["peak_allocated_bytes"] < one["peak_allocated_bytes"]
    stage0 = json.loads(run(*base, "--pp", "2", "--rank", "0").stdout)
    stage1 = json.loads(run(*base, "--pp", "2", "--rank", "1").stdout)
    assert stage0["peak_allocated_bytes"] == two["ranks"][0]["peak_allocated_bytes"]
    # Half the layers each; the embedding and lm_head (32768 x 4096 each) and the norm differ.
    w0, w1 = stage0["breakdown_at_peak"]["weights"], stage1["breakdown_at_peak"]["weights"]
    assert w1 - w0 == 4096 * 2
    gpipe = json.loads(run(*base, "--pp", "2", "--pp-schedule", "gpipe").stdout)
    assert gpipe["ranks"][0]["peak_allocated_bytes"] > stage0["peak_allocated_bytes"]  # all 4 in flight


def test_interleaved_pipeline_holds_every_stage_of_the_rank(run):
    # --pp 2 --pp-stages-per-rank 2 over Mistral-7B (32 layers): 4 stages of 8 layers, rank 0
    # holding stages 0 and 2 (the embedding), rank 1 stages 1 and 3 (the norm and lm_head): the
    # weights of the one-stage split (16 layers a rank), more micro-batches in flight on rank 0
    # (Note [Interleaved pipeline schedules]).
    base = ["estimate", "mistral-7b-v0.3", "--seq", "1024", "--precision", "bf16-true", "--optimizer", "sgd",
            "--grad-accum", "4", "--pp", "2", "--json"]
    one = json.loads(run(*base).stdout)
    inter = json.loads(run(*base, "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2").stdout)
    assert inter["recipe"]["pp_schedule"] == "interleaved-1f1b" and inter["recipe"]["pp_stages_per_rank"] == 2
    assert "pp_stages_per_rank" not in one["recipe"]
    assert [r["rank"] for r in inter["ranks"]] == [0, 1]
    for rank in ("0", "1"):
        a = json.loads(run(*base, "--rank", rank).stdout)
        b = json.loads(run(*base, "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2", "--rank",
                           rank).stdout)
        assert a["breakdown_at_peak"]["weights"] == b["breakdown_at_peak"]["weights"]
    # LoopedBFS runs all 8 of rank 0's forwards first: more activations at its peak, which comes in
    # stage 2's backwards, before stage 0 has made its gradients.
    bfs = json.loads(run(*base, "--pp-schedule", "looped-bfs", "--pp-stages-per-rank", "2", "--rank", "0").stdout)
    inter0 = json.loads(run(*base, "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2", "--rank",
                            "0").stdout)
    assert bfs["breakdown_at_peak"]["activations"] > inter0["breakdown_at_peak"]["activations"]
    assert bfs["breakdown_at_peak"]["gradients"] < inter0["breakdown_at_peak"]["gradients"]
    text = run(*base[:-1], "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2", "--rank", "1").stdout
    assert "interleaved-1f1b over 4 stages (2 per GPU on 2 GPUs)" in text and "rank 1 (stages 1 and 3)" in text
    # With two FSDP2 replicas of every stage the ranks are pipeline rank x 2 + dp rank: rank 3 is
    # pipeline rank 1's second replica, holding stages 1 and 3 (Note [Interleaved pipeline schedules
    # with FSDP2]). Its weights at the peak are not below the unsharded rank's: the schedule's
    # UNSHARD gathers both stages' units before the first action, so beside the half shards every
    # parameter is whole (and some all-gather buffers wait).
    dp = ("--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2", "--gpus", "2", "--parallel", "fsdp",
          "--rank", "3")
    text = run(*base[:-1], *dp).stdout
    assert ("interleaved-1f1b over 4 stages (2 per GPU on 2 GPUs) x data parallel fsdp over 2 replicas (4 GPUs)"
            in text and "rank 3 (stages 1 and 3)" in text), text
    sharded = json.loads(run(*base, *dp).stdout)
    plain = b["breakdown_at_peak"]["weights"]
    assert 1.5 * plain <= sharded["breakdown_at_peak"]["weights"] < 2 * plain


def test_pipeline_with_tensor_parallelism_replays_each_stage_once(run):
    # --pp 2 --tp 2: four GPUs, a (pp, tp) mesh; a stage's tp ranks hold the same (Note [Pipeline
    # with tensor parallelism]), so the ranks of the estimate are the stages. Each stage holds half
    # of its layers' projections: 16 layers of Mistral-7B's q/k/v/o (4096 x (4096 + 1024 + 1024 +
    # 4096)) and gate/up/down (3 x 4096 x 14336), bf16.
    base = ["estimate", "mistral-7b-v0.3", "--seq", "1024", "--precision", "bf16-true", "--optimizer", "sgd",
            "--grad-accum", "4", "--pp", "2"]
    alone = json.loads(run(*base, "--rank", "0", "--json").stdout)
    tp = json.loads(run(*base, "--tp", "2", "--json").stdout)
    assert (tp["recipe"]["pp"], tp["recipe"]["tp"]) == (2, 2) and [r["rank"] for r in tp["ranks"]] == [0, 1]
    stage0 = json.loads(run(*base, "--tp", "2", "--rank", "0", "--json").stdout)
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    assert alone["breakdown_at_peak"]["weights"] - stage0["breakdown_at_peak"]["weights"] == 16 * layer * 2 // 2
    text = run(*base, "--tp", "2").stdout
    assert "1f1b over 2 stages x tensor parallel 2 (4 GPUs), 4 micro-batches" in text and "rank 0 (stage 0)" in text


def test_text_names_the_parallel_layout(run):
    # Every parallel recipe says under the recipe line how the GPUs are used and whose figures
    # follow; tensor and context parallelism alone once printed nothing there.
    def layout(*args):
        return run("estimate", "llama-3.2-1b", "--seq", "1024", *args).stdout.splitlines()[2]

    assert layout("--tp", "2", "--sequence-parallel").startswith(
        "tensor parallel: one group of 2 GPUs with sequence parallel; the figures below are one GPU's, rank 0")
    assert layout("--cp", "2", "--precision", "bf16-true").startswith(
        "context parallel: a ring of 2 GPUs, the sequence sharded over them; the figures below are one GPU's, the last rank of the ring")
    assert layout("--tp", "2", "--gpus", "2", "--parallel", "fsdp").startswith(
        "data parallel: fsdp over 2 GPUs x tensor parallel 2 (4 GPUs)")
    assert layout().startswith("gpu: ")  # one GPU: no layout line


def test_pipeline_with_ddp_replays_each_stage_once(run):
    # --pp 2 --gpus 2 --parallel ddp: four GPUs, rank = stage x 2 + dp rank (Note [Pipeline with DDP]).
    # Each stage is replayed once (its dp rank 0), and it holds the Reducer's buckets besides its
    # .grads: one more stage's worth of gradient bytes at a backward peak.
    base = ["estimate", "mistral-7b-v0.3", "--seq", "1024", "--precision", "bf16-true", "--optimizer", "sgd",
            "--grad-accum", "4", "--pp", "2"]
    alone = json.loads(run(*base, "--json").stdout)
    dp = json.loads(run(*base, "--gpus", "2", "--parallel", "ddp", "--json").stdout)
    assert (dp["recipe"]["pp"], dp["recipe"]["gpus"], dp["recipe"]["parallel"]) == (2, 2, "ddp")
    assert [r["rank"] for r in dp["ranks"]] == [0, 2]
    assert dp["peak_allocated_bytes"] > alone["peak_allocated_bytes"]
    three = json.loads(run(*base, "--gpus", "2", "--parallel", "ddp", "--rank", "3", "--json").stdout)
    assert three["rank"] == 3 and three["peak_allocated_bytes"] == dp["ranks"][1]["peak_allocated_bytes"]
    text = run(*base, "--gpus", "2", "--parallel", "ddp", "--rank", "3").stdout
    assert "2 stages x data parallel ddp over 2 replicas (4 GPUs)" in text and "rank 3 (stage 1)" in text


@pytest.mark.parametrize("args, message", [
    (["estimate", "qwen3-4", "--json"], "unknown model 'qwen3-4'; did you mean: qwen3-4b"),
    (["estimate", "./no-such-model/config.json"], "model: './no-such-model/config.json': No such file or directory"),
    (["fit", "qwen3-4b", "--gpus", "0"], "gpus: must be between 1 and 4096, got 0"),
    (["fit", "qwen3-4b", "--global-batch", "0"], "global_batch: must be at least 1 sequence per optimizer step"),
    (["estimate", "qwen3-4b", "--new-tokens", "10"], "new_tokens: the tokens a generation adds, an inference knob"),
    (["estimate", "qwen3-4b", "--inference", "--optimizer", "sgd"], "optimizer: inference runs no optimizer"),
    (["estimate", "qwen3-4b", "--inference", "--loss", "fused"], "loss: inference computes no loss"),
    (["estimate", "qwen3-4b", "--lora-targets", "all-linear"], "lora_targets: set without lora_rank"),
    (["estimate", "qwen3-4b", "--lora", "8", "--qlora", "--bnb-4bit-quant-type", "fp4"],
     "--qlora is an nf4 base with double quant"),
    (["estimate", "qwen3-4b", "--timeline"], "timeline: the timeline is part of the JSON output; add --json"),
    (["estimate", "qwen3-4b", "--phases"], "phases: the phase peaks are part of the JSON output; add --json"),
    # refused for what it is, not for the micro-batches a pipeline of 2 would need
    (["fit", "qwen3-8b", "--gpus", "2", "--pp", "2"], "pp: fit searches pipeline parallelism itself"),
    (["estimate", "qwen3-4b", "--lora", "-4"], "lora_rank: must be a whole number (0 or more), got '-4'"),
    (["estimate", "qwen3-4b", "--lora", "100000"], "lora_rank: must be between 0 (no adapters) and 65536"),
    (["estimate", "qwen3-4b", "--batch", "0"], "batch: must be between 1 and"),
    (["estimate", "qwen3-4b", "--batch", "-3"], "batch: must be a positive integer, got '-3'"),
    (["estimate", "qwen3-4b", "--seq", "4k"], "seq: must be a positive integer, got '4k'"),
    (["estimate", "qwen3-4b", "--seq", "99999999999999999999999"], "seq: must be a positive integer"),
    (["estimate", "qwen3-4b", "--precision", "bf32"], "precision: unknown value 'bf32'; expected one of fp32, bf16-mixed"),
    (["estimate", "qwen3-4b", "--optimizer", "lion"], "optimizer: unknown value 'lion'"),
    (["estimate", "qwen3-4b", "--gpu", "h100"], "gpu: unknown GPU 'h100'; known: h100-80gb"),
    (["estimate", "qwen3-4b", "--seq", "16777216", "--batch", "16777216"], "overflows a 64-bit byte count"),
    (["estimate"], "model is required"),
    (["frobnicate"], "frobnicate"),
    (["estimate", "gpt2", "--gpus", "2", "--parallel", "zero3", "--precision", "bf16-mixed"],
     "precision: bf16-mixed under parallel zero3 is not modelled"),
    (["estimate", "gpt2", "--gpus", "2", "--zero", "4"], "zero: '4' is not a ZeRO stage; expected 1, 2 or 3"),
    (["estimate", "gpt2", "--gpus", "2", "--zero", "3", "--parallel", "zero2"],
     "zero: --zero 3 and --parallel zero2 disagree; give one of them"),
    (["estimate", "gpt2", "--gpus", "2", "--parallel", "zero2", "--precision", "bf16-mixed"],
     "precision: bf16-mixed under parallel zero2 is not modelled"),
    (["estimate", "gpt2", "--gpus", "2", "--parallel", "zero1", "--precision", "fp32", "--optimizer", "adafactor"],
     "optimizer: adafactor under parallel zero1 is not modelled"),
    (["estimate", "gpt2", "--tp", "2", "--precision", "fp32"], "GPT-2's c_attn and Phi-3's qkv_proj"),
    (["estimate", "gpt2", "--lora", "8", "--qlora", "--no-prepare-kbit-training"],
     "prepare_kbit_training: false keeps the weights of a half-loaded 4-bit base"),
    (["estimate", "gpt2", "--load-dtype", "fp16"], "GradScaler refuses fp16 gradients"),
    (["estimate", "llama-3.2-1b", "--tp", "3", "--precision", "fp32"],
     "num_attention_heads = 32 is not divisible by the tensor-parallel degree"),
    (["estimate", "llama-3.2-1b", "--tp", "2", "--gpus", "2", "--parallel", "ddp", "--precision", "fp32"],
     "tensor parallelism combined with data parallelism is modelled under parallel fsdp only"),
    (["estimate", "llama-3.2-1b", "--tp", "2", "--gpus", "2", "--parallel", "fsdp", "--precision", "fp16-true",
      "--sequence-parallel"], "with precision fp16-true is not modelled (unmeasured); use fp32, bf16-mixed or bf16-true"),
    (["estimate", "llama-3.2-1b", "--tp", "2", "--precision", "fp32", "--lora", "8"], "with LoRA or a 4-bit base"),
    (["estimate", "llama-3.2-1b", "--tp", "0"], "tp: must be between 1 and 64"),
    (["fit", "llama-3.2-1b", "--tp", "2", "--precision", "fp32"], "tp: 2 does not divide gpus 1: the planner splits the GPUs into tensor-parallel groups"),
    (["estimate", "llama-3.2-1b", "--sequence-parallel", "--precision", "fp32"],
     "sequence_parallel: needs tensor parallelism"),
    (["estimate", "llama-3.2-1b", "--tp", "2", "--sequence-parallel", "--seq", "127", "--precision", "fp32"],
     "sequence_parallel: seq 127 is not a multiple of tp: 2"),
    (["estimate", "mistral-7b-v0.3", "--loss-parallel", "--precision", "fp32"],
     "loss_parallel: needs tensor parallelism"),
    (["estimate", "llama-3.2-1b", "--tp", "2", "--loss-parallel", "--precision", "fp32"],
     "loss_parallel: llama with tied embeddings is not modelled"),
    (["estimate", "mistral-7b-v0.3", "--tp", "2", "--loss-parallel", "--loss", "fused", "--precision", "fp32"],
     "tp: 2 with loss fused is not modelled"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--precision", "fp32", "--seq", "1002"],
     "cp: 2: seq 1002 is not divisible by 2 * cp = 4"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--precision", "fp32", "--attention", "eager"],
     "context_parallel replaces torch's scaled_dot_product_attention only"),
    (["estimate", "gpt2", "--cp", "2", "--precision", "fp32"], "cp: 2 with gpt2 is not modelled"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--gpus", "2", "--parallel", "ddp", "--precision", "fp32"],
     "context parallelism with data parallelism is modelled under FSDP2"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--gpus", "4", "--parallel", "fsdp", "--fsdp-replicate", "2",
      "--precision", "fp32"], "HSDP with context parallelism is not modelled"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--tp", "2", "--precision", "fp32"],
     "context and tensor parallelism together are not modelled"),
    (["estimate", "llama-3.2-1b", "--cp", "2"], "cp: 2 with precision bf16-mixed is not modelled"),
    (["estimate", "llama-3.2-1b", "--cp", "65"], "cp: must be between 1 and 64"),
    (["estimate", "llama-3.2-1b", "--cp", "2", "--precision", "fp32", "--gpu", "cpu"], "cp: 2 needs a CUDA GPU"),
    (["fit", "llama-3.2-1b", "--cp", "2", "--precision", "fp32"], "cp: fit searches context parallelism itself"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--precision", "fp32"],
     "pp: 2 with pp_schedule 1f1b needs grad_accum (the schedule's n_microbatches) of at least 2, got 1"),
    (["estimate", "llama-3.2-1b", "--pp", "2", "--grad-accum", "2", "--precision", "fp32"],
     "pp: 2: the model ties lm_head to the embedding"),
    (["estimate", "gpt2", "--pp", "2", "--grad-accum", "2", "--precision", "fp32"], "pp: 2 with gpt2 is not modelled"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp16-mixed"],
     "pp: 2 with precision fp16-mixed is not modelled"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32", "--gpus", "2",
      "--parallel", "zero2"], "pp: 2 with parallel zero2: pipeline parallelism combined with a data-parallel wrapper "
                              "other than DDP or FSDP2 is not modelled yet; use parallel none, ddp or fsdp"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32", "--parallel", "fsdp"],
     "pp: 2 with parallel fsdp and gpus 1: FSDP2 under a pipeline shards each stage over its gpus data-parallel "
     "ranks and is modelled for 2 or more; use gpus 2 or more, or parallel none"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32", "--tp", "2", "--gpus",
      "2", "--parallel", "ddp"],
     "tp: 2 with gpus 2 / parallel ddp: tensor parallelism combined with data parallelism is modelled under parallel "
     "fsdp only"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32", "--tp", "2", "--gpus",
      "4", "--parallel", "fsdp", "--fsdp-replicate", "2"],
     "tp: 2 with gpus 4 / parallel fsdp: fsdp_reshard_after_forward / fsdp_replicate / fsdp_param_dtype / "
     "fsdp_reduce_dtype / fsdp_no_sync are not modelled with tensor parallelism"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--tp", "2", "--precision", "fp16-mixed"],
     "precision fp16-mixed is not modelled"),
    (["estimate", "mistral-7b-v0.3", "--pp-schedule", "gpipe"], "pp_schedule: a pipeline knob"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--pp-schedule", "zb"], "pp_schedule: unknown value 'zb'"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--pp-stages-per-rank", "2"],
     "pp_stages_per_rank: 2 needs a multi-stage schedule: use interleaved-1f1b or looped-bfs, not 1f1b"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--pp-schedule", "interleaved-1f1b"],
     "pp_schedule interleaved-1f1b runs several stages per rank: set pp_stages_per_rank to 2 or more"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "5", "--pp-schedule", "interleaved-1f1b",
      "--pp-stages-per-rank", "2"], "pp_schedule interleaved-1f1b needs grad_accum (n_microbatches) to be a multiple"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--pp-schedule", "looped-bfs",
      "--pp-stages-per-rank", "32"], "pp: 2 x pp_stages_per_rank 32: the model has 32 decoder layers, fewer than the "
     "64 stages"),
    (["estimate", "mistral-7b-v0.3", "--pp-stages-per-rank", "2"], "pp_stages_per_rank: a pipeline knob"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--pp-stages-per-rank", "x"], "pp_stages_per_rank"),
    (["estimate", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32", "--rank", "2"],
     "rank: 2 is not one of the 2 ranks (0..1) of --pp 2"),
    (["fit", "mistral-7b-v0.3", "--pp", "2", "--grad-accum", "2", "--precision", "fp32"], "pp: fit searches"),
    (["estimate", "gpt2", "--gpus", "2", "--parallel", "ddp", "--rank", "2"],
     "rank: 2 is not one of the 2 ranks (0..1) of --gpus 2"),
    (["estimate", "gpt2", "--rank", "1"], "rank: 1 is not one of the 1 ranks (0..0) of --gpus 1"),
    (["estimate", "gpt2", "--gpus", "2", "--parallel", "ddp", "--rank", "last"],
     "rank (a rank number or 'worst'): must be a whole number (0 or more), got 'last'"),
])
def test_bad_arguments_exit_2_with_one_line(run, args, message):
    r = run(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("trainmem: error: ")
    assert message in lines[0]


BAD_CONFIGS = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"model_type": "bert"}', "unsupported model_type 'bert'"),
    ('{"hidden_size": 8}', "missing field 'model_type'"),
    ('{"model_type": "llama", "hidden_size": 64}', "missing field 'intermediate_size'"),
    ('{"model_type": "gpt2", "n_embd": 768, "n_layer": 2, "n_head": 5, "vocab_size": 100, "n_positions": 64}',
     "n_head=5 does not divide n_embd=768"),
    ('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
     '"num_attention_heads": 8, "num_key_value_heads": 3, "vocab_size": 100}',
     "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ('{"model_type": "llama", "hidden_size": -64, "intermediate_size": 128, "num_hidden_layers": 2, '
     '"num_attention_heads": 8, "vocab_size": 100}', "field 'hidden_size' must be at least 1, got -64"),
    ('{"model_type": "llama", "hidden_size": 64.5, "intermediate_size": 128, "num_hidden_layers": 2, '
     '"num_attention_heads": 8, "vocab_size": 100}', "field 'hidden_size' must be a whole number"),
    ('{"model_type": "llama", "hidden_size": NaN}', "not valid JSON"),
    ('{"model_type": "llama", "hidden_size": "4096"}', "field 'hidden_size' must be a positive integer"),
    ('{"model_type": "llama", "hidden_size": 1e15, "intermediate_size": 128, "num_hidden_layers": 2, '
     '"num_attention_heads": 8, "vocab_size": 100}', "field 'hidden_size' must be between 1 and 16777216"),
    ('{"model_type": "llama", "hidden_size": 16777216, "intermediate_size": 16777216, "num_hidden_layers": 100000, '
     '"num_attention_heads": 1, "vocab_size": 16777216}', "overflows a 64-bit byte count"),
]


@pytest.mark.parametrize("text, message", BAD_CONFIGS)
def test_bad_config_json(run, tmp_path, text, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    r = run("estimate", cfg)
    assert r.returncode == 2, r.stdout
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert message in r.stderr


def test_hostile_files(run, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000 + "]" * 200000)
    r = run("estimate", deep)
    assert r.returncode == 2 and r.stdout == ""
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage\x80\x81")
    r = run("estimate", binary)
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(100 * 1024 * 1024)
    r = run("estimate", big)
    assert r.returncode == 2 and "too large to be a config.json" in r.stderr
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    r = run("estimate", empty_dir)
    assert r.returncode == 2 and "directory has no config.json" in r.stderr


def test_zero_offload_reports_the_host_memory(run):
    # --offload optimizer: the recipe carries it, the GPU holds no optimizer state and less than
    # without it, and host_bytes (unmeasured) adds up; the text output names the host memory.
    args = ["estimate", "gpt2", "--gpus", "2", "--parallel", "zero2", "--precision", "bf16-master", "--seq", "256"]
    off = json.loads(run(*args, "--offload", "optimizer", "--json").stdout)
    on = json.loads(run(*args, "--json").stdout)
    assert off["recipe"]["offload"] == "optimizer" and "offload" not in on["recipe"]
    assert off["breakdown_at_peak"]["optimizer_states"] == 0 < on["breakdown_at_peak"]["optimizer_states"]
    assert off["peak_allocated_bytes"] < on["peak_allocated_bytes"]
    host = off["host_bytes"]
    assert "host_bytes" not in on and host["measured"] is False
    assert host["total_bytes"] == host["pinned_bytes"] + host["pageable_bytes"]
    assert host["pinned_bytes"] >= host["pinned_requested_bytes"]
    assert host["weights"] + host["optimizer_states"] + host["gradients"] == \
        host["pinned_requested_bytes"] + host["pageable_bytes"]
    text = run(*args, "--offload", "optimizer")
    assert text.returncode == 0 and "host memory of this rank" in text.stdout and "unmeasured" in text.stdout
    bad = run("estimate", "gpt2", "--gpus", "2", "--parallel", "fsdp", "--precision", "fp32", "--offload", "optimizer")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "CPUOffloadPolicy moves the sharded parameters, their gradients and the optimizer states" in bad.stderr


def test_fsdp_offload_moves_shards_gradients_and_states_to_the_host(run):
    # --parallel fsdp --offload both: FSDP2's CPUOffloadPolicy (Note [FSDP2 CPU offload]); the GPU
    # keeps only what is gathered and in flight, the host a rank's shards, .grads and AdamW states.
    args = ["estimate", "gpt2", "--gpus", "2", "--parallel", "fsdp", "--precision", "fp32", "--seq", "256"]
    off = json.loads(run(*args, "--offload", "both", "--json").stdout)
    on = json.loads(run(*args, "--json").stdout)
    assert off["recipe"]["offload"] == "both" and off["host_bytes"]["measured"] is False
    assert off["breakdown_at_peak"]["optimizer_states"] == 0 < on["breakdown_at_peak"]["optimizer_states"]
    assert off["peak_allocated_bytes"] < on["peak_allocated_bytes"]
    host = off["host_bytes"]
    # fp32 AdamW: 4 (shard) + 4 (.grad) + 8 (moments) bytes per shard element, plus the 0-dim step
    # of each of GPT-2's 148 tensors
    assert host["optimizer_states"] == 2 * host["weights"] + 4 * 148 and host["gradients"] == host["weights"]
    text = run(*args, "--offload", "both")
    assert text.returncode == 0 and "FSDP2 CPUOffloadPolicy" in text.stdout and "unmeasured" in text.stdout
    bad = run(*args, "--offload", "both", "--gpu", "cpu")
    assert bad.returncode == 2 and bad.stdout == "" and "needs a CUDA GPU" in bad.stderr


def test_zero3_offload_moves_the_model_states_to_the_host(run):
    # --parallel zero3 --offload optimizer|params|both (Note [ZeRO-3 offload]): the more is
    # offloaded, the less the GPU holds and the more the host does; params alone keeps the
    # optimizer states on the GPU.
    args = ["estimate", "gpt2", "--gpus", "2", "--parallel", "zero3", "--precision", "bf16-master", "--seq", "256",
            "--json"]
    got = {off: json.loads(run(*args, "--offload", off).stdout) for off in ("none", "optimizer", "params", "both")}
    assert "host_bytes" not in got["none"]
    for off in ("optimizer", "params", "both"):
        assert got[off]["recipe"]["offload"] == off and got[off]["host_bytes"]["measured"] is False
        assert got[off]["peak_allocated_bytes"] < got["none"]["peak_allocated_bytes"]
    assert got["both"]["peak_allocated_bytes"] < got["optimizer"]["peak_allocated_bytes"]
    assert got["both"]["host_bytes"]["total_bytes"] == \
        got["optimizer"]["host_bytes"]["total_bytes"] + got["params"]["host_bytes"]["total_bytes"]
    assert got["params"]["breakdown_at_peak"]["optimizer_states"] > 0 == got["both"]["breakdown_at_peak"]["optimizer_states"]
    bad = run("estimate", "gpt2", "--gpus", "2", "--parallel", "zero2", "--precision", "bf16-master", "--offload", "params")
    assert bad.returncode == 2 and bad.stdout == "" and "only ZeRO-3 does" in bad.stderr


def test_fit_holds_offloaded_plans_to_the_host_memory(run):
    # --host-memory GiB: an offloaded plan fits only if its rank's host bytes are within it; the
    # table shows them. Llama-3.1-8B's ZeRO-2 offload on one GPU needs ~140 GiB of host memory.
    args = ["fit", "llama-3.1-8b", "--parallel", "zero2", "--precision", "bf16-master", "--offload", "optimizer",
            "--seq", "512", "--top", "1"]
    roomy = json.loads(run(*args, "--host-memory", "256", "--json").stdout)
    assert roomy["host_capacity_bytes"] == 256 << 30
    plan = roomy["plans"][0]
    assert plan["fits"] and (128 << 30) < plan["host_bytes"] <= 256 << 30
    tight = json.loads(run(*args, "--json").stdout)  # the default, 128 GiB
    assert tight["host_capacity_bytes"] == 128 << 30 and tight["plans"] == []
    assert tight["closest_miss"]["lacks_host_bytes"] == plan["host_bytes"] - (128 << 30)
    text = run(*args, "--host-memory", "256").stdout
    assert "host memory of one rank under CPU offload, within the 256.00 GiB allowed per GPU" in text
    for bad in ("0", "x", "2000000"):
        r = run(*args, "--host-memory", bad)
        assert r.returncode == 2 and r.stdout == "" and "host_memory" in r.stderr


@pytest.mark.parametrize("offload,wrappers,own", [("optimizer", {"zero1", "zero2", "zero3"}, "zero2"),
                                                  ("params", {"zero3"}, "zero3"),
                                                  ("both", {"zero3", "fsdp"}, "zero3")])
def test_fit_holds_offload_on_several_gpus_without_a_parallel_flag(run, offload, wrappers, own):
    # --offload alone on --gpus 2: the search keeps the wrappers that offload (no pipelines or
    # rings, which offload nothing), and the user's own recipe runs under one of them.
    r = run("fit", "qwen3-0.6b", "--gpus", "2", "--seq", "512", "--offload", offload, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["plans"] and {p["recipe"]["offload"] for p in j["plans"]} == {offload}
    assert {p["recipe"]["parallel"] for p in j["plans"]} <= wrappers
    assert j["baseline"]["recipe"]["parallel"] == own and j["baseline"]["recipe"]["offload"] == offload
    one = run("fit", "qwen3-0.6b", "--offload", offload)  # one GPU: the wrapper must be named
    assert one.returncode == 2 and one.stdout == "" and "needs parallel zero1" in one.stderr
    for extra, message in [(["--parallel", "none"], "DDP offloads nothing"),
                           (["--tp", "2"], "with tensor parallelism (--tp 2) is not modelled")]:
        r = run("fit", "qwen3-0.6b", "--gpus", "4", "--offload", offload, *extra)
        assert r.returncode == 2 and r.stdout == "" and message in r.stderr, r.stderr


def test_data_parallel_flags_reach_the_recipe(run):
    r = run("estimate", "qwen3-0.6b", "--seq", "256", "--gpus", "4", "--parallel", "fsdp", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["recipe"]["gpus"] == 4 and j["recipe"]["parallel"] == "fsdp"
    single = json.loads(run("estimate", "qwen3-0.6b", "--seq", "256", "--json").stdout)
    assert "gpus" not in single["recipe"] and "parallel" not in single["recipe"]  # as trainmem-measure writes it
    # Sharding divides the states over the ranks; DDP adds its buckets to the gradients.
    assert j["breakdown_at_peak"]["optimizer_states"] < single["breakdown_at_peak"]["optimizer_states"] / 3
    ddp = json.loads(run("estimate", "qwen3-0.6b", "--seq", "256", "--gpus", "4", "--parallel", "ddp", "--json").stdout)
    assert ddp["peak_allocated_bytes"] > single["peak_allocated_bytes"]


def test_fsdp_variant_flags_reach_the_recipe(run):
    base = ["estimate", "qwen3-0.6b", "--seq", "256", "--gpus", "4", "--parallel", "fsdp", "--precision", "fp32",
            "--json"]
    full = json.loads(run(*base).stdout)
    assert (full["recipe"]["fsdp_reshard_after_forward"], full["recipe"]["fsdp_replicate"]) == (True, 1)
    sgo = json.loads(run(*base, "--fsdp-reshard-after-forward", "false").stdout)
    assert sgo["recipe"]["fsdp_reshard_after_forward"] is False
    # The layers stay gathered from forward to backward: never less than full sharding.
    assert sgo["peak_allocated_bytes"] >= full["peak_allocated_bytes"]
    hsdp = json.loads(run(*base, "--fsdp-replicate", "2").stdout)
    assert hsdp["recipe"]["fsdp_replicate"] == 2
    # Sharded over 2 ranks instead of 4: twice the optimizer states, less the per-tensor rounding of
    # the smaller shards (qwen3's many small norm weights).
    ratio = hsdp["breakdown_at_peak"]["optimizer_states"] / full["breakdown_at_peak"]["optimizer_states"]
    assert 1.95 < ratio < 2.0
    mp = json.loads(run(*base, "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32").stdout)
    assert (mp["recipe"]["fsdp_param_dtype"], mp["recipe"]["fsdp_reduce_dtype"]) == ("bf16", "fp32")
    assert mp["peak_allocated_bytes"] < full["peak_allocated_bytes"]  # bf16 activations and gathers
    ddp = json.loads(run("estimate", "qwen3-0.6b", "--seq", "256", "--gpus", "4", "--parallel", "ddp", "--json").stdout)
    assert "fsdp_replicate" not in ddp["recipe"]


def test_fit_offers_flipping_reshard_after_forward(run):
    r = run("fit", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--parallel", "fsdp", "--seq", "1024",
            "--global-batch", "16", "--top", "2", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    [c] = [c for c in f["changes"] if c["change"] == "fsdp_reshard_after_forward false"]
    assert c["recipe"]["fsdp_reshard_after_forward"] is False
    est = json.loads(run("estimate", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--parallel", "fsdp",
                         "--seq", "1024", "--grad-accum", str(c["recipe"]["grad_accum"]),
                         "--fsdp-reshard-after-forward", "false", "--json").stdout)
    assert c["peak_allocated_bytes"] == est["peak_allocated_bytes"]
    assert c["peak_allocated_bytes"] > f["baseline"]["peak_allocated_bytes"]  # the layers stay gathered


@pytest.mark.parametrize("args, message", [
    (["--gpus", "2", "--parallel", "ddp", "--fsdp-reshard-after-forward", "false"], "they need parallel fsdp"),
    (["--gpus", "2", "--parallel", "fsdp", "--fsdp-reshard-after-forward", "no"],
     "fsdp_reshard_after_forward: must be true or false, got 'no'"),
    (["--gpus", "4", "--parallel", "fsdp", "--fsdp-replicate", "4"], "needs a shard group of 2 or more GPUs"),
    (["--gpus", "8", "--parallel", "fsdp", "--fsdp-replicate", "3"], "fsdp_replicate: 3 does not divide gpus 8"),
    (["--gpus", "2", "--parallel", "fsdp", "--fsdp-param-dtype", "fp16"],
     "fsdp_param_dtype: unknown value 'fp16'; expected one of none, fp32, bf16"),
    (["--gpus", "2", "--parallel", "fsdp", "--precision", "bf16-true", "--fsdp-param-dtype", "bf16"],
     "use precision fp32, or bf16-mixed"),
    (["--gpus", "2", "--parallel", "fsdp", "--load-dtype", "bf16", "--fsdp-param-dtype", "bf16"],
     "over an fp32-loaded model"),
    (["--gpus", "2", "--parallel", "fsdp", "--precision", "fp32", "--fsdp-reduce-dtype", "fp32"],
     "without fsdp_param_dtype is not modelled"),
    (["--gpus", "2"], "gpus: 2 GPUs need a data-parallel wrapper: parallel ddp, fsdp, zero1, zero2 or zero3"),
    (["--gpus", "2", "--parallel", "zero4"],
     "parallel: unknown value 'zero4'; expected one of none, ddp, fsdp, zero1, zero2, zero3"),
    (["--gpus", "2", "--parallel", "zero3", "--lora", "8", "--offload", "optimizer"],
     "offload: optimizer with LoRA is not modelled yet"),
    (["--gpus", "0", "--parallel", "ddp"], "gpus: must be between 1 and 4096, got 0"),
    (["--parallel", "ddp", "--inference"], "parallel: ddp is a training knob; inference runs on one GPU"),
    (["--parallel", "fsdp", "--loss", "fused"], "loss: fused under parallel fsdp is not modelled"),
    (["--gpus", "2", "--parallel", "fsdp", "--ddp-find-unused-parameters"],
     "ddp_find_unused_parameters: a DistributedDataParallel knob, it needs parallel ddp"),
    (["--gpus", "2", "--parallel", "ddp", "--ddp-find-unused-parameters", "--loss", "fused"],
     "ddp_find_unused_parameters with loss fused is not modelled"),
    (["--gpus", "2", "--parallel", "zero2", "--ddp-gradient-as-bucket-view"],
     "ddp_gradient_as_bucket_view: a DistributedDataParallel knob, it needs parallel ddp"),
    (["--gpus", "2", "--parallel", "ddp", "--pp", "2", "--grad-accum", "2", "--ddp-gradient-as-bucket-view"],
     "ddp_gradient_as_bucket_view: a DistributedDataParallel knob, it needs parallel ddp (without a pipeline)"),
    (["--gpus", "2", "--parallel", "ddp", "--ddp-gradient-as-bucket-view", "--ddp-find-unused-parameters"],
     "ddp_gradient_as_bucket_view with ddp_find_unused_parameters is not modelled"),
])
def test_data_parallel_bad_input(run, args, message):
    r = run("estimate", "gpt2", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert message in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--attention-mask", "left"], "attention_mask: unknown value 'left'; expected one of none, ones, padded"),
    (["--attention-mask", "ones", "--inference"], "attention_mask: ones is a training knob"),
    (["--attention-mask", "padded", "--seq", "1"], "attention_mask: padded needs seq >= 2"),
    (["--attention-mask", "padded", "--pp", "2", "--grad-accum", "2"],
     "attention_mask: padded with pipeline or context parallelism is not modelled"),
])
def test_attention_mask_bad_input(run, args, message):
    r = run("estimate", "llama-3.2-1b", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert message in r.stderr


def test_fit_on_several_gpus_splits_the_global_batch(run):
    r = run("fit", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "1024", "--global-batch", "16",
            "--top", "3", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["gpus"] == 4 and f["baseline"]["recipe"]["parallel"] == "ddp"
    for p in f["plans"]:
        assert p["recipe"]["gpus"] == 4 and p["recipe"]["parallel"] in ("ddp", "fsdp", "zero1", "zero2")
        assert p["recipe"]["batch"] * p["recipe"]["grad_accum"] == 4
        assert p["time"]["comm_s"] > 0


def test_zero_alias_is_parallel_zero_n(run):
    """`--zero N` is `--parallel zeroN` (the issue's spelling); ZeRO-3 shards what ZeRO-2 keeps whole."""
    base = ["estimate", "qwen3-0.6b", "--seq", "256", "--gpus", "4", "--precision", "bf16-master", "--json"]
    by_name = json.loads(run(*base, "--parallel", "zero3").stdout)
    by_alias = json.loads(run(*base, "--zero", "3").stdout)
    assert by_alias == by_name and by_alias["recipe"]["parallel"] == "zero3"
    zero2 = json.loads(run(*base, "--zero", "2").stdout)
    assert zero2["recipe"]["parallel"] == "zero2"
    # Both hold a quarter of the fp32 master and of Adam's moments. Under 1e9 parameters stage 3's
    # default reuse distance keeps every parameter gathered from step 2's forward to its backward, so
    # its peak holds the whole bf16 model beside its partitions (docs/parallelism.md, ZeRO-3).
    n = by_name["parameters"]
    assert by_name["breakdown_at_peak"]["optimizer_states"] == zero2["breakdown_at_peak"]["optimizer_states"]
    assert by_name["breakdown_at_peak"]["weights"] >= 2 * n + (2 + 4) * n // 4


def test_fit_grows_an_unheld_micro_batch_to_reach_a_large_global_batch(run):
    # 2048 sequences at the default micro-batch of 1 would take 2048 micro-batches (the cap is
    # 1024): "your recipe" runs 2 x 1024 instead; a --batch given is kept, and then refused.
    out = json.loads(run("fit", "qwen3-0.6b", "--global-batch", "2048", "--top", "1", "--json").stdout)
    assert (out["baseline"]["recipe"]["batch"], out["baseline"]["recipe"]["grad_accum"]) == (2, 1024)
    assert out["batch_grown"] is True
    text = run("fit", "qwen3-0.6b", "--global-batch", "2048", "--top", "1").stdout
    assert "(micro-batch 2: the smallest that reaches the global batch in at most 1024 micro-batches" in text
    small = run("fit", "qwen3-0.6b", "--global-batch", "64", "--top", "1")
    assert json.loads(run("fit", "qwen3-0.6b", "--global-batch", "64", "--top", "1", "--json").stdout)["batch_grown"] is False
    assert "(micro-batch" not in small.stdout
    held = run("fit", "qwen3-0.6b", "--global-batch", "2048", "--batch", "1")
    assert held.returncode == 2 and "needs grad_accum 2048 at batch 1; more than 1024" in held.stderr


def test_fit_searches_tensor_parallelism_for_qwen3(run):
    # Qwen3's q/k norms run on the local heads under the Megatron plan (measured): its recipes
    # over several GPUs include tensor-parallel groups.
    out = json.loads(run("fit", "qwen3-0.6b", "--gpus", "2", "--seq", "1024", "--global-batch", "8", "--top", "200",
                         "--json").stdout)
    assert any(p["recipe"].get("tp", 1) == 2 for p in out["plans"])
