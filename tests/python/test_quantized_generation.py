"""generate() with bitsandbytes 4-bit and 8-bit (LLM.int8) weights: the knobs on both sides, and
tiny real CPU measurements the engine must reproduce to the byte (`trainmem compare`).

The model is a tiny Llama written to a config.json, so the engine reads exactly what was measured
(Notes [Quantized generation] and [LLM.int8] in src/graph/quant.h).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, RecipeError  # noqa: E402
from trainmem.measure.cli import main  # noqa: E402
from conftest import QUANT_LLAMA  # noqa: E402
from trainmem.measure.models import ModelSpec, build_real_model, quant_state_tensors  # noqa: E402


@pytest.mark.parametrize("knobs,message", [
    (dict(load_in_8bit=True), "load_in_8bit: training with 8-bit (LLM.int8) weights is not modelled"),
    (dict(mode="inference", load_in_8bit=True, load_in_4bit=True), "load_in_8bit and load_in_4bit cannot both be set"),
    (dict(mode="inference", load_in_8bit=1), "load_in_8bit must be true or false"),
    (dict(mode="inference", load_in_4bit=True, lora_rank=8), "inference with adapters is not measured"),
])
def test_measure_recipe_rejects(knobs, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Recipe(**knobs)


def test_measure_recipe_keys():
    assert "load_in_8bit" not in Recipe(mode="inference").as_dict()
    r = Recipe(mode="inference", load_in_8bit=True)
    assert r.precision == "bf16-true" and r.as_dict()["load_in_8bit"] is True
    d = Recipe(mode="inference", load_in_4bit=True, bnb_4bit_quant_type="nf4").as_dict()
    assert d["load_in_4bit"] is True and "load_in_8bit" not in d


def test_8bit_build_holds_int8_weights_and_row_scales():
    spec = ModelSpec("tiny-llama", dict(QUANT_LLAMA), "test")
    model = build_real_model(spec, Recipe(mode="inference", batch=1, seq=8, load_in_8bit=True), "cpu")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.int8
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16  # nothing cast to fp32 for inference
    assert dtypes["lm_head.weight"] == torch.bfloat16              # transformers keeps lm_head
    scb = dict(quant_state_tensors(model))
    assert len(scb) == 2 * 7
    down = scb["model.layers.0.mlp.down_proj.weight.SCB"]
    assert down.dtype == torch.float32 and down.numel() == 128  # one absmax per output row


@pytest.mark.parametrize("argv", [
    ["--load-in-8bit"],
    ["--load-in-8bit", "--precision", "fp16-true", "--beams", "2"],
    ["--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant"],
    ["--load-in-4bit", "--precision", "fp32", "--beams", "3"],
])
def test_tiny_generation_matches_the_engine_to_the_byte(tmp_path, quant_llama_path, trainmem_bin, capsys, argv):
    assert main([quant_llama_path, "--inference", "--batch", "2", "--seq", "8", "--new-tokens", "3", *argv, "--json"]) == 0
    measured = tmp_path / "m.json"
    measured.write_text(capsys.readouterr().out)
    out = subprocess.run([trainmem_bin, "compare", str(measured), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    c = json.loads(out.stdout)
    assert c["recipe"]["mode"] == "inference"
    assert c["recipe"].get("load_in_8bit", False) == ("--load-in-8bit" in argv)
    assert c["measured_peak_allocated_bytes"] == c["predicted_peak_allocated_bytes"]
    for cat, v in c["categories"].items():
        assert v["measured"] == v["predicted"], (cat, v)


def test_engine_cli_8bit_flags(run):
    r = run("estimate", "llama-3.2-1b", "--inference", "--load-in-8bit", "--seq", "256", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recipe"]["load_in_8bit"] is True
    plain = json.loads(run("estimate", "llama-3.2-1b", "--inference", "--json").stdout)["recipe"]
    assert "load_in_8bit" not in plain
    r = run("estimate", "llama-3.2-1b", "--load-in-8bit")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("trainmem: error: load_in_8bit: training with 8-bit (LLM.int8) weights is not modelled; "
                        "use it with mode inference, or load_in_4bit with LoRA (QLoRA) to train\n")
    # Biased linear layers (Qwen2's q/k/v) are quantized too (Note [Quantized linear biases]).
    r = run("estimate", "qwen2.5-0.5b", "--inference", "--load-in-8bit", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["recipe"]["load_in_8bit"] is True


def test_quantized_weights_against_bf16(run):
    """Llama-3.2-1B's decoder layers hold 973,078,528 linear weights (16 layers); 8-bit stores 1 B
    each plus 4 B per output row instead of 2 B; 4-bit nf4 with double quant about 0.516 B."""
    def weights(*flags):
        r = run("estimate", "llama-3.2-1b", "--inference", "--seq", "64", "--new-tokens", "4", *flags, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["breakdown_at_peak"]["weights"]
    linear = 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048)
    rows = 16 * (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048)  # output features: q k v o gate up down
    assert linear == 973_078_528
    assert weights() - weights("--load-in-8bit") == 2 * linear - (linear + 4 * rows)
    saved = weights() - weights("--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant")
    assert 1.43 * linear < saved < 1.49 * linear, saved / linear



def test_measuring_side_pins_generic_cpu_kernels():
    """Note [bitsandbytes' CPU kernels]: importing trainmem.measure before torch caps torch's CPU
    kernels at AVX2, so bitsandbytes registers no torch._int_mm kernel and CPU ground truth is the
    same on every machine; a 4-bit layer is kept from repacking its weight."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ATEN_CPU_CAPABILITY"}
    root = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path.insert(0, 'tools'); from measure_common import load_measure; load_measure(); "
            "import torch; print(torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] != "AVX512"
    spec = ModelSpec("tiny-llama", dict(QUANT_LLAMA), "test")
    model = build_real_model(spec, Recipe(mode="inference", batch=1, seq=8, load_in_4bit=True), "cpu")
    flags = [m.support_avx512bf16_for_cpu for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert flags and not any(flags)
