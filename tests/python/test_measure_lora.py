"""LoRA (peft) on the measuring side: the knobs, their validation, and what a LoRA step allocates.

Tiny models, real compute on the CPU (a few seconds each).
"""

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, RecipeError, block_bytes, measure  # noqa: E402
from trainmem.measure.cli import main  # noqa: E402
from trainmem.measure.fused_loss import fused_linear_cross_entropy  # noqa: E402
from trainmem.measure.models import ModelSpec, build_real_model  # noqa: E402

SHAPES = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, pad_token_id=0),
}


def tiny(model_type: str) -> ModelSpec:
    return ModelSpec(f"tiny-{model_type}", {"model_type": model_type, **SHAPES[model_type]}, "test")


@pytest.fixture
def tiny_config(tmp_path):
    def write(model_type):
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps({"model_type": model_type, **SHAPES[model_type]}))
        return str(path)

    return write


@pytest.mark.parametrize("knobs,message", [
    (dict(lora_rank=-1), "lora_rank must be an integer between 0 (no LoRA) and 65536, got -1"),
    (dict(lora_rank=65537), "lora_rank must be an integer between 0 (no LoRA) and 65536"),
    (dict(lora_rank=True), "lora_rank must be an integer"),
    (dict(lora_rank=8, lora_dropout=1.0), "lora_dropout must be a number in [0, 1), got 1.0"),
    (dict(lora_rank=8, lora_dropout=-0.1), "lora_dropout must be a number in [0, 1)"),
    (dict(lora_dropout=0.05), "lora_dropout is set without lora_rank (no adapters)"),
    (dict(lora_rank=8, precision="bf16-master"), "precision=bf16-master cannot be combined with LoRA"),
    (dict(lora_rank=8, lora_targets="default,q_proj"), "'default' cannot be combined with module names"),
    (dict(lora_rank=8, lora_targets="q_proj,all-linear"), "'all-linear' cannot be combined with module names"),
    (dict(lora_rank=8, lora_targets="q_proj,,v_proj"), "lora_targets: empty module name in 'q_proj,,v_proj'"),
])
def test_recipe_refuses_what_the_engine_refuses(knobs, message):
    with pytest.raises(RecipeError) as e:
        Recipe(**knobs)
    assert message in str(e.value)


def test_recipe_json_keys_follow_the_engine():
    assert Recipe().as_dict()["lora_rank"] == 0
    assert "lora_targets" not in Recipe().as_dict() and "lora_dropout" not in Recipe().as_dict()
    r = Recipe(lora_rank=8, lora_dropout=0.05)
    d = r.as_dict(["self_attn.q_proj", "self_attn.v_proj"])
    assert d["lora_rank"] == 8 and d["lora_dropout"] == 0.05
    assert d["lora_targets"] == ["self_attn.q_proj", "self_attn.v_proj"]
    # the JSON's resolved list reads back as a spelling peft matches the same way
    assert Recipe.from_dict(d).lora_targets == "self_attn.q_proj,self_attn.v_proj"


@pytest.mark.parametrize("model_type,targets,expected", [
    ("llama", "default", ["self_attn.q_proj", "self_attn.v_proj"]),
    ("llama", "v_proj, q_proj", ["self_attn.q_proj", "self_attn.v_proj"]),
    ("llama", "all-linear", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
    ("gpt2", "default", ["attn.c_attn"]),
    ("gpt2", "c_proj", ["attn.c_proj", "mlp.c_proj"]),
    ("phi3", "qkv_proj,o_proj", ["self_attn.o_proj", "self_attn.qkv_proj"]),
])
def test_targets_resolve_as_peft_wraps_them(model_type, targets, expected):
    model = build_real_model(tiny(model_type), Recipe(precision="fp32", lora_rank=4, lora_targets=targets), "cpu")
    assert model.trainmem_lora_targets == expected
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


@pytest.mark.parametrize("argv,message", [
    (["--lora", "8", "--precision", "bf16-master"], "precision=bf16-master cannot be combined with LoRA"),
    (["--lora-dropout", "0.1"], "lora_dropout is set without lora_rank"),
    (["--lora", "8", "--lora-targets", "x_proj"], "'x_proj' names no linear layer of llama decoder layers"),
    (["--lora", "8", "--lora-targets", "lm_head"], "'lm_head' names no linear layer of llama decoder layers"),
    (["--lora", "x"], "argument --lora: invalid int value: 'x'"),
])
def test_cli_bad_lora_input_is_one_line_and_exit_2(capsys, tiny_config, argv, message):
    assert main([tiny_config("llama"), "--seq", "8", "--precision", "fp32", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_phi3_has_no_peft_default(capsys, tiny_config):
    assert main([tiny_config("phi3"), "--seq", "8", "--precision", "fp32", "--lora", "8"]) == 2
    err = capsys.readouterr().err
    assert "peft has no default target modules for phi3" in err and "qkv_proj" in err


def _adapters(model):
    return [p for n, p in model.named_parameters() if p.requires_grad]


def test_lora_step_grads_and_optimizer_states_cover_only_the_adapters(tmp_path):
    spec = tiny("llama")
    recipe = Recipe(batch=2, seq=8, precision="fp32", optimizer="adamw", lora_rank=4, lora_dropout=0.1)
    adapters = _adapters(build_real_model(spec, recipe, "cpu"))
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    adapter_blocks = sum(block_bytes(p.numel() * 4) for p in adapters)
    trace = tmp_path / "t.jsonl"
    result = measure(spec, recipe, trace=str(trace))
    assert result["trainable_parameters"] == sum(p.numel() for p in adapters)
    assert result["recipe"]["lora_targets"] == ["self_attn.q_proj", "self_attn.v_proj"]
    assert result["recipe"]["lora_dropout"] == 0.1
    assert "--lora 4" in result["command"] and "--lora-dropout 0.1" in result["command"]
    by_category = result["diagnostics"]["allocated_bytes_by_category"]
    assert by_category["gradients"] == 2 * adapter_blocks  # one set per step, adapter-sized
    # AdamW: exp_avg and exp_avg_sq per adapter, plus its 0-dim fp32 step counter (512 B block)
    assert by_category["optimizer_states"] == 2 * adapter_blocks + len(adapters) * 512
    assert result["diagnostics"]["freed_by_gc_bytes"] == 0
    rows = [json.loads(line) for line in open(trace)]
    ops = {r["op"] for r in rows}
    assert "layer 0 self_attn.q_proj" in ops and "layer 1 self_attn.v_proj.lora_A" in ops
    assert "layer 0 self_attn.q_proj.lora_dropout" in ops and "embed_tokens" in ops and "lm_head" in ops
    assert not any("base_layer" in op or "default" in op or "base_model" in op for op in ops)
    grads = [r for r in rows if r["event"] == "alloc" and r["category"] == "gradients"]
    assert {r["op"].rsplit(".", 1)[-1] for r in grads} == {"lora_A", "lora_B"}


def test_lora_fake_and_real_runs_record_the_same_trace(tmp_path):
    spec = tiny("llama")
    recipe = Recipe(batch=2, seq=8, precision="bf16-mixed", checkpointing="full", lora_rank=4, lora_dropout=0.1)
    real = measure(spec, recipe, trace=str(tmp_path / "real.jsonl"))
    fake = measure(spec, recipe, fake=True, trace=str(tmp_path / "fake.jsonl"))
    for key in ("peak_allocated_bytes", "breakdown_at_peak", "peak", "steps", "recipe", "trainable_parameters"):
        assert real[key] == fake[key], key


def test_frozen_weights_under_autocast_are_cast_at_every_use(tmp_path):
    spec = tiny("llama")
    trace = tmp_path / "t.jsonl"
    measure(spec, Recipe(batch=1, seq=8, precision="bf16-mixed", lora_rank=4), trace=str(trace))
    rows = [json.loads(line) for line in open(trace)]
    casts = [r for r in rows if r["event"] == "alloc" and r["aten_op"] == "_to_copy" and r["category"] == "weights"
             and r["op"] == "layer 1 mlp.down_proj"]
    assert len(casts) == 2  # once per forward (steps 1 and 2), a frozen base weight cast to bf16
    assert all(r["dtype"] == "bfloat16" and r["shape"] == [64, 128] for r in casts)


def test_fused_loss_with_a_frozen_lm_head_makes_no_weight_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)  # frozen, as under LoRA
    labels = torch.randint(50, (2, 6))
    loss = fused_linear_cross_entropy(hidden, weight, labels, compute_dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, (hidden,))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).view(-1, 50), shifted.reshape(-1), ignore_index=-100)
    (grad_ref,) = torch.autograd.grad(ref, (hidden,))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, grad_ref)


def test_fused_loss_runs_through_the_peft_wrapper(tmp_path):
    trace = tmp_path / "t.jsonl"
    measure(tiny("llama"), Recipe(batch=1, seq=8, precision="fp32", loss="fused", lora_rank=4), trace=str(trace))
    rows = [json.loads(line) for line in open(trace)]
    loss_allocs = [r for r in rows if r["event"] == "alloc" and r["op"] == "loss" and r["phase"] == "loss"]
    assert any(r["shape"] == [8, 64] for r in loss_allocs)  # grad_x: the hidden states' gradient
    # no lm_head-sized gradient buffer: the frozen head gets none (Liger does the same)
    assert not any(r["shape"] == [256, 64] for r in loss_allocs)


def test_cli_lora_text_and_json(capsys, tiny_config):
    path = tiny_config("gpt2")
    assert main([path, "--seq", "8", "--precision", "fp32", "--lora", "4", "--lora-targets", "c_proj"]) == 0
    assert "lora: rank 4 on attn.c_proj, mlp.c_proj (dropout 0)" in capsys.readouterr().out
    assert main([path, "--seq", "8", "--precision", "fp32", "--lora", "4", "--fake", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["lora_rank"] == 4 and out["recipe"]["lora_targets"] == ["attn.c_attn"]
    assert out["trainable_parameters"] == 2 * (4 * 64 + 192 * 4)  # 2 layers, A (4 x 64) and B (192 x 4)
    assert out["versions"]["peft"]
