"""Generation (recipe mode inference) on the measuring side: the knobs, their validation, the
phases and labels of a generate() call, and the KV cache it keeps.

Tiny models, real compute on the CPU (a few seconds each).
"""

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, RecipeError, block_bytes, measure  # noqa: E402
from trainmem.measure.cli import main  # noqa: E402
from trainmem.measure.models import ModelSpec  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False,
             max_position_embeddings=256)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)


def spec(config: dict) -> ModelSpec:
    return ModelSpec(f"tiny-{config['model_type']}", dict(config), "test")


# ------------------------------------------------------------------------------------- knobs

def test_inference_defaults():
    r = Recipe(mode="inference")
    assert r.precision == "bf16-true" and r.new_tokens == 128 and r.beams == 1
    assert Recipe().precision == "bf16-mixed" and Recipe().mode == "training"
    d = Recipe(mode="inference", precision="fp32", new_tokens=4, beams=2).as_dict()
    assert d["mode"] == "inference" and d["new_tokens"] == 4 and d["beams"] == 2 and "steps" not in d
    assert Recipe.from_dict(d) == Recipe(mode="inference", precision="fp32", new_tokens=4, beams=2)
    training = Recipe().as_dict()
    assert training["mode"] == "training" and "new_tokens" not in training and "beams" not in training
    assert Recipe.from_dict({**training, "steps": 2}) == Recipe()  # the engine's training JSON has steps


@pytest.mark.parametrize("knobs,message", [
    (dict(mode="serving"), "mode='serving' is not one of training, inference"),
    (dict(beams=2), "beams=2 is beam search, an inference knob"),
    (dict(mode="inference", precision="bf16-mixed"), "inference loads the weights in one dtype: fp32, bf16-true, fp16-true"),
    (dict(mode="inference", precision="bf16-master"), "precision='bf16-master': inference loads the weights"),
    (dict(mode="inference", grad_accum=2), "grad_accum=2: inference has no gradient accumulation"),
    (dict(mode="inference", checkpointing="full"), "checkpointing='full': inference keeps no activations"),
    (dict(mode="inference", lora_rank=8), "lora_rank=8: inference with adapters is not measured"),
    (dict(mode="inference", new_tokens=0), "new_tokens must be an integer >= 1, got 0"),
    (dict(mode="inference", beams=0), "beams must be an integer >= 1, got 0"),
    (dict(mode="inference", beams=65), "beams must be at most 64, got 65"),
    (dict(mode="inference", seq=1 << 24, new_tokens=1), "seq + new_tokens must be at most 16777216"),
])
def test_recipe_refuses_what_the_engine_refuses(knobs, message):
    with pytest.raises(RecipeError) as e:
        Recipe(**knobs)
    assert message in str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["gpt2", "--inference", "--precision", "bf16-mixed"], "inference loads the weights in one dtype"),
    (["gpt2", "--beams", "4"], "beams=4 is beam search, an inference knob"),
    (["gpt2", "--inference", "--grad-accum", "2"], "grad_accum=2: inference has no gradient accumulation"),
    (["gpt2", "--inference", "--new-tokens", "0"], "new_tokens must be an integer >= 1, got 0"),
])
def test_cli_bad_inference_knobs(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


# ------------------------------------------------------------------------------------- runs

def _replay(rows):
    """Live bytes per category after every event."""
    live = {}
    for row in rows:
        sign = 1 if row["event"] == "alloc" else -1
        live[row["category"]] = live.get(row["category"], 0) + sign * row["bytes"]
        yield row, dict(live)


def _cache_bytes(layers, rows, kv_heads, length, head_dim, itemsize):
    """2 · layers storages of (rows, kv_heads, length, head_dim), each its own block."""
    return 2 * layers * block_bytes(rows * kv_heads * length * head_dim * itemsize)


@pytest.mark.parametrize("batch,beams,attention", [(2, 1, "sdpa"), (1, 3, "eager")])
def test_kv_cache_and_phases(tmp_path, batch, beams, attention):
    seq, new = 8, 4
    trace = tmp_path / "events.jsonl"
    recipe = Recipe(mode="inference", batch=batch, seq=seq, precision="fp32", new_tokens=new, beams=beams,
                    attention=attention)
    result = measure(spec(LLAMA), recipe, trace=str(trace))
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    gen = result["diagnostics"]["generation"]

    # exactly new_tokens tokens: one prefill forward and new_tokens - 1 decode forwards
    assert gen["forwards"] == new and gen["prepare_inputs_calls"] == new
    assert gen["output_shape"] == [batch, seq + new]
    assert gen["cache_class"] == "DynamicCache"
    assert gen.get("cache_reorders", 0) == (new if beams > 1 else 0)  # beam search reorders after every forward
    # the cache holds seq + new_tokens - 1 positions: the last token is selected, never fed back
    assert {tuple(layer["keys"]) for layer in gen["cache"]["layers"]} == {(batch * beams, 2, seq + new - 1, 16)}

    # phases and labels
    phases = {(r["phase"], r["micro_batch"]) for r in rows}
    assert phases == {("setup", 0), ("prefill", 0), *(("decode", i) for i in range(1, new))}
    assert {r["step"] for r in rows if r["phase"] != "setup"} == {1}
    assert any(r["op"] == "lm_head" for r in rows if r["phase"] == "prefill")
    assert any(r["op"].startswith("generate.") for r in rows if r["phase"] == "decode")
    assert any(r["op"].startswith("layer 1 self_attn") and r["category"] == "activations" for r in rows)
    assert result["peak"]["phase"] in ("prefill", "decode") and result["peak"]["step"] == 1

    # the KV cache, after the last decode forward computed its logits: every layer's keys and
    # values of seq + new - 1 positions, for batch · beams rows
    last_head = max(i for i, r in enumerate(rows) if r["op"] == "lm_head" and r["event"] == "alloc")
    live = None
    for i, (row, state) in enumerate(_replay(rows)):
        if i == last_head:
            live = state
            break
    assert live["activations"] == _cache_bytes(2, batch * beams, 2, seq + new - 1, 16, 4)
    # after the prefill forward: seq positions
    first_head = min(i for i, r in enumerate(rows) if r["op"] == "lm_head" and r["event"] == "alloc")
    for i, (row, state) in enumerate(_replay(rows)):
        if i == first_head:
            assert state["activations"] == _cache_bytes(2, batch * beams, 2, seq, 16, 4)
            break

    # inputs: input_ids and attention_mask (batch x seq int64), category other; nothing else is
    assert result["diagnostics"]["allocated_bytes_by_category"]["other"] == 2 * block_bytes(batch * seq * 8)
    assert result["breakdown_at_peak"]["optimizer_states"] == result["breakdown_at_peak"]["gradients"] == 0
    assert sum(result["breakdown_at_peak"].values()) == result["peak_allocated_bytes"]
    # everything but the weights is freed when generate() returns and the output is dropped
    end = result["diagnostics"]["live_bytes_at_end"]
    assert end["activations"] == end["temporaries"] == 0
    assert result["diagnostics"]["freed_by_gc_bytes"] == 0


def test_single_new_token_is_prefill_only():
    result = measure(spec(GPT2), Recipe(mode="inference", seq=8, precision="fp32", new_tokens=1))
    gen = result["diagnostics"]["generation"]
    assert gen["forwards"] == 1 and gen["output_shape"] == [1, 9]
    assert result["steps"] and result["steps"][0]["step"] == 1
    assert result["peak"]["phase"] == "prefill"


def test_a_config_that_asks_generate_for_hidden_states_is_measured():
    """output_hidden_states in config.json makes generate() return an output object (the engine
    refuses it as unmodelled); the measurement reads its sequences and holds the extra tensors."""
    plain = measure(spec(GPT2), Recipe(mode="inference", seq=8, precision="fp32", new_tokens=3))
    result = measure(spec({**GPT2, "output_hidden_states": True}),
                     Recipe(mode="inference", seq=8, precision="fp32", new_tokens=3))
    assert result["diagnostics"]["generation"]["output_shape"] == [1, 11]
    assert result["peak_allocated_bytes"] > plain["peak_allocated_bytes"]


def test_cli_inference_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    argv = [str(path), "--inference", "--seq", "8", "--new-tokens", "3", "--beams", "2", "--precision", "fp32",
            "--batch", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["recipe"]
    assert r["mode"] == "inference" and r["new_tokens"] == 3 and r["beams"] == 2 and "steps" not in r
    assert out["source"] == "measured-cpu"
    assert "--inference" in out["command"] and "--beams 2" in out["command"] and "--new-tokens 3" in out["command"]
    assert out["diagnostics"]["generation"]["forwards"] == 3
    # GPT-2 keeps its keys and values at n_head heads of n_embd / n_head
    assert {tuple(layer["keys"]) for layer in out["diagnostics"]["generation"]["cache"]["layers"]} == {(4, 4, 10, 16)}
    assert main([str(path), "--inference", "--seq", "8", "--new-tokens", "2", "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    assert "generate: batch 1 x prompt 8 + 2 new tokens, beams 1, fp32" in text


def test_fake_inference_is_refused(capsys):
    assert main(["gpt2", "--inference", "--fake", "--precision", "fp32"]) == 2
    assert "mode=inference cannot run on fake tensors" in capsys.readouterr().err
