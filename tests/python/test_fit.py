"""`trainmem fit` and trainmem.fit as a user drives them: the JSON contract, held knobs, the
closest miss, and bad requests."""
import json

import pytest

import trainmem


def test_fit_json_contract(run):
    r = run("fit", "qwen3-0.6b", "--gpu", "a10g-24gb", "--seq", "1024", "--global-batch", "8", "--top", "3",
            "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    for key in ("capacity_bytes", "plans", "baseline", "changes", "closest_miss", "searched", "simulated",
                "pruned", "global_batch", "device"):
        assert key in j
    assert j["capacity_bytes"] == j["device"]["capacity_bytes"] - j["device"]["context_bytes"]
    assert 1 <= len(j["plans"]) <= 3
    times = [p["step_time_s"] for p in j["plans"]]
    assert times == sorted(times)
    for p in j["plans"]:
        assert p["fits"] and p["peak_reserved_bytes"] <= j["capacity_bytes"]
        assert p["recipe"]["batch"] * p["recipe"]["grad_accum"] == 8
        assert set(p) >= {"recipe", "peak_allocated_bytes", "peak_reserved_bytes", "step_time_s"}
    assert j["closest_miss"] is None
    for c in j["changes"]:
        assert c["saves_bytes"] == j["baseline"]["peak_reserved_bytes"] - c["peak_reserved_bytes"]


def test_plans_agree_with_estimate(run):
    j = json.loads(run("fit", "gpt2", "--gpu", "t4-16gb", "--seq", "1024", "--global-batch", "16", "--top", "2",
                       "--json", timeout=120).stdout)
    for p in j["plans"]:
        rc = p["recipe"]
        e = json.loads(run("estimate", "gpt2", "--batch", rc["batch"], "--grad-accum", rc["grad_accum"], "--seq",
                           rc["seq"], "--precision", rc["precision"], "--optimizer", rc["optimizer"],
                           "--checkpointing", rc["checkpointing"], "--loss", rc["loss"], "--allocator",
                           rc["allocator"], "--gpu", "t4-16gb", "--json").stdout)
        assert e["peak_reserved_bytes"] == p["peak_reserved_bytes"]
        assert rc["precision"] in ("fp16-mixed", "fp32")  # the T4 has no bf16


def test_given_knobs_are_held(run):
    j = json.loads(run("fit", "gpt2", "--gpu", "a10g-24gb", "--seq", "512", "--global-batch", "8",
                       "--optimizer", "sgd", "--checkpointing", "full", "--json", timeout=120).stdout)
    assert j["plans"]
    assert {p["recipe"]["optimizer"] for p in j["plans"]} == {"sgd"}
    assert {p["recipe"]["checkpointing"] for p in j["plans"]} == {"full"}


def test_nothing_fits_names_the_closest_miss(run):
    r = run("fit", "llama-3.1-70b", "--gpu", "rtx-4090", "--seq", "4096", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "nothing fits" in r.stdout and "closest:" in r.stdout
    assert "no larger GPU of the catalog fits" in r.stdout  # 70B weights and gradients alone: 262 GB
    j = json.loads(run("fit", "llama-3.1-70b", "--gpu", "rtx-4090", "--seq", "4096", "--json", timeout=120).stdout)
    assert j["plans"] == [] and j["fits_on"] == []
    assert j["closest_miss"]["lacks_bytes"] > 0
    assert j["adapter_plans"] == []  # its 4-bit base alone (~37 GB) outgrows a 24 GB GPU


def test_nothing_fits_offers_the_adapter_route(run):
    # Full fine-tuning of the 70B model fits no single GPU; QLoRA on an 80 GB one does (LoRA's bf16
    # base, 141 GB, does not), and each adapter plan is the estimate of its recipe.
    r = run("fit", "llama-3.1-70b", "--gpu", "a100-80gb", "--seq", "2048", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "nothing fits" in r.stdout and "or train adapters instead of every weight" in r.stdout
    assert "--lora 16 --qlora plans it" in r.stdout
    j = json.loads(run("fit", "llama-3.1-70b", "--gpu", "a100-80gb", "--seq", "2048", "--json", timeout=120).stdout)
    assert j["plans"] == [] and 1 <= len(j["adapter_plans"]) <= 3
    for p in j["adapter_plans"]:
        rc = p["recipe"]
        assert rc["lora_rank"] == 16 and rc["load_in_4bit"] and rc["bnb_4bit_quant_type"] == "nf4"
        assert p["fits"] and p["peak_reserved_bytes"] <= j["capacity_bytes"]
        e = json.loads(run("estimate", "llama-3.1-70b", "--gpu", "a100-80gb", "--batch", rc["batch"], "--seq", rc["seq"],
                           "--precision", rc["precision"], "--optimizer", rc["optimizer"], "--checkpointing",
                           rc["checkpointing"], "--loss", rc["loss"], "--allocator", rc["allocator"], "--lora", "16",
                           "--qlora", "--grad-accum", rc["grad_accum"], "--json").stdout)
        assert e["peak_reserved_bytes"] == p["peak_reserved_bytes"]
    # A recipe that fits gets no adapter route, nor does one that trains adapters already.
    j = json.loads(run("fit", "gpt2", "--gpu", "a100-80gb", "--seq", "512", "--json", timeout=120).stdout)
    assert j["plans"] and j["adapter_plans"] == []
    j = json.loads(run("fit", "llama-3.1-70b", "--gpu", "rtx-4090", "--lora", "16", "--json", timeout=120).stdout)
    assert j["plans"] == [] and j["adapter_plans"] == []


def test_nothing_fits_says_what_it_takes(run):
    j = json.loads(run("fit", "llama-3.1-8b", "--gpu", "rtx-4090", "--seq", "4096", "--json", timeout=120).stdout)
    assert j["plans"] == []
    on = {o["gpu"]: o for o in j["fits_on"]}
    assert "h100-80gb" in on and "l40s-48gb" in on and "rtx-3090" not in on
    for name, o in on.items():
        gpu = next(g for g in json.loads(run("gpus", "--json").stdout) if g["name"] == name)
        assert o["fits"] and o["peak_reserved_bytes"] <= gpu["usable_bytes"]
        assert o["recipe"]["gpu"] == name


def test_what_it_takes_uses_each_gpus_own_precisions(run):
    # From a T4 (no bf16) the bigger GPUs are searched with bf16 where they have it.
    j = json.loads(run("fit", "llama-3.2-3b", "--gpu", "t4-16gb", "--seq", "4096", "--global-batch", "8", "--json",
                       timeout=300).stdout)
    assert j["plans"] == []
    on = {o["gpu"]: o for o in j["fits_on"]}
    assert "l40s-48gb" in on and "rtx-4090" in on
    assert on["rtx-4090"]["recipe"]["precision"].startswith("bf16")


def _estimate_of(run, model, gpu, rc):
    return json.loads(run("estimate", model, "--gpu", gpu, "--batch", rc["batch"], "--grad-accum", rc["grad_accum"],
                          "--seq", rc["seq"], "--precision", rc["precision"], "--optimizer", rc["optimizer"],
                          "--checkpointing", rc["checkpointing"], "--loss", rc["loss"], "--allocator",
                          rc["allocator"], "--attention", rc["attention"], "--gpus", rc["gpus"], "--parallel",
                          rc["parallel"], "--json").stdout)


def test_several_gpus_search_zero(run):
    # bf16-master is DeepSpeed's bf16 mode; FSDP2 refuses it, so the search is DDP, ZeRO-1, ZeRO-2.
    j = json.loads(run("fit", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "512", "--global-batch",
                       "16", "--precision", "bf16-master", "--top", "12", "--json", timeout=300).stdout)
    zero = [p for p in j["plans"] if p["recipe"]["parallel"] in ("zero1", "zero2")]
    assert {p["recipe"]["parallel"] for p in zero} == {"zero1", "zero2"}
    assert "fsdp" not in {p["recipe"]["parallel"] for p in j["plans"]}
    for p in zero:
        rc = p["recipe"]
        assert rc["gpus"] == 4 and rc["batch"] * rc["grad_accum"] == 4
        assert rc["optimizer"] in ("adamw", "adamw-fused", "sgd") and rc["loss"] == "standard"
        e = _estimate_of(run, "qwen3-0.6b", "rtx-4090", rc)
        assert e["peak_reserved_bytes"] == p["peak_reserved_bytes"]
        assert e["peak_allocated_bytes"] == p["peak_allocated_bytes"]
    changes = {c["change"]: c for c in j["changes"]}
    for what in ("parallel zero1", "parallel zero2"):
        e = _estimate_of(run, "qwen3-0.6b", "rtx-4090", changes[what]["recipe"])
        assert e["peak_reserved_bytes"] == changes[what]["peak_reserved_bytes"]


def test_several_gpus_search_pipeline_stages(run):
    # Mistral-7B is untied: with 4 GPUs the search includes pp 4 (one stage per GPU), where every stage
    # runs the whole global batch as grad_accum micro-batches, and pp 2 in two replicas under DDP or
    # FSDP2 (PP x DP), each running half of it; the figures are the worst stage's, as `estimate --pp`
    # gives them (a stage's replicas are alike: one rank per stage). Holding --parallel leaves the
    # pipelines out.
    args = ["fit", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--gpus", "4", "--seq", "2048", "--global-batch", "32",
            "--top", "12", "--json"]
    j = json.loads(run(*args, timeout=600).stdout)
    pp = [p for p in j["plans"] if p["recipe"].get("pp", 1) > 1]
    assert pp, [p["recipe"] for p in j["plans"]]
    layouts = set()
    for p in pp:
        rc = p["recipe"]
        replicas, tp = rc.get("gpus", 1), rc.get("tp", 1)
        layouts.add((rc["pp"], replicas, tp))
        # pp 4; pp 2 x 2 replicas; pp 2 of tensor-parallel pairs (PP x TP)
        assert (rc["pp"], replicas, tp) in {(4, 1, 1), (2, 2, 1), (2, 1, 2)}, rc
        assert rc.get("parallel", "none") in (("ddp", "fsdp") if replicas > 1 else ("none",)), rc
        assert rc["batch"] * rc["grad_accum"] * replicas == 32, rc
        extra = ["--tp", tp] + (["--sequence-parallel"] if rc.get("sequence_parallel") else []) + \
            (["--loss-parallel"] if rc.get("loss_parallel") else []) + \
            ["--pp-stages-per-rank", rc.get("pp_stages_per_rank", 1)]
        e = json.loads(run("estimate", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--batch", rc["batch"], "--grad-accum",
                           rc["grad_accum"], "--seq", rc["seq"], "--precision", rc["precision"], "--optimizer",
                           rc["optimizer"], "--allocator", rc["allocator"], "--pp", rc["pp"], "--pp-schedule",
                           rc["pp_schedule"], "--gpus", replicas, "--parallel", rc.get("parallel", "none"), *extra,
                           "--json", timeout=300).stdout)
        assert e["peak_reserved_bytes"] == p["peak_reserved_bytes"] and len(e["ranks"]) == rc["pp"]
    assert (4, 1, 1) in layouts, layouts
    # pp 2 x ddp 2 and pp 2 x fsdp 2 are searched too: single changes of the DDP baseline, exactly
    # their estimates. FSDP2 shards the stage's states: it holds less than DDP with its buckets.
    held_by = {}
    for wrapper in ("ddp", "fsdp"):
        two = next(c for c in j["changes"] if c["change"] == f"pp 2 1f1b x {wrapper} 2")
        rc = two["recipe"]
        assert (rc["pp"], rc["gpus"], rc["parallel"], rc["batch"] * rc["grad_accum"]) == (2, 2, wrapper, 16), rc
        e = json.loads(run("estimate", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--batch", rc["batch"], "--grad-accum",
                           rc["grad_accum"], "--seq", rc["seq"], "--pp", "2", "--gpus", "2", "--parallel", wrapper,
                           "--precision", rc["precision"], "--optimizer", rc["optimizer"], "--json",
                           timeout=300).stdout)
        assert e["peak_reserved_bytes"] == two["peak_reserved_bytes"]
        held_by[wrapper] = two["peak_allocated_bytes"]
    assert held_by["fsdp"] < held_by["ddp"], held_by
    held = json.loads(run(*args, "--parallel", "fsdp", timeout=600).stdout)
    assert all(p["recipe"].get("pp", 1) == 1 for p in held["plans"])


def test_pipeline_micro_batches_past_the_data_parallel_ones_run_gpipe(run):
    # A global batch of 4 over 4 GPUs: data parallelism has micro-batch 1 only, a pipeline stage runs
    # all 4 sequences, as 4 micro-batches of 1 (1F1B) or 2 of 2 and 1 of 4, fewer than the stages,
    # where torch runs GPipe only (Note [Pipeline schedule in the planner]). --top 400: the faster
    # tensor-parallel plans (tp 4 in every precision and tp 2 x fsdp 2, with and without sequence and loss
    # parallelism) and context-parallel rings come first.
    j = json.loads(run("fit", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--gpus", "4", "--seq", "2048",
                       "--global-batch", "4", "--top", "400", "--json", timeout=600).stdout)
    pp = [p["recipe"] for p in j["plans"] if p["recipe"].get("pp", 1) == 4]
    assert {(r["batch"], r["grad_accum"], r["pp_schedule"]) for r in pp} >= {(1, 4, "1f1b"), (2, 2, "gpipe")}, pp
    for r in (p["recipe"] for p in j["plans"] if p["recipe"].get("pp", 1) > 1):  # pp 2 x ddp 2: 2 sequences each
        assert r["batch"] * r["grad_accum"] * r.get("gpus", 1) == 4
        # 1F1B, or its interleaved form over two stages per GPU, with as many micro-batches as stages
        assert r["pp_schedule"] in (("1f1b", "interleaved-1f1b") if r["grad_accum"] >= r["pp"] else ("gpipe",))
        assert r.get("pp_stages_per_rank", 1) == (2 if r["pp_schedule"] == "interleaved-1f1b" else 1)
    dp = [p["recipe"] for p in j["plans"]
          if p["recipe"].get("pp", 1) == 1 and p["recipe"].get("tp", 1) == 1 and p["recipe"].get("cp", 1) == 1]
    assert dp and all(r["batch"] == 1 and r["grad_accum"] == 1 for r in dp), dp
    gpipe = next(p for p in j["plans"] if p["recipe"].get("pp_schedule") == "gpipe" and p["recipe"]["pp"] == 4)
    rc = gpipe["recipe"]
    e = json.loads(run("estimate", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--batch", rc["batch"], "--grad-accum",
                       rc["grad_accum"], "--seq", rc["seq"], "--precision", rc["precision"], "--optimizer",
                       rc["optimizer"], "--allocator", rc["allocator"], "--pp", "4", "--pp-schedule", "gpipe",
                       "--json", timeout=300).stdout)
    assert e["peak_reserved_bytes"] == gpipe["peak_reserved_bytes"]
    assert e["peak_allocated_bytes"] == gpipe["peak_allocated_bytes"]


def test_a_global_batch_the_gpus_cannot_split_plans_pipelines_and_tensor_parallelism(run):
    # 6 sequences over 4 GPUs: no data-parallel recipe, but a 4-stage pipeline or a 4-way tensor-parallel
    # group runs all 6 (Note [A global batch that does not split over the GPUs]). The baseline is the
    # user's recipe as the pipeline, and every plan is what `estimate` gives for it.
    j = json.loads(run("fit", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--gpus", "4", "--seq", "1024",
                       "--global-batch", "6", "--top", "400", "--json", timeout=600).stdout)
    assert j["baseline_moved"] is True
    b = j["baseline"]["recipe"]
    assert (b["pp"], b["batch"], b["grad_accum"], b["pp_schedule"]) == (4, 1, 6, "1f1b") and "gpus" not in b
    assert j["plans"]
    kinds = set()
    # pp 4, tp 4, tp 2 x fsdp 2, pp 2 x ddp/fsdp 2 (3 sequences per group or replica), pp 2 x tp 2,
    # one context-parallel ring of 4 (it runs the whole batch too) or two rings of 2 under FSDP2 (3
    # sequences each): never data parallelism over 4 GPUs
    expected = {(4, 1, 1, 1), (1, 4, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 1, 1), (1, 1, 1, 4), (1, 1, 2, 2)}
    for p in j["plans"]:
        rc = p["recipe"]
        kind = (rc.get("pp", 1), rc.get("tp", 1), rc.get("gpus", 1), rc.get("cp", 1))
        assert kind in expected, rc
        assert rc["batch"] * rc["grad_accum"] * kind[2] == 6, rc
        kinds.add(kind)
    assert kinds == expected, kinds
    gp = next(p for p in j["plans"] if p["recipe"].get("pp_schedule") == "gpipe")  # 3 micro-batches of 2
    rc = gp["recipe"]
    assert (rc["batch"], rc["grad_accum"]) == (2, 3)
    e = json.loads(run("estimate", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--batch", rc["batch"], "--grad-accum",
                       rc["grad_accum"], "--seq", rc["seq"], "--precision", rc["precision"], "--optimizer",
                       rc["optimizer"], "--allocator", rc["allocator"], "--pp", "4", "--pp-schedule", "gpipe",
                       "--json", timeout=300).stdout)
    assert e["peak_reserved_bytes"] == gp["peak_reserved_bytes"]
    assert any(c["change"].startswith("tp 4 (no data parallelism)") for c in j["changes"])
    text = run("fit", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--gpus", "4", "--seq", "1024",
               "--global-batch", "6", timeout=600).stdout
    assert "6 sequences do not split over 4 data-parallel GPUs: your recipe as a pipeline over all of them" in text
    # A global batch that splits keeps the data-parallel baseline, and offers the pipeline as a change.
    j = json.loads(run("fit", "mistral-7b-v0.3", "--gpu", "a100-40gb", "--gpus", "4", "--seq", "1024",
                       "--global-batch", "8", "--top", "1", "--json", timeout=600).stdout)
    assert j["baseline_moved"] is False and j["baseline"]["recipe"]["parallel"] == "ddp"
    assert {"pp 4 1f1b (no data parallelism)", "pp 2 1f1b x ddp 2"} <= {c["change"] for c in j["changes"]}


def test_tensor_parallel_groups_below_the_gpus_are_data_parallel_under_fsdp(run):
    # 4 GPUs: tp 4 (one group) and tp 2 x fsdp 2 (TP x DP, docs/parallelism.md) besides the
    # data-parallel wrappers; a TP x DP plan is what `estimate --tp 2 --gpus 2 --parallel fsdp` gives.
    args = ["fit", "llama-3.2-1b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "1024", "--global-batch", "8"]
    j = json.loads(run(*args, "--top", "200", "--json", timeout=600).stdout)
    tpdp = [p for p in j["plans"] if p["recipe"].get("tp", 1) == 2]
    assert tpdp, [p["recipe"] for p in j["plans"]]
    for p in tpdp[:3]:
        rc = p["recipe"]
        assert rc["gpus"] == 2 and rc["parallel"] == "fsdp" and rc["batch"] * rc["grad_accum"] == 4, rc
        e = json.loads(run("estimate", "llama-3.2-1b", "--gpu", "rtx-4090", "--batch", rc["batch"], "--grad-accum",
                           rc["grad_accum"], "--seq", rc["seq"], "--precision", rc["precision"], "--optimizer",
                           rc["optimizer"], "--checkpointing", rc["checkpointing"], "--allocator", rc["allocator"],
                           "--gpus", "2", "--parallel", "fsdp", "--tp", "2",
                           *(["--sequence-parallel"] if rc.get("sequence_parallel") else []), "--json").stdout)
        assert e["peak_reserved_bytes"] == p["peak_reserved_bytes"]
    change = next(c for c in j["changes"] if c["change"] == "tp 2 x fsdp 2")  # bf16-mixed kept (measured)
    assert (change["recipe"]["tp"], change["recipe"]["gpus"], change["recipe"]["grad_accum"]) == (2, 2, 4)
    assert change["recipe"]["precision"] == "bf16-mixed"
    # A held --tp 2 on 4 GPUs: the baseline is two data-parallel groups of 2 under FSDP2.
    held = json.loads(run(*args, "--tp", "2", "--precision", "bf16-true", "--json", timeout=600).stdout)
    b = held["baseline"]["recipe"]
    assert (b["tp"], b["gpus"], b["parallel"]) == (2, 2, "fsdp")
    assert held["plans"] and all(p["recipe"]["tp"] == 2 for p in held["plans"])


def test_a_held_precision_zero_refuses_leaves_it_out(run):
    r = run("fit", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "512", "--global-batch", "16",
            "--precision", "bf16-mixed", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["plans"]
    assert {p["recipe"]["parallel"] for p in j["plans"]} <= {"ddp", "fsdp"}
    change = next(c for c in j["changes"] if c["change"] == "parallel zero2, precision bf16-master")
    assert change["recipe"]["precision"] == "bf16-master"  # DeepSpeed's bf16 mode
    assert change["recipe"]["parallel"] == "zero2"
    e = _estimate_of(run, "qwen3-0.6b", "rtx-4090", change["recipe"])
    assert e["peak_reserved_bytes"] == change["peak_reserved_bytes"]


def test_a_held_wrapper_holds_for_tensor_parallel_groups(run):
    """--parallel zero2 keeps every plan under ZeRO-2 (tensor-parallel groups run under FSDP2 or
    no wrapper, so none of them); --parallel fsdp keeps TP x FSDP2 but not a lone TP group. The
    LoRA change is offered under a wrapper too."""
    base = ["fit", "llama-3.1-8b", "--gpu", "a100-80gb", "--gpus", "4", "--seq", "2048", "--global-batch", "16",
            "--json"]
    zero2 = json.loads(run(*base, "--parallel", "zero2", timeout=300).stdout)
    assert zero2["plans"] and all(p["recipe"]["parallel"] == "zero2" and "tp" not in p["recipe"]
                                  for p in zero2["plans"])
    lora = next(c for c in zero2["changes"] if c["change"].startswith("lora 16"))
    assert lora["recipe"]["parallel"] == "zero2" and lora["recipe"]["lora_rank"] == 16
    fsdp = json.loads(run(*base, "--parallel", "fsdp", timeout=300).stdout)
    assert fsdp["plans"] and all(p["recipe"].get("parallel") == "fsdp" for p in fsdp["plans"])
    # A held none: the tensor-parallel groups over all the GPUs, never TP x FSDP2.
    none = json.loads(run(*base, "--parallel", "none", "--top", "40", timeout=300).stdout)
    tp = [p["recipe"] for p in none["plans"] if p["recipe"].get("tp", 1) > 1]
    assert tp and all(r["tp"] == 4 and "parallel" not in r for r in tp), tp


def test_plans_timed_alike_come_smaller_first_and_a_floor_lists_resolved_targets(run):
    """Plans with the same step time (bf16-true and bf16-mixed over a 4-bit base, say) are listed
    by reserved bytes; a closest miss known only by its floor names the modules LoRA wraps, as a
    replayed plan does."""
    f = json.loads(run("fit", "llama-3.1-70b", "--gpu", "a100-80gb", "--seq", "2048", "--json", timeout=300).stdout)
    for plans in (f["plans"], f["adapter_plans"]):
        keys = [(p["step_time_s"], p["peak_reserved_bytes"]) for p in plans]
        assert keys == sorted(keys)
    assert f["adapter_plans"][0]["recipe"]["precision"] == "bf16-true"
    miss = json.loads(run("fit", "llama-3.1-70b", "--gpu", "rtx-4090", "--lora", "16", "--json",
                          timeout=300).stdout)["closest_miss"]
    assert miss["recipe"]["lora_targets"] == ["self_attn.q_proj", "self_attn.v_proj"]


def test_held_zero_without_precision_starts_from_bf16_master(run):
    """Under ZeRO the default precision is DeepSpeed's bf16 mode (bf16-master), in estimate and
    in fit; fit then searches the ZeRO precisions with the wrapper held."""
    e = json.loads(run("estimate", "qwen3-0.6b", "--gpus", "2", "--parallel", "zero2", "--seq", "128", "--json").stdout)
    assert e["recipe"]["precision"] == "bf16-master"
    r = run("fit", "qwen3-0.6b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "512", "--global-batch", "16",
            "--parallel", "zero2", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["plans"] and j["baseline"]["recipe"]["precision"] == "bf16-master"
    assert {p["recipe"]["parallel"] for p in j["plans"]} == {"zero2"}
    assert {p["recipe"]["precision"] for p in j["plans"]} <= {"fp32", "bf16-master"}


@pytest.mark.parametrize("args,message", [
    (["fit", "gpt2", "--gpu", "cpu"], "no memory to plan for"),
    (["fit", "gpt2", "--gpus", "3", "--global-batch", "8"], "8 sequences do not split over 3 data-parallel GPUs, and "
     "the engine models this recipe neither as a pipeline nor as tensor parallelism over 3 GPUs"),
    (["fit", "mistral-7b-v0.3", "--gpus", "4", "--global-batch", "6", "--parallel", "fsdp"],
     "6 sequences do not split over 4 data-parallel GPUs, and the --parallel given keeps the data-parallel wrapper"),
    (["fit", "gpt2", "--gpus", "2", "--parallel", "fsdp", "--optimizer", "adafactor"], "optimizer: adafactor under parallel fsdp"),
    (["fit", "gpt2", "--batch", "3", "--global-batch", "8"], "not a multiple of batch 3"),
    (["fit", "gpt2", "--global-batch", "x"], "global_batch: must be a positive integer"),
    (["fit", "gpt2", "--top", "0"], "top: must be between 1 and 1000"),
    (["fit", "no-such-model"], "unknown model"),
])
def test_bad_fit_requests(run, args, message):
    r = run(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert message in r.stderr and r.stderr.count("\n") == 1


def test_python_fit_matches_the_cli(run):
    f = trainmem.fit("qwen3-0.6b", gpu="a10g-24gb", seq=1024, global_batch=8, top=3)
    j = json.loads(run("fit", "qwen3-0.6b", "--gpu", "a10g-24gb", "--seq", "1024", "--global-batch", "8",
                       "--top", "3", "--json", timeout=120).stdout)
    assert f.plans == j["plans"]
    assert f.capacity_bytes == j["capacity_bytes"]
    assert "usable per GPU" in str(f)
    held = trainmem.fit("gpt2", gpu="a10g-24gb", seq=512, global_batch=4, optimizer="sgd", top=2)
    assert {p["recipe"]["optimizer"] for p in held.plans} == {"sgd"}
    with pytest.raises(ValueError, match="gpus"):
        trainmem.fit("gpt2", gpus=0)
    with pytest.raises(ValueError, match="unknown recipe knob"):
        trainmem.fit("gpt2", micro_batch=2)


def test_python_fit_takes_the_host_memory(run):
    # host_memory_gib is the CLI's --host-memory: the same budget, the same plans (Note [Host
    # memory in the planner]); an offloaded plan carries its rank's host bytes.
    kw = dict(gpus=2, parallel="zero3", precision="bf16-master", offload="both", seq=256, top=1)
    f = trainmem.fit("gpt2", host_memory_gib=64, **kw)
    j = json.loads(run("fit", "gpt2", "--gpus", "2", "--parallel", "zero3", "--precision", "bf16-master",
                       "--offload", "both", "--seq", "256", "--top", "1", "--host-memory", "64", "--json").stdout)
    assert f.host_capacity_bytes == j["host_capacity_bytes"] == 64 << 30
    assert f.plans == j["plans"] and f.plans[0]["host_bytes"] > 0
    assert trainmem.fit("gpt2", **kw).host_capacity_bytes == 128 << 30
    for bad in (0, -1, 2**21, 1.5, True):
        with pytest.raises(ValueError, match="host_memory"):
            trainmem.fit("gpt2", host_memory_gib=bad, **kw)


def test_what_it_takes_and_the_closest_miss_hold_the_least(run):
    """Neither `fits_on`'s gate nor a floor-only closest miss picks the recipe that holds more: on
    two RTX 4090s an A100-40GB fits Llama-3.1-8B under FSDP2 or TP (the gate was a DDP recipe,
    the one wrapper that takes the fused loss, whose floor holds every weight), and the closest
    miss among equal floors is the smallest micro-batch with checkpointing (the fastest one,
    no checkpointing, needs seven times the memory)."""
    j = json.loads(run("fit", "llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "2", "--offload", "none", "--json",
                       timeout=120).stdout)
    assert not j["plans"]
    there = {f["gpu"]: f for f in j["fits_on"]}
    assert "a100-40gb" in there and there["a100-40gb"]["recipe"].get("parallel", "none") != "ddp"
    j = json.loads(run("fit", "llama-3.1-8b", "--gpu", "rtx-4090", "--seq", "4096", "--global-batch", "8", "--json",
                       timeout=120).stdout)
    miss = j["closest_miss"]
    assert miss["lower_bound"] and (miss["recipe"]["batch"], miss["recipe"]["checkpointing"]) == (1, "full")


def test_typed_sequence_parallelism_is_held(run):
    j = json.loads(run("fit", "llama-3.2-1b", "--gpus", "2", "--tp", "2", "--sequence-parallel", "--global-batch", "8",
                       "--top", "1000", "--json", timeout=120).stdout)
    assert j["plans"] and all(p["recipe"]["sequence_parallel"] for p in j["plans"])


def test_single_changes_say_what_they_drop(run):
    """A change to a pipeline, a tensor-parallel group or a ring drops a held offload and says so;
    a moved pipeline baseline's batch change re-picks its schedule as the search does."""
    j = json.loads(run("fit", "qwen3-0.6b", "--gpus", "4", "--offload", "optimizer", "--global-batch", "16", "--json",
                       timeout=120).stdout)
    dropped = [c for c in j["changes"] if c["recipe"].get("offload", "none") == "none"]
    assert dropped and all("offload none" in c["change"] for c in dropped), [c["change"] for c in dropped]
    j = json.loads(run("fit", "mistral-7b-v0.3", "--gpus", "4", "--global-batch", "6", "--json", timeout=120).stdout)
    assert j["baseline"]["recipe"]["pp"] == 4
    assert "batch 2 x grad_accum 3, pp_schedule gpipe" in [c["change"] for c in j["changes"]]


def test_an_empty_global_batch_is_an_error(run):
    r = run("fit", "gpt2", "--global-batch", "")
    assert r.returncode == 2 and "global_batch: must be a positive integer, got ''" in r.stderr


def test_a_batch_that_does_not_divide_the_share_names_the_ranks(run):
    r = run("fit", "gpt2", "--gpus", "2", "--batch", "2", "--global-batch", "2")
    assert r.returncode == 2
    assert "global_batch: 2 is not a multiple of batch 2 times the 2 data-parallel ranks (1 each)" in r.stderr
    r = run("fit", "llama-3.2-1b", "--gpus", "4", "--tp", "4", "--batch", "2", "--global-batch", "3")
    assert r.returncode == 2 and r.stderr.strip().endswith("global_batch: 3 is not a multiple of batch 2")


def test_a_global_batch_and_an_accumulation_are_not_both_taken():
    """With a global batch the planner chooses the accumulation; a grad_accum beside it would be
    dropped without a word, so it is refused (as the CLI refuses --grad-accum with --global-batch)."""
    with pytest.raises(ValueError, match="grad_accum: with global_batch the planner chooses the accumulation"):
        trainmem.fit("qwen3-0.6b", seq=256, grad_accum=1024, global_batch=1)
