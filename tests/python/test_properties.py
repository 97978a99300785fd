"""Properties of trainmem.estimate over random valid models and recipes (hypothesis).

Models are random config.json dicts of every supported family (llama, mistral, qwen2, qwen3,
gemma2, phi3, gpt2) with small shapes, written to files; recipes draw every knob. What must hold:

* the categories of breakdown_at_peak sum to peak_allocated_bytes;
* reserved >= allocated, at the peak, per step and on every timeline point;
* peak_allocated_bytes never decreases when batch or seq grows. This holds with expandable
  segments; with the default allocator it does NOT (a finding, kept as a strict xfail with the
  shrunk counterexamples: see _BATCH_COUNTEREXAMPLE);
* the activations live at the start of backward never grow with checkpointing=full (needs the
  Estimate to expose that moment: skipped until it does, and checked by tests/fuzz/fuzz_recipe
  on the graph stage meanwhile);
* the result is a function of the input: repeated calls agree, and the CLI's --json prints the
  same object as the Python API.

peak_reserved_bytes is NOT monotone in batch or seq, and no test claims it is: the caching
allocator sizes a segment by the request (20 MiB for a large request under 10 MiB, the request
rounded up to 2 MiB above), so larger tensors can pack into fewer reserved bytes.
test_reserved_can_shrink_when_seq_grows pins one such case.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

trainmem = pytest.importorskip("trainmem")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPS = settings(max_examples=100, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PRECISIONS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true", "fp16-true"]
OPTIMIZERS = ["adamw", "adamw-fused", "adamw-8bit", "sgd", "adafactor"]
ATTENTION = ["sdpa", "eager", "flash"]
GPUS = ["h100-80gb", "cpu", "t4-16gb"]
CATEGORIES = ("weights", "optimizer_states", "gradients", "activations", "temporaries", "other")

# Configs are files because the engine reads models from paths; one directory for the module
# (made on first use, removed by teardown_module), one file per distinct config (named by its
# hash, so equal configs share a path and a name).
_CONFIG_DIR: Path | None = None


def config_path(cfg: dict) -> str:
    global _CONFIG_DIR
    if _CONFIG_DIR is None:
        _CONFIG_DIR = Path(tempfile.mkdtemp(prefix="trainmem-props-"))
    text = json.dumps(cfg, sort_keys=True)
    p = _CONFIG_DIR / (hashlib.sha1(text.encode()).hexdigest()[:16] + ".json")
    if not p.exists():
        p.write_text(text)
    return str(p)


@st.composite
def configs(draw) -> dict:
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2"]))
    # Small and mid-sized shapes: tensors under 1 MiB live in the allocator's small pool, larger
    # ones in the large pool, whose blocks are split (or not) by other rules.
    heads = draw(st.integers(1, 16))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    # transformers refuses an odd rotary head_dim above 4 (validate_rope); GPT-2 has no rotary.
    head_dim = draw(st.integers(1, 16).map(lambda h: 2 * h) | st.sampled_from([1, 3, 64, 128]))
    if family == "gpt2":
        head_dim = draw(st.integers(1, 32)) if draw(st.booleans()) else head_dim
    layers = draw(st.integers(1, 3))
    vocab = draw(st.integers(1, 3000) | st.integers(3000, 160000))
    inter = draw(st.integers(1, 256) | st.integers(256, 8192))
    if family == "gpt2":
        cfg = {"model_type": "gpt2", "n_embd": heads * head_dim, "n_head": heads, "n_layer": layers,
               # Room for the longest drawn seq (600, and 200 more in the seq test): a position past
               # n_positions is refused, as transformers' position embedding fails on it.
               "n_positions": draw(st.integers(800, 2048)), "vocab_size": vocab}
        if draw(st.booleans()):
            cfg["n_inner"] = inter
    else:
        cfg = {"model_type": family, "num_attention_heads": heads, "num_key_value_heads": kv,
               "num_hidden_layers": layers, "intermediate_size": inter, "vocab_size": vocab}
        if draw(st.booleans()):  # an explicit head_dim frees hidden_size from heads * head_dim
            cfg["head_dim"] = head_dim
            cfg["hidden_size"] = draw(st.integers(1, 2048))
        else:
            cfg["hidden_size"] = heads * head_dim
        if family in ("llama", "qwen3", "gemma2") and draw(st.booleans()):
            cfg["attention_bias"] = draw(st.booleans())
        if family == "llama" and draw(st.booleans()):
            cfg["mlp_bias"] = draw(st.booleans())
        if family == "gemma2":
            cfg["attn_logit_softcapping"] = draw(st.sampled_from([None, 0.0, 50.0]))
            # (transformers refuses a final soft-cap of 0; None turns it off)
            cfg["final_logit_softcapping"] = draw(st.sampled_from([None, 30.0]))
        if family == "phi3":  # Phi3Config's pad_token_id is 32000, which a smaller vocabulary cannot hold
            cfg["pad_token_id"] = None
    if draw(st.booleans()):
        cfg["tie_word_embeddings"] = draw(st.booleans())
    cfg["torch_dtype"] = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    return cfg


@st.composite
def recipes(draw) -> dict:
    return {
        "batch": draw(st.integers(1, 4)),
        "seq": draw(st.integers(1, 600)),
        "grad_accum": draw(st.integers(1, 2)),
        "precision": draw(st.sampled_from(PRECISIONS)),
        "optimizer": draw(st.sampled_from(OPTIMIZERS)),
        "checkpointing": draw(st.sampled_from(["none", "full"])),
        "attention": draw(st.sampled_from(ATTENTION)),
        "loss": draw(st.sampled_from(["standard", "fused"])),
        "gpu": draw(st.sampled_from(GPUS)),
        "allocator": draw(st.sampled_from(["default", "expandable"])),
    }


def for_model(cfg: dict, recipe: dict) -> dict:
    """The drawn recipe as the model takes it: Gemma-2 refuses flash (Note [Gemma-2's attention]),
    and so do the CPU replay, GPUs older than Ampere (flash-attn 2 needs sm80+) and fp32."""
    no_flash = (cfg.get("model_type") == "gemma2" or recipe.get("gpu") in ("cpu", "t4-16gb")
                or recipe.get("precision") == "fp32")
    if recipe.get("attention") == "flash" and no_flash:
        return {**recipe, "attention": "eager" if cfg.get("model_type") == "gemma2" else "sdpa"}
    return recipe


def run(cfg: dict, recipe: dict, **extra):
    return trainmem.estimate(config_path(cfg), **{**for_model(cfg, recipe), **extra})


# ---- accounting ------------------------------------------------------------------------------

@PROPS
@given(configs(), recipes())
def test_categories_sum_to_the_peak(cfg, recipe):
    est = run(cfg, recipe)
    assert tuple(est.breakdown_at_peak) == CATEGORIES
    assert sum(est.breakdown_at_peak.values()) == est.peak_allocated_bytes
    assert est.peak_allocated_bytes > 0


@PROPS
@given(configs(), recipes())
def test_reserved_is_at_least_allocated(cfg, recipe):
    est = run(cfg, recipe, timeline=True)
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    for s in est.steps:
        assert s["peak_reserved_bytes"] >= s["peak_allocated_bytes"]
    assert max(s["peak_allocated_bytes"] for s in est.steps) == est.peak_allocated_bytes
    assert max(s["peak_reserved_bytes"] for s in est.steps) == est.peak_reserved_bytes
    assert est.timeline
    for p in est.timeline:
        assert p["reserved_bytes"] >= p["allocated_bytes"]
        assert p["allocated_bytes"] <= est.peak_allocated_bytes
        assert p["reserved_bytes"] <= est.peak_reserved_bytes


# ---- monotonicity ------------------------------------------------------------------------------

# Found by hypothesis (shrunk): with the default allocator a larger batch or sequence can LOWER
# peak_allocated_bytes. At both peaks (step 2, optimizer.foreach_sqrt) the tensors are the same
# sizes; what differs is where an earlier, batch-sized tensor left the large pool's cached
# blocks: a parameter-sized gradient reuses a cached block whose remainder is <= 1 MiB, which
# PyTorch does not split and charges whole (allocated_bytes grows by block->size). The engine
# replays that rule faithfully, so this is the allocator's behaviour, not an engine bug, and
# torch.cuda.max_memory_allocated() can do the same. With expandable segments every block is
# split and allocated = sum of rounded request sizes, so there the property holds.
_BATCH_COUNTEREXAMPLE = (
    {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
     "intermediate_size": 6485, "vocab_size": 1, "hidden_size": 128, "torch_dtype": "float32"},
    {"batch": 2, "seq": 27, "grad_accum": 1, "precision": "bf16-mixed", "optimizer": "adamw",
     "checkpointing": "none", "attention": "sdpa", "loss": "standard", "gpu": "h100-80gb"},
    1)  # batch 2 -> 3: 169754112 -> 169315328 bytes
_SEQ_COUNTEREXAMPLE = (
    {"model_type": "mistral", "num_attention_heads": 8, "num_key_value_heads": 1, "num_hidden_layers": 2,
     "intermediate_size": 1, "vocab_size": 1, "hidden_size": 1024, "torch_dtype": "float32"},
    {"batch": 2, "seq": 129, "grad_accum": 1, "precision": "fp32", "optimizer": "adamw-fused",
     "checkpointing": "none", "attention": "sdpa", "loss": "standard", "gpu": "h100-80gb"},
    1)  # seq 129 -> 130: 153199104 -> 153198080 bytes (found by a scan in session 29: an earlier
# engine change made seq 142 -> 143 grow, and the search alone did not find a case every run)
_DEFAULT_NOT_MONOTONE = pytest.mark.xfail(
    strict=True, reason="finding: the default caching allocator charges unsplit blocks whole, so "
                        "peak_allocated_bytes is not monotone in batch/seq (see the counterexamples)")
ALLOCATORS = ["expandable", pytest.param("default", marks=_DEFAULT_NOT_MONOTONE)]


@pytest.mark.parametrize("allocator", ALLOCATORS)
@PROPS
@given(configs(), recipes(), st.integers(1, 3))
@example(*_BATCH_COUNTEREXAMPLE)
def test_peak_allocated_never_decreases_when_batch_grows(allocator, cfg, recipe, more):
    recipe = {**recipe, "allocator": allocator}
    small = run(cfg, recipe)
    large = run(cfg, recipe, batch=recipe["batch"] + more)
    assert large.peak_allocated_bytes >= small.peak_allocated_bytes, (
        f"batch {recipe['batch']} -> {recipe['batch'] + more}: {small.peak_allocated_bytes} -> "
        f"{large.peak_allocated_bytes}; config {cfg}, recipe {recipe}")


@pytest.mark.parametrize("allocator", ALLOCATORS)
@PROPS
@given(configs(), recipes(), st.integers(1, 200))
@example(*_SEQ_COUNTEREXAMPLE)
def test_peak_allocated_never_decreases_when_seq_grows(allocator, cfg, recipe, more):
    recipe = {**recipe, "allocator": allocator}
    if recipe["gpu"] == "h100-80gb" and recipe["seq"] == 1:
        # cuDNN attention refuses one key, so a one-token step on sm90 takes flash, whose backward
        # buffers have 128 rows; at two tokens cuDNN's hold less (Note [SDPA kernels on CUDA]).
        recipe["seq"] = 2
    small = run(cfg, recipe)
    large = run(cfg, recipe, seq=recipe["seq"] + more)
    assert large.peak_allocated_bytes >= small.peak_allocated_bytes, (
        f"seq {recipe['seq']} -> {recipe['seq'] + more}: {small.peak_allocated_bytes} -> "
        f"{large.peak_allocated_bytes}; config {cfg}, recipe {recipe}")


@pytest.mark.parametrize("allocator", ["default", "expandable"])
def test_reserved_can_shrink_when_seq_grows(allocator):
    """Not a property: reserved memory is not monotone, with either allocator (see the module
    docstring). Pinned so that nobody adds the property by mistake; if the allocator model
    changes, pick another case."""
    cfg = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32000}
    peaks = [run(cfg, {"seq": s, "allocator": allocator}).peak_reserved_bytes for s in range(16, 272, 16)]
    assert any(b < a for a, b in zip(peaks, peaks[1:])), peaks


# ---- checkpointing -----------------------------------------------------------------------------

def _activations_at_backward_start(est) -> int | None:
    """The activations category live when backward starts (step 1, micro-batch 1), once the
    Estimate exposes it (proposed: breakdown_at_backward_start, same keys as breakdown_at_peak)."""
    b = getattr(est, "breakdown_at_backward_start", None)
    return None if b is None else b["activations"]


@PROPS
@given(configs(), recipes())
def test_full_checkpointing_never_adds_activations_at_backward_start(cfg, recipe):
    none = run(cfg, recipe, checkpointing="none")
    full = run(cfg, recipe, checkpointing="full")
    a_none, a_full = _activations_at_backward_start(none), _activations_at_backward_start(full)
    if a_none is None:
        pytest.skip("Estimate has no breakdown at the start of backward yet "
                    "(tests/fuzz/fuzz_recipe checks this property on the graph stage)")
    assert a_full <= a_none, f"{a_full} > {a_none}; config {cfg}, recipe {recipe}"


# ---- determinism and agreement -------------------------------------------------------------------

@settings(max_examples=25, deadline=None, derandomize=True)
@given(configs(), recipes(), st.booleans())
def test_repeatable_and_cli_agrees(trainmem_bin, cfg, recipe, timeline):
    recipe = for_model(cfg, recipe)
    path = config_path(cfg)
    a = trainmem.estimate(path, **recipe, timeline=timeline).to_dict()
    b = trainmem.estimate(path, **recipe, timeline=timeline).to_dict()
    assert a == b
    args = [trainmem_bin, "estimate", path, "--json"]
    for k, v in recipe.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    if timeline:
        args.append("--timeline")
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == a
    r2 = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r2.stdout == r.stdout


def teardown_module():
    if _CONFIG_DIR is not None:
        shutil.rmtree(_CONFIG_DIR, ignore_errors=True)
