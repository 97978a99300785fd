"""The tracker against PyTorch's own memory profiler (torch.profiler._memory_profiler), on CPU.

Both see the same two steps of the same tiny models; the categories both define the same way
(parameters, gradients, optimizer states) must agree to the byte.
"""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torch.profiler._memory_profiler")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, measure  # noqa: E402
from trainmem.measure.crosscheck import parameter_bytes, profiler_category_bytes  # noqa: E402
from trainmem.measure.models import ModelSpec  # noqa: E402

TINY_LLAMA = ModelSpec("tiny-llama", {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False}, "test")
TINY_GPT2 = ModelSpec("tiny-gpt2", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                    "vocab_size": 256, "n_positions": 128}, "test")


@pytest.mark.parametrize("spec,recipe", [
    (TINY_LLAMA, Recipe(batch=2, seq=16, precision="bf16-mixed", optimizer="adamw")),
    (TINY_GPT2, Recipe(batch=2, seq=16, precision="fp32", optimizer="sgd", grad_accum=2)),
])
def test_gradient_parameter_and_optimizer_bytes_agree_with_torch_profiler(spec, recipe):
    profiler = profiler_category_bytes(spec, recipe)
    ours = measure(spec, recipe)["diagnostics"]["requested_bytes_by_category"]
    params = parameter_bytes(spec, recipe)
    assert profiler["parameter"] == params
    # Two steps, each makes one full set of gradients (micro-batch 2 accumulates in place).
    assert profiler["gradient"] == ours["gradients"] == 2 * params
    # AdamW: exp_avg + exp_avg_sq + a 4-byte step counter per parameter tensor; SGD: one momentum buffer.
    assert profiler["optimizer_state"] == ours["optimizer_states"]
