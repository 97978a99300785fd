import json
import os
import shutil
import subprocess
from pathlib import Path

# The measuring side pins torch's CPU kernels before torch is imported (Note [bitsandbytes' CPU
# kernels] in python/trainmem/measure/models.py); tests import torch before it, so here too.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _binary() -> str:
    env = os.environ.get("TRAINMEM_BIN")
    if env:
        return env
    for cand in (ROOT / "build" / "trainmem", shutil.which("trainmem")):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.skip("trainmem binary not built (make build)")


@pytest.fixture(scope="session")
def trainmem_bin() -> str:
    return _binary()


@pytest.fixture
def run(trainmem_bin):
    def _run(*args, timeout=60):
        return subprocess.run([trainmem_bin, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout)
    return _run


# A tiny untied 2-layer Llama whose bitsandbytes blocks (4-bit and 8-bit) are not whole 512-byte
# allocator blocks. The quantized tests write it to a config.json, so the engine reads exactly the
# model that was measured.
QUANT_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False}


@pytest.fixture
def quant_llama_path(tmp_path) -> str:
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(QUANT_LLAMA))
    return str(path)
