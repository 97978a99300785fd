"""QLoRA (a bitsandbytes 4-bit base with peft adapters): the knobs on both sides, and a tiny real
CPU measurement the engine must reproduce to the byte (`trainmem compare`).

The model is a tiny Llama written to a config.json, so the engine reads exactly what was measured.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, RecipeError, measure  # noqa: E402
from trainmem.measure.cli import main  # noqa: E402
from conftest import QUANT_LLAMA  # noqa: E402
from trainmem.measure.models import ModelSpec, build_real_model, quant_state_tensors  # noqa: E402


@pytest.mark.parametrize("knobs,message", [
    (dict(load_in_4bit=True), "load_in_4bit: a 4-bit base model cannot be trained itself; add LoRA adapters"),
    (dict(mode="inference", load_in_4bit=True, precision="bf16-mixed"),
     "precision='bf16-mixed' with load_in_4bit is not measured"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-true", bnb_4bit_quant_type="int4"),
     "bnb_4bit_quant_type='int4' is not one of fp4, nf4"),
    (dict(bnb_4bit_use_double_quant=True), "set without load_in_4bit"),
    (dict(lora_rank=8, load_in_4bit=1, precision="bf16-true"), "load_in_4bit must be true or false"),
    (dict(load_dtype="fp16", precision="fp16-mixed"), "GradScaler refuses fp16 gradients"),
    (dict(load_dtype="bf16", precision="bf16-true"), "it needs precision bf16-mixed"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-mixed", prepare_kbit_training=False),
     "needs load_in_4bit and load_dtype bf16 or fp16"),
    (dict(lora_rank=8, precision="bf16-mixed", load_dtype="bf16", prepare_kbit_training=False),
     "needs load_in_4bit and load_dtype bf16 or fp16"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-mixed", load_dtype="bf16", prepare_kbit_training=0),
     "prepare_kbit_training must be true or false"),
    (dict(lora_rank=8, precision="bf16-true", load_dtype="bf16"), "it needs precision bf16-mixed"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-true", load_dtype="bf16"), "it needs precision bf16-mixed"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-mixed", load_dtype="fp16"), "it needs precision fp16-mixed"),
    (dict(lora_rank=8, load_in_4bit=True, precision="bf16-mixed", load_dtype="fp8"),
     "load_dtype='fp8' is not one of auto, bf16, fp16"),
])
def test_measure_recipe_rejects(knobs, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Recipe(**knobs)


def test_recipe_keys_only_with_a_4bit_base():
    assert "load_in_4bit" not in Recipe().as_dict()
    d = Recipe(precision="bf16-true", lora_rank=8, load_in_4bit=True, bnb_4bit_quant_type="nf4",
               bnb_4bit_use_double_quant=True).as_dict()
    assert (d["load_in_4bit"], d["bnb_4bit_quant_type"], d["bnb_4bit_use_double_quant"]) == (True, "nf4", True)
    assert "load_dtype" not in d  # auto, as the engine writes it: only when it is not the precision's
    d = Recipe(precision="bf16-mixed", lora_rank=8, load_in_4bit=True, load_dtype="bf16").as_dict()
    assert d["load_dtype"] == "bf16"


def test_measure_cli_qlora_needs_lora(capsys, quant_llama_path):
    assert main([quant_llama_path, "--seq", "8", "--precision", "bf16-true", "--qlora"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add LoRA adapters (lora_rank > 0): that is QLoRA" in err


def test_quantized_build_is_what_prepare_model_for_kbit_training_leaves():
    spec = ModelSpec("tiny-llama", dict(QUANT_LLAMA), "test")
    recipe = Recipe(batch=1, seq=8, precision="bf16-true", lora_rank=4, load_in_4bit=True,
                    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = build_real_model(spec, recipe, "cpu")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["base_model.model.model.layers.0.mlp.down_proj.weight"] == torch.uint8
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.float32  # upcast by prepare
    assert dtypes["base_model.model.lm_head.weight"] == torch.float32
    assert dtypes["base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    states = dict(quant_state_tensors(model))
    key = "base_model.model.model.layers.0.mlp.down_proj.weight.quant_state"
    blocks = -(-128 * 320 // 64)
    assert states[key + ".absmax"].dtype == torch.uint8 and states[key + ".absmax"].numel() == blocks
    assert states[key + ".code"].numel() == 16 and states[key + ".state2.code"].numel() == 256
    assert states[key + ".state2.absmax"].numel() == -(-blocks // 256)
    assert len(states) == 2 * 7 * 5  # 2 layers x 7 projections x (absmax, code, offset, nested absmax, nested code)


@pytest.mark.parametrize("argv", [
    ["--precision", "bf16-true", "--qlora", "--checkpointing", "full"],
    ["--precision", "bf16-true", "--load-in-4bit", "--bnb-4bit-quant-type", "fp4", "--lora-targets", "all-linear"],
    ["--precision", "fp16-true", "--load-in-4bit", "--bnb-4bit-use-double-quant", "--lora-dropout", "0.1"],
    ["--precision", "fp32", "--qlora", "--checkpointing", "full", "--lora-targets", "all-linear",
     "--optimizer", "adamw-8bit"],
])
def test_tiny_measurement_matches_the_engine_to_the_byte(tmp_path, quant_llama_path, trainmem_bin, capsys, argv):
    assert main([quant_llama_path, "--batch", "2", "--seq", "8", "--lora", "4", *argv, "--json"]) == 0
    measured = tmp_path / "m.json"
    measured.write_text(capsys.readouterr().out)
    out = subprocess.run([trainmem_bin, "compare", str(measured), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    c = json.loads(out.stdout)
    assert c["recipe"]["load_in_4bit"] is True
    assert c["measured_peak_allocated_bytes"] == c["predicted_peak_allocated_bytes"]
    for cat, v in c["categories"].items():
        assert v["measured"] == v["predicted"], (cat, v)


def test_engine_cli_qlora_flags(run):
    r = run("estimate", "llama-3.2-1b", "--lora", "8", "--qlora", "--precision", "bf16-true", "--seq", "256", "--json")
    assert r.returncode == 0, r.stderr
    recipe = json.loads(r.stdout)["recipe"]
    assert (recipe["load_in_4bit"], recipe["bnb_4bit_quant_type"], recipe["bnb_4bit_use_double_quant"]) == \
        (True, "nf4", True)
    r = run("estimate", "llama-3.2-1b", "--lora", "8", "--load-in-4bit", "--precision", "bf16-true", "--json")
    assert json.loads(r.stdout)["recipe"]["bnb_4bit_quant_type"] == "fp4"  # transformers' default
    plain = json.loads(run("estimate", "llama-3.2-1b", "--json").stdout)["recipe"]
    assert "load_in_4bit" not in plain
    r = run("estimate", "llama-3.2-1b", "--qlora", "--precision", "bf16-true")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("trainmem: error: load_in_4bit: a 4-bit base model cannot be trained itself; add LoRA "
                        "adapters (lora_rank > 0): that is QLoRA\n")


def test_4bit_base_saves_weights_against_plain_lora(run):
    def weights(*flags):
        r = run("estimate", "llama-3.1-8b", "--lora", "16", "--precision", "bf16-true", "--seq", "512", *flags, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["breakdown_at_peak"]["weights"]
    # The decoder layers' 6.98 B linear weights go from 2 B to ~0.516 B each (-10.36 GB); the
    # embeddings and lm_head become fp32 (2 x 525 M x 2 B more, +2.10 GB).
    saved = weights() - weights("--qlora")
    assert 8.1e9 < saved < 8.4e9, saved
