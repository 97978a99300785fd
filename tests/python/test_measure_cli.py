"""`trainmem-measure`: flags, exit codes, JSON keys (docs/schema.md), --trace, --fake."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure.cli import main  # noqa: E402

SCHEMA_KEYS = {"model", "parameters", "trainable_parameters", "peak_allocated_bytes", "peak_reserved_bytes",
               "breakdown_at_peak", "peak", "steps", "device", "recipe", "source", "versions", "command"}
CATEGORIES = ["weights", "optimizer_states", "gradients", "activations", "temporaries", "other"]
RECIPE_KEYS = {"batch", "seq", "grad_accum", "precision", "optimizer", "checkpointing", "attention", "loss", "gpu",
               "allocator", "lora_rank", "mode"}  # lora_targets and lora_dropout only with lora_rank > 0


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 256, "tie_word_embeddings": True}))
    return path


@pytest.mark.parametrize("argv,message", [
    (["nope"], "unknown model 'nope'"),
    (["gpt2", "--batch", "0"], "batch must be an integer >= 1, got 0"),
    (["gpt2", "--batch", "x"], "argument --batch: invalid int value: 'x'"),
    (["gpt2", "--precision", "int3"], "argument --precision: invalid choice: 'int3'"),
    (["gpt2", "--attention", "flash"], "attention=flash (flash_attention_2) runs on a real CUDA device only"),
    (["gpt2", "--attention-mask", "left"], "argument --attention-mask: invalid choice: 'left'"),
    (["gpt2", "--new-tokens", "10"], "new_tokens=10 is the tokens a generation adds"),
    (["gpt2", "--inference", "--optimizer", "sgd"], "optimizer='sgd': inference runs no optimizer"),
    (["gpt2", "--lora-targets", "c_attn"], "lora_targets is set without lora_rank"),
    (["gpt2", "--attention-mask", "padded", "--seq", "1"], "attention_mask='padded' needs seq >= 2"),
    (["gpt2", "--attention-mask", "ones", "--inference"], "attention_mask='ones' is a training knob"),
    (["gpt2", "--qlora", "--bnb-4bit-quant-type", "fp4", "--lora", "8"],
     "--qlora is an nf4 base with double quant; for fp4 use --load-in-4bit"),  # as trainmem estimate says
    ([], "the following arguments are required: model"),
    # The engine's ranges: past them a run would take hours or fail inside torch.
    (["gpt2", "--grad-accum", "1025", "--fake"], "grad_accum must be between 1 and 1024, got 1025"),
    (["gpt2", "--seq", "99999999999", "--fake"], "seq must be between 1 and 16777216"),
    (["gpt2", "--batch", "16777217", "--fake"], "batch must be between 1 and 16777216"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainmem-measure: error: ")
    assert message in err


def test_json_has_the_schema_keys(capsys, tiny_config, tmp_path):
    trace = tmp_path / "events.jsonl"
    argv = [str(tiny_config), "--batch", "2", "--seq", "8", "--precision", "bf16-mixed", "--checkpointing", "full",
            "--json", "--trace", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert SCHEMA_KEYS <= set(out)
    assert list(out["breakdown_at_peak"]) == CATEGORIES
    assert sum(out["breakdown_at_peak"].values()) == out["peak_allocated_bytes"]
    assert set(out["recipe"]) == RECIPE_KEYS and out["recipe"]["checkpointing"] == "full"
    assert {"step", "micro_batch", "phase", "op"} <= set(out["peak"])
    assert [s["step"] for s in out["steps"]] == [1, 2]
    assert out["source"] == "measured-cpu" and out["recipe"]["gpu"] == "cpu"
    assert out["command"].startswith("trainmem-measure ") and "--checkpointing full" in out["command"]
    assert {"torch", "transformers"} <= set(out["versions"])
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == out["diagnostics"]["events"]
    assert max(r["live_bytes"] for r in rows) == out["peak_allocated_bytes"]
    assert {r["category"] for r in rows} <= set(CATEGORIES)


def test_fake_catalog_model(capsys):
    assert main(["gpt2", "--batch", "1", "--seq", "32", "--fake", "--json", "--optimizer", "sgd"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "measured-fake" and out["model"] == "gpt2"
    assert out["parameters"] == 124439808
    # gpt2 ties lm_head to wte: 124,439,808 fp32 parameters plus the fp32 momentum buffers are alive at the peak
    assert out["breakdown_at_peak"]["weights"] >= 4 * 124439808


def test_text_output(capsys, tiny_config):
    assert main([str(tiny_config), "--batch", "1", "--seq", "8", "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    assert "peak allocated" in text and "measured-cpu" in text


def test_python_dash_m_runs_when_the_package_is_installed(tiny_config):
    probe = subprocess.run([sys.executable, "-c", "import trainmem.measure.cli"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("trainmem is not importable without the source-tree loader (package not installed)")
    run = subprocess.run([sys.executable, "-m", "trainmem.measure", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "unknown model 'nope'" in run.stderr


def test_what_libraries_print_during_the_measurement_goes_to_stderr(monkeypatch, capfd):
    """A library printing to standard output while the step runs (DeepSpeed's "Setting accelerator
    to CPU" on import, also from spawned ranks) must not spoil --json: descriptor 1 is standard
    error until the result is printed."""
    import os

    from trainmem.measure import run

    def noisy_measure(*args, **kwargs):
        print("[WARNING] a library talking")
        os.write(1, b"a child process talking\n")
        return {"model": "x", "peak_allocated_bytes": 1}

    monkeypatch.setattr(run, "measure", noisy_measure)
    assert main(["gpt2", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"model": "x", "peak_allocated_bytes": 1}, (out, err)
    assert "a library talking" in err and "a child process talking" in err


def test_gemma2_takes_sdpa_as_eager_as_the_estimate_does():
    """transformers refuses attn_implementation="sdpa" for Gemma-2 and loads it eager by default;
    both sides take sdpa as eager there (Note [Gemma-2's attention] in src/estimate.cpp)."""
    from trainmem.measure.models import ModelSpec, resolved_for_model
    from trainmem.measure.recipe import Recipe

    gemma = ModelSpec("g", {"model_type": "gemma2"}, "test")
    assert resolved_for_model(gemma, Recipe(attention="sdpa")).attention == "eager"
    assert resolved_for_model(gemma, Recipe(attention="eager")).attention == "eager"
    llama = ModelSpec("l", {"model_type": "llama"}, "test")
    assert resolved_for_model(llama, Recipe(attention="sdpa")).attention == "sdpa"


def test_gpt2_past_its_positions_is_refused_as_the_estimate_refuses_it():
    from trainmem.measure.models import ModelSpec, resolved_for_model
    from trainmem.measure.recipe import Recipe, RecipeError

    gpt2 = ModelSpec("g", {"model_type": "gpt2", "n_positions": 1024}, "test")
    assert resolved_for_model(gpt2, Recipe(seq=1024)).seq == 1024
    with pytest.raises(RecipeError, match="1025 positions .* past the model's 1024"):
        resolved_for_model(gpt2, Recipe(seq=1025))
    assert resolved_for_model(gpt2, Recipe(mode="inference", precision="fp32", seq=1000, new_tokens=25)).seq == 1000
    with pytest.raises(RecipeError, match="and 26 new tokens"):
        resolved_for_model(gpt2, Recipe(mode="inference", precision="fp32", seq=1000, new_tokens=26))


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "64"}, "transformers cannot build a config for model_type='llama'"),
    ({"model_type": "llama\nsecond line"}, "model_type must be a name"),
    ({"num_hidden_layers": 2**40}, "num_hidden_layers must be between 1 and 100000"),
    ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, "rope_type 'bogus' is not one transformers knows"),
])
def test_a_config_transformers_refuses_is_one_line_and_exit_2(capsys, tmp_path, change, message):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("kept\n")
    assert main([str(path), "--fake", "--seq", "8", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert trace.read_text() == "kept\n"  # a refused command leaves the trace file as it was
