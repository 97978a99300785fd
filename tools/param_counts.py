#!/usr/bin/env python3
"""Exact parameter-count oracle for the built-in model catalog.

For every entry of data/models/index.json this builds the model with Hugging Face
transformers from the catalog's config file, on the meta device (no memory, no
download), and records what a user would see:

* parameters: sum(p.numel() for p in model.parameters()), which counts a tied
  embedding / lm_head pair once;
* the number of parameter tensors, whether the embeddings are tied, and which
  parameter names alias one tensor;
* every buffer (name, shape, persistent or not, dtype and bytes) for a model
  loaded in float32 and in bfloat16;
* the parameter tensors of decoder layer 0 and all parameters outside the
  decoder layers (name and shape), so the engine's tests can check per-tensor
  shapes without shipping a listing of every layer.

It writes data/models/param_counts.json; with --update-index it also fills the
"parameters" field of data/models/index.json.

Usage: .venv/bin/python tools/param_counts.py [--update-index] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "data" / "models"
INDEX = MODELS_DIR / "index.json"
OUT = MODELS_DIR / "param_counts.json"

# Decoder blocks live under "...layers.<i>." (Llama, Mistral, Qwen, Gemma, Phi-3)
# or "...h.<i>." (GPT-2).
LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h))\.(?P<idx>\d+)\.(?P<rest>.+)$")

# Independently published exact counts, used only as a cross-check. The PyTorch
# convention counts a tied embedding once; sources that count an untied
# Keras-style head give larger numbers and are listed for information only.
PUBLISHED = {
    "gpt2": (124439808, "keras-hub gpt2_presets.py gpt2_base_en"),
    "gpt2-xl": (1557611200, "keras-hub gpt2_presets.py gpt2_extra_large_en"),
    "llama-3.1-8b": (8030261248, "keras-hub llama3_presets.py (llama3/3.1 8B); widely published"),
    "llama-3.1-70b": (70553706496, "widely published (e.g. public memory-calculator test fixtures)"),
    "llama-3.2-1b": (1235814400, "Hugging Face model page (1.24B); keras-hub lists 1498482688 = untied head"),
    "llama-3.2-3b": (3212749824, "Hugging Face model page (3.21B), from knowledge"),
    "mistral-7b-v0.1": (7241732096, "keras-hub mistral_presets.py mistral_7b_en"),
    "mistral-7b-v0.3": (7248023552, "from knowledge (v0.1 + 768 extra vocab rows x 4096 x 2)"),
    "qwen2.5-0.5b": (494032768, "keras-hub qwen_presets.py qwen2.5_0.5b_en"),
    "qwen2.5-7b": (7615616512, "keras-hub qwen_presets.py qwen2.5_math_7b_en (same shapes as Qwen2.5-7B)"),
    "qwen3-0.6b": (596049920, "keras-hub qwen3_presets.py qwen3_0.6b_en"),
    "qwen3-4b": (4022468096, "keras-hub qwen3_presets.py qwen3_4b_en"),
    "qwen3-8b": (8190735360, "keras-hub qwen3_presets.py qwen3_8b_en"),
    "gemma-2-2b": (2614341888, "keras-hub gemma_presets.py gemma2_2b_en"),
    "phi-3-mini-4k-instruct": (3821079552, "keras-hub phi3_presets.py phi3_mini_4k_instruct_en"),
}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def load_config(path: Path):
    """Load the catalog file the way a user loads a checkpoint directory."""
    tmp = tempfile.mkdtemp(prefix="trainmem-cfg-")
    try:
        shutil.copyfile(path, os.path.join(tmp, "config.json"))
        return AutoConfig.from_pretrained(tmp, trust_remote_code=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(cfg, dtype: torch.dtype | None):
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, **kwargs)


def buffer_table(model) -> list[dict]:
    rows = []
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        rows.append({
            "name": name,
            "shape": list(buf.shape),
            "persistent": leaf not in module._non_persistent_buffers_set,
            "dtype": dtype_name(buf.dtype),
            "bytes": buf.numel() * buf.element_size(),
        })
    return rows


def dims(cfg) -> dict:
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    inter = getattr(cfg, "intermediate_size", None)
    if inter is None:  # GPT-2: n_inner (null -> 4 * n_embd)
        inter = getattr(cfg, "n_inner", None) or 4 * hidden
    return {
        "hidden_size": hidden,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }


def analyse(entry: dict) -> dict:
    path = MODELS_DIR / entry["file"]
    cfg = load_config(path)
    published_dtype = json.loads(path.read_text()).get("torch_dtype")

    # What AutoModelForCausalLM.from_config gives without a dtype argument
    # (transformers 5 uses the config's torch_dtype for this).
    default_model = build(load_config(path), None)
    default_dtypes = sorted({dtype_name(p.dtype) for p in default_model.parameters()})
    attn_impl = default_model.config._attn_implementation
    del default_model

    model = build(cfg, torch.float32)
    arch = type(model).__name__
    named = list(model.named_parameters())  # de-duplicated
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(p.numel() for _, p in named)

    # Aliases: names that refer to one tensor (tied weights).
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    aliases = [names for names in by_id.values() if len(names) > 1]

    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight

    # Layer 0 and non-layer tensors; per-layer totals to check the layers match.
    per_layer: dict[int, int] = {}
    layer0, non_layer = [], []
    layer_prefix = None
    for name, p in named:
        m = LAYER_RE.match(name)
        if m:
            idx = int(m.group("idx"))
            per_layer[idx] = per_layer.get(idx, 0) + p.numel()
            if idx == 0:
                layer_prefix = m.group("prefix")
                layer0.append({"name": m.group("rest"), "shape": list(p.shape), "numel": p.numel()})
        else:
            non_layer.append({"name": name, "shape": list(p.shape), "numel": p.numel()})
    n_layers = len(per_layer)
    layer_params = per_layer.get(0, 0)
    uniform = len(set(per_layer.values())) == 1
    non_layer_params = sum(t["numel"] for t in non_layer)
    assert non_layer_params + sum(per_layer.values()) == total

    bufs32 = buffer_table(model)
    del model
    bufs16 = {b["name"]: b for b in buffer_table(build(cfg, torch.bfloat16))}
    buffers = []
    for b in bufs32:
        b16 = bufs16[b["name"]]
        buffers.append({
            "name": b["name"],
            "shape": b["shape"],
            "persistent": b["persistent"],
            "dtype": {"float32_load": b["dtype"], "bfloat16_load": b16["dtype"]},
            "bytes": {"float32_load": b["bytes"], "bfloat16_load": b16["bytes"]},
        })

    pub = PUBLISHED.get(entry["name"])
    return {
        "name": entry["name"],
        "hf_id": entry["hf_id"],
        "architecture": arch,
        "model_type": cfg.model_type,
        "parameters": total,
        "parameter_tensors": len(named),
        "tie_word_embeddings": tied,
        "aliases": aliases,
        "dims": dims(cfg),
        "layers": {
            "prefix": layer_prefix,
            "count": n_layers,
            "parameters_per_layer": layer_params,
            "tensors_per_layer": len(layer0),
            "uniform": uniform,
        },
        "non_layer_parameters": non_layer_params,
        "layer0_tensors": [{"name": t["name"], "shape": t["shape"]} for t in layer0],
        "non_layer_tensors": [{"name": t["name"], "shape": t["shape"]} for t in non_layer],
        "buffers": buffers,
        "buffer_bytes": {
            "float32_load": sum(b["bytes"]["float32_load"] for b in buffers),
            "bfloat16_load": sum(b["bytes"]["bfloat16_load"] for b in buffers),
        },
        "config_torch_dtype": published_dtype,
        "from_config_default_param_dtypes": default_dtypes,
        "default_attn_implementation": attn_impl,
        "published_parameters": None if pub is None else pub[0],
        "published_source": None if pub is None else pub[1],
        "matches_published": None if pub is None else pub[0] == total,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update-index", action="store_true", help="fill 'parameters' in index.json")
    ap.add_argument("--only", nargs="*", help="restrict to these catalog names (no file is written)")
    args = ap.parse_args(argv)

    index = json.loads(INDEX.read_text())
    entries = [e for e in index if not args.only or e["name"] in args.only]
    results = []
    for e in entries:
        r = analyse(e)
        results.append(r)
        flag = {True: "ok", False: "MISMATCH", None: "-"}[r["matches_published"]]
        print(f"{r['name']:<24} {r['parameters']:>15,}  tensors={r['parameter_tensors']:<4} "
              f"tied={str(r['tie_word_embeddings']):<5} published={flag}", flush=True)

    if args.only:
        return 0

    doc = {
        "provenance": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
            "command": "python tools/param_counts.py" + (" " + shlex.join(argv) if argv else ""),
            "method": "AutoConfig.from_pretrained(<dir with the catalog file as config.json>); "
                      "AutoModelForCausalLM.from_config(cfg, dtype=float32) under torch.device('meta'); "
                      "parameters = sum(p.numel() for p in model.parameters()) (tied tensors counted once)",
        },
        "models": results,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")

    if args.update_index:
        counts = {r["name"]: r["parameters"] for r in results}
        for e in index:
            if e["name"] in counts:
                e["parameters"] = counts[e["name"]]
        INDEX.write_text(json.dumps(index, indent=2) + "\n")
        print(f"updated {INDEX.relative_to(REPO)}")

    bad = [r["name"] for r in results if r["matches_published"] is False]
    if bad:
        print("differs from published count: " + ", ".join(bad), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
