#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz/corpus/<target>/ (committed; rerun only to change it).

Seeds are small on purpose: the catalog configs, one minimal config per family, the edge cases
the readers must reject, and a few well-formed inputs for the structured targets. The fuzzers
grow their own corpora elsewhere (build-fuzz/corpus/, see run_long.sh).
"""
import json
import random
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"


def write(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


MINIMAL = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100},
    "mistral": {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 50, "torch_dtype": "bfloat16"},
    "qwen2": {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 77, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "head_dim": 16, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64},
    "gemma2": {"model_type": "gemma2", "hidden_size": 32, "head_dim": 8, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "phi3": {"model_type": "phi3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 64, "dtype": "float16"},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64,
             "n_positions": 32, "n_inner": None},
}


def config_seeds():
    for f in sorted((ROOT / "data" / "models").glob("*.json")):
        if f.name in ("index.json", "param_counts.json"):
            continue
        write("fuzz_config", "catalog-" + f.stem, f.read_bytes())
    for fam, c in MINIMAL.items():
        write("fuzz_config", f"min-{fam}", json.dumps(c))
    llama = MINIMAL["llama"]
    edge = {
        "empty": "",
        "empty-object": "{}",
        "array": "[1, 2]",
        "null": "null",
        "nan": '{"model_type": "llama", "hidden_size": NaN}',
        "float-dims": json.dumps({**llama, "hidden_size": 64.0, "num_hidden_layers": 2.0}),
        "half-dim": json.dumps({**llama, "hidden_size": 64.5}),
        "negative": json.dumps({**llama, "num_attention_heads": -4}),
        "zero": json.dumps({**llama, "num_key_value_heads": 0}),
        "huge": json.dumps({**llama, "hidden_size": 10**15}),
        "u64max": '{"model_type": "llama", "hidden_size": 18446744073709551615, "intermediate_size": 1,'
                  ' "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1}',
        "exp": json.dumps({**llama})[:-1] + ', "max_position_embeddings": 1e308}',
        "at-limits": json.dumps({**llama, "hidden_size": 2**24, "intermediate_size": 2**24, "vocab_size": 2**24,
                                 "num_attention_heads": 1, "num_key_value_heads": 1}),
        "ones": json.dumps({"model_type": "llama", "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
                            "num_attention_heads": 1, "vocab_size": 1}),
        "gqa-bad": json.dumps({**llama, "num_key_value_heads": 3}),
        "heads-not-dividing": json.dumps({**llama, "num_attention_heads": 5}),
        "headdim-null": json.dumps({**llama, "head_dim": None}),
        "string-dim": json.dumps({**llama, "hidden_size": "64"}),
        "bool-dim": json.dumps({**llama, "hidden_size": True}),
        "bad-dtype": json.dumps({**llama, "torch_dtype": "int8"}),
        "dtype-number": json.dumps({**llama, "torch_dtype": 16}),
        "bad-act": json.dumps({**llama, "hidden_act": "relu"}),
        "tie-string": json.dumps({**llama, "tie_word_embeddings": "yes"}),
        "gemma-negative-cap": json.dumps({**MINIMAL["gemma2"], "final_logit_softcapping": -1}),
        "unicode-type": '{"model_type": "ll\\u00e4ma"}',
        "nested": "[" * 64 + "]" * 64,
        "dup-keys": '{"model_type": "gpt2", "model_type": "llama", "hidden_size": 8}',
        "gpt2-bad-heads": json.dumps({**MINIMAL["gpt2"], "n_head": 5}),
        "trailing": json.dumps(llama) + " garbage",
    }
    for name, text in edge.items():
        write("fuzz_config", "edge-" + name, text)


def safetensors_seeds():
    def hdr(tensors, meta=True):
        d = {"__metadata__": {"format": "pt"}} if meta else {}
        off = 0
        for name, (dtype, shape) in tensors.items():
            n = 1
            for s in shape:
                n *= s
            size = n * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}.get(dtype, 4)
            d[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
            off += size
        return json.dumps(d)
    write("fuzz_safetensors", "tiny-bf16", hdr({"model.embed_tokens.weight": ("BF16", [64, 16]),
                                                "model.norm.weight": ("BF16", [16])}))
    write("fuzz_safetensors", "mixed-dtypes", hdr({"a": ("F32", [4, 4]), "b": ("F16", [8]), "c": ("I64", [2]),
                                                   "d": ("U8", [3, 3])}))
    write("fuzz_safetensors", "no-metadata", hdr({"w": ("F16", [2, 3])}, meta=False))
    write("fuzz_safetensors", "scalar", hdr({"s": ("F32", [])}))
    write("fuzz_safetensors", "zero-dim", hdr({"z": ("BF16", [0, 4096])}))
    write("fuzz_safetensors", "empty-object", "{}")
    write("fuzz_safetensors", "only-metadata", '{"__metadata__": {"format": "pt"}}')
    write("fuzz_safetensors", "overflow", '{"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 2],'
                                          ' "data_offsets": [0, 0]}}')
    write("fuzz_safetensors", "sum-overflow", '{"a": {"dtype": "F32", "shape": [9223372036854775807]},'
                                              ' "b": {"dtype": "F32", "shape": [9223372036854775807]},'
                                              ' "c": {"dtype": "F32", "shape": [9]}}')
    write("fuzz_safetensors", "negative-dim", '{"w": {"dtype": "F32", "shape": [-1, 4]}}')
    write("fuzz_safetensors", "float-dim", '{"w": {"dtype": "F32", "shape": [1.5, 4]}}')
    write("fuzz_safetensors", "shape-not-array", '{"w": {"dtype": "F32", "shape": 4}}')
    write("fuzz_safetensors", "no-dtype", '{"w": {"shape": [4]}}')
    write("fuzz_safetensors", "dtype-number", '{"w": {"dtype": 7, "shape": [4]}}')
    write("fuzz_safetensors", "tensor-not-object", '{"w": [1, 2, 3]}')
    write("fuzz_safetensors", "array", "[]")
    write("fuzz_safetensors", "truncated", hdr({"w": ("F16", [2, 3])})[:-7])
    write("fuzz_safetensors", "not-json", "\x00\x01\x02\xff")
    # A whole file (8-byte length + header): the harness also reads the input as a raw file.
    h = hdr({"w": ("BF16", [8, 8])}).encode()
    write("fuzz_safetensors", "framed-file", struct.pack("<Q", len(h)) + h)
    write("fuzz_safetensors", "framed-too-long", struct.pack("<Q", len(h) + 100) + h)
    write("fuzz_safetensors", "framed-huge", struct.pack("<Q", 2**63) + h)


def recipe_seeds():
    rng = random.Random(5)
    for n in (0, 1, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        write("fuzz_recipe", f"random-{n:03d}", bytes(rng.randrange(256) for _ in range(n)))
    for n in (32, 64, 128):
        write("fuzz_recipe", f"zeros-{n:03d}", bytes(n))
        write("fuzz_recipe", f"ones-{n:03d}", b"\xff" * n)
        write("fuzz_recipe", f"small-{n:03d}", bytes(rng.randrange(16) for _ in range(n)))


def cli_seeds():
    seeds = {
        "estimate-gpt2": ["estimate", "gpt2", "--seq", "64"],
        "estimate-json": ["estimate", "qwen3-0.6b", "--batch", "2", "--seq", "128", "--json"],
        "estimate-timeline": ["estimate", "llama-3.2-1b", "--seq", "32", "--json", "--timeline"],
        "estimate-all-knobs": ["estimate", "gemma-2-2b", "--batch", "1", "--seq", "16", "--grad-accum", "2",
                               "--precision", "bf16-master", "--optimizer", "adafactor", "--checkpointing", "full",
                               "--attention", "eager", "--loss", "fused", "--gpu", "cpu", "--allocator",
                               "expandable"],
        "estimate-eq": ["estimate", "phi-3-mini-4k-instruct", "--seq=8", "--precision=fp16-true",
                        "--optimizer=adamw-8bit"],
        "estimate-hf-id": ["estimate", "Qwen/Qwen3-4B", "--seq", "8", "--optimizer", "sgd"],
        "estimate-path": ["estimate", "data/models/mistral-7b-v0.1.json", "--seq", "4"],
        "estimate-dir": ["estimate", "data/models", "--seq", "4"],
        "models": ["models"],
        "models-json": ["models", "--json"],
        "gpus-json": ["gpus", "--json"],
        "help": ["--help"],
        "version": ["--version"],
        "estimate-help": ["estimate", "--help"],
        "unknown-command": ["frobnicate"],
        "no-model": ["estimate"],
        "bad-batch": ["estimate", "gpt2", "--batch", "0"],
        "bad-seq": ["estimate", "gpt2", "--seq", "4k"],
        "overflow": ["estimate", "gpt2", "--seq", "16777216", "--batch", "16777216"],
        "bad-precision": ["estimate", "gpt2", "--precision", "int3"],
        "extra-arg": ["estimate", "gpt2", "gpt2"],
        "missing-value": ["estimate", "gpt2", "--seq"],
        "empty": [""],
        "empty-model": ["estimate", ""],
        "unknown-flag": ["estimate", "gpt2", "--bogus"],
        "dash-dash": ["estimate", "--", "gpt2"],
        # --trace writes a file: the harness confines it to its scratch directory.
        "trace": ["estimate", "gpt2", "--seq", "8", "--trace", "events.jsonl"],
        "trace-eq": ["estimate", "qwen3-0.6b", "--seq=4", "--trace=/dev/null"],
        "compare-missing": ["compare", "nothing.json"],
        "compare-config": ["compare", "data/models/gpt2.json"],
    }
    for name, argv in seeds.items():
        write("fuzz_cli", name, "\n".join(argv))


if __name__ == "__main__":
    config_seeds()
    safetensors_seeds()
    recipe_seeds()
    cli_seeds()
    for d in sorted(CORPUS.iterdir()):
        print(d.name, len(list(d.iterdir())))
