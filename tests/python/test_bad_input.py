"""Hostile input to the `trainmem` command, table by table.

Every bad input must end the same way (README, "Bad input"): exit code 2, nothing on stdout, and
exactly one line on stderr, "trainmem: error: ...", that names the field and the problem. None
may crash, hang (each run has a timeout) or print a number. test_cli.py holds the first bad
arguments and configs; the tables here extend them without repeating them.

A last table holds inputs that are odd but valid: they must succeed (exit 0, a JSON object).

`make test-sanitize` runs this file against the ASan/UBSan build of the CLI too.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "data" / "models"
TIMEOUT_S = 60

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 32, "head_dim": 8, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}

def cases(table):
    """Table rows (id, *values) or pytest.param(id, *values, marks=...) as pytest params."""
    out = []
    for row in table:
        if hasattr(row, "marks"):  # a pytest.param (itself a tuple)
            out.append(pytest.param(*row.values[1:], id=row.values[0], marks=row.marks))
        else:
            out.append(pytest.param(*row[1:], id=row[0]))
    return out


def run_cli(binary, args, timeout=TIMEOUT_S):
    return subprocess.run([binary, *[os.fsencode(a) if isinstance(a, (str, Path)) else a for a in args]],
                          capture_output=True, timeout=timeout)


def assert_bad_input(r, *needles):
    __tracebackhide__ = True
    assert r.returncode == 2, f"exit {r.returncode}, stderr {r.stderr[-500:]!r}"
    assert r.stdout == b"", r.stdout[:300]
    lines = r.stderr.decode("utf-8", "replace").rstrip("\n").split("\n")
    assert len(lines) == 1, lines[:5]
    assert lines[0].startswith("trainmem: error: "), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0][:400]!r}"


def with_(base, **changes):
    d = dict(base)
    for k, v in changes.items():
        if v is DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return json.dumps(d)


DROP = object()

# ---- 1. arguments --------------------------------------------------------------------------------
# (id, argv after `trainmem`, words the one line must contain)
BAD_ARGS = [
    ("batch-2^64", ["estimate", "gpt2", "--batch", "18446744073709551616"], ["batch: must be a positive integer"]),
    ("batch-u64max", ["estimate", "gpt2", "--batch", "18446744073709551615"], ["batch: must be between 1 and 16777216"]),
    ("batch-2^24+1", ["estimate", "gpt2", "--batch", "16777217"], ["batch: must be between 1 and 16777216"]),
    ("seq-0", ["estimate", "gpt2", "--seq", "0"], ["seq: must be between 1 and"]),
    ("seq-minus-0", ["estimate", "gpt2", "--seq", "-0"], ["seq: must be a positive integer, got '-0'"]),
    ("seq-empty", ["estimate", "gpt2", "--seq", ""], ["seq: must be a positive integer, got ''"]),
    ("seq-space", ["estimate", "gpt2", "--seq", " 12"], ["seq: must be a positive integer"]),
    ("seq-hex", ["estimate", "gpt2", "--seq", "0x10"], ["seq: must be a positive integer, got '0x10'"]),
    ("seq-exp", ["estimate", "gpt2", "--seq", "1e3"], ["seq: must be a positive integer, got '1e3'"]),
    ("seq-plus", ["estimate", "gpt2", "--seq", "+5"], ["seq: must be a positive integer"]),
    ("seq-arabic-digits", ["estimate", "gpt2", "--seq", "\u0661\u0662"], ["seq: must be a positive integer"]),
    ("seq-2^24+1", ["estimate", "gpt2", "--seq", "16777217"], ["seq: must be between 1 and 16777216"]),
    ("load-dtype-in-generation", ["estimate", "qwen3-0.6b", "--inference", "--load-in-4bit", "--load-dtype", "bf16"],
     ["load_dtype: bf16 is a training knob", "drop load_dtype"]),
    ("load-dtype-fp16-in-generation", ["estimate", "qwen3-0.6b", "--inference", "--load-dtype", "fp16",
                                       "--precision", "fp16-true"], ["load_dtype: fp16 is a training knob"]),
    ("seq-past-gpt2-positions", ["estimate", "gpt2", "--seq", "1025"], ["seq: 1025 is past the model's 1024 positions"]),
    ("generation-past-gpt2-positions", ["estimate", "gpt2", "--inference", "--seq", "1000", "--new-tokens", "26"],
     ["1000-token prompt and 26 new tokens feed 1025 positions, past the model's 1024"]),
    ("accum-0", ["estimate", "gpt2", "--grad-accum", "0"], ["grad_accum: must be between 1 and 1024"]),
    ("accum-2^20+1", ["estimate", "gpt2", "--grad-accum", "1048577"], ["grad_accum: must be between 1 and 1024"]),
    ("accum-negative", ["estimate", "gpt2", "--grad-accum", "-1"], ["grad_accum: must be a positive integer"]),
    ("precision-case", ["estimate", "gpt2", "--precision", "FP32"], ["precision: unknown value 'FP32'"]),
    ("precision-bytes", ["estimate", "gpt2", "--precision", b"fp\xff32"], ["precision: unknown value"]),
    ("checkpointing", ["estimate", "gpt2", "--checkpointing", "partial"],
     ["checkpointing: unknown value 'partial'; expected one of none, full"]),
    ("attention", ["estimate", "gpt2", "--attention", "flash2"], ["attention: unknown value 'flash2'"]),
    ("loss", ["estimate", "gpt2", "--loss", "chunked"], ["loss: unknown value 'chunked'"]),
    ("allocator", ["estimate", "gpt2", "--allocator", "cuda"], ["allocator: unknown value 'cuda'"]),
    ("gpu-empty", ["estimate", "gpt2", "--gpu", ""], ["gpu: unknown GPU ''"]),
    ("model-empty", ["estimate", ""], ["model: empty name"]),
    ("model-bytes", ["estimate", b"\xff\xfe\x80"], ["unknown model"]),
    ("model-long", ["estimate", "m" * 5000], ["unknown model"]),
    pytest.param("model-newline", ["estimate", "gpt2\nfoo"], ["unknown model"]),
    ("model-unknown-json", ["estimate", "qwen9-1t", "--json"], ["unknown model 'qwen9-1t'"]),
    ("extra-positional", ["estimate", "gpt2", "gpt2"], ["gpt2"]),
    ("missing-value", ["estimate", "gpt2", "--seq"], ["--seq"]),
    ("unknown-flag", ["estimate", "gpt2", "--bogus", "1"], ["--bogus"]),
    ("seq-overflows-logits", ["estimate", "qwen3-4b", "--seq", "16777216", "--batch", "65536"],
     ["overflows a 64-bit byte count"]),
    ("seq-overflows-scores", ["estimate", "llama-3.1-70b", "--seq", "16777216", "--batch", "4096",
                              "--attention", "eager"], ["attention scores", "overflows a 64-bit byte count"]),
]


@pytest.mark.parametrize("args, needles", cases(BAD_ARGS))
def test_bad_arguments(trainmem_bin, args, needles):
    # 20 s: every bad argument is refused before any simulation starts.
    assert_bad_input(run_cli(trainmem_bin, args, timeout=20), *needles)


# ---- 2. config.json contents ---------------------------------------------------------------------
# (id, bytes or text of config.json, words the one line must contain)
BAD_CONFIGS = [
    ("empty-file", "", ["not valid JSON"]),
    ("whitespace", " \n\t ", ["not valid JSON"]),
    ("nul-bytes", b"\x00" * 64, ["not valid JSON"]),
    ("truncated", json.dumps(LLAMA)[:40], ["not valid JSON"]),
    ("trailing-garbage", json.dumps(LLAMA) + "}", ["not valid JSON"]),
    ("utf16", b"\xff\xfe" + json.dumps(LLAMA).encode("utf-16-le"), ["not valid JSON"]),
    ("latin1-string", json.dumps(LLAMA)[:-1].encode() + b', "name": "caf\xe9"}', ["not valid JSON"]),
    ("infinity", with_(LLAMA)[:-1] + ', "hidden_size": Infinity}', ["not valid JSON"]),
    ("minus-infinity", with_(LLAMA)[:-1] + ', "vocab_size": -Infinity}', ["not valid JSON"]),
    ("1e400", with_(LLAMA)[:-1] + ', "hidden_size": 1e400}', ["not valid JSON"]),
    ("nan-string", with_(LLAMA, hidden_size="NaN"), ["field 'hidden_size' must be a positive integer"]),
    ("null-top", "null", ["expected a JSON object"]),
    ("string-top", '"llama"', ["expected a JSON object"]),
    ("model-type-null", with_(LLAMA, model_type=None), ["field 'model_type' must be a string"]),
    ("model-type-number", with_(LLAMA, model_type=7), ["field 'model_type' must be a string"]),
    ("model-type-case", with_(LLAMA, model_type="Llama"), ["unsupported model_type 'Llama'"]),
    ("hidden-0", with_(LLAMA, hidden_size=0), ["field 'hidden_size' must be between 1 and 16777216, got 0"]),
    ("heads-0", with_(LLAMA, num_attention_heads=0), ["field 'num_attention_heads' must be between 1"]),
    ("vocab-0", with_(LLAMA, vocab_size=0), ["field 'vocab_size' must be between 1"]),
    ("layers-negative", with_(LLAMA, num_hidden_layers=-1), ["field 'num_hidden_layers' must be at least 1, got -1"]),
    ("layers-100001", with_(LLAMA, num_hidden_layers=100001), ["field 'num_hidden_layers' must be between 1 and 100000"]),
    ("hidden-2^24+1", with_(LLAMA, hidden_size=2**24 + 1), ["field 'hidden_size' must be between 1 and 16777216"]),
    ("hidden-2^64", with_(LLAMA)[:-1] + ', "hidden_size": 18446744073709551616}', ["field 'hidden_size'"]),
    ("hidden-int64-min", with_(LLAMA, hidden_size=-2**63), ["field 'hidden_size' must be at least 1"]),
    ("hidden-minus-zero", with_(LLAMA)[:-1] + ', "hidden_size": -0.0}', ["field 'hidden_size' must be between 1"]),
    ("hidden-almost-whole", with_(LLAMA, hidden_size=64.000001), ["field 'hidden_size' must be a whole number"]),
    ("hidden-bool", with_(LLAMA, hidden_size=True), ["field 'hidden_size' must be a positive integer, got true"]),
    ("hidden-array", with_(LLAMA, hidden_size=[64]), ["field 'hidden_size' must be a positive integer"]),
    ("hidden-object", with_(LLAMA, hidden_size={"value": 64}), ["field 'hidden_size' must be a positive integer"]),
    ("hidden-missing", with_(LLAMA, hidden_size=DROP), ["missing field 'hidden_size'"]),
    ("vocab-null", with_(LLAMA, vocab_size=None), ["missing field 'vocab_size'"]),
    ("kv-more-than-heads", with_(LLAMA, num_key_value_heads=8), ["num_attention_heads=4 is not a multiple of num_key_value_heads=8"]),
    ("kv-0", with_(LLAMA, num_key_value_heads=0), ["field 'num_key_value_heads' must be between 1"]),
    ("heads-not-dividing", with_(LLAMA, num_attention_heads=6), ["num_attention_heads=6 does not divide hidden_size=64"]),
    ("heads-more-than-width", with_(LLAMA, num_attention_heads=128), ["num_attention_heads=128 does not divide hidden_size=64"]),
    ("head-dim-0", with_(LLAMA, head_dim=0), ["field 'head_dim' must be between 1"]),
    ("gpt2-heads-more-than-width", with_(GPT2, n_head=64), ["n_head=64 does not divide n_embd=32"]),
    ("gpt2-n-inner-0", with_(GPT2, n_inner=0), ["field 'n_inner' must be between 1"]),
    ("gpt2-no-positions", with_(GPT2, n_positions=DROP), ["missing field 'n_positions'"]),
    ("tie-string", with_(LLAMA, tie_word_embeddings="true"), ["field 'tie_word_embeddings' must be true or false"]),
    ("bias-number", with_(LLAMA, attention_bias=1), ["field 'attention_bias' must be true or false"]),
    ("dtype-int8", with_(LLAMA, torch_dtype="int8"), ["field 'torch_dtype' has unsupported dtype 'int8'"]),
    ("dtype-number", with_(LLAMA, dtype=16), ["field 'dtype' must be a string"]),
    ("act-relu2", with_(LLAMA, hidden_act="relu2"), ["field 'hidden_act' has unsupported activation 'relu2'"]),
    ("act-number", with_(LLAMA, hidden_act=1), ["field 'hidden_act' must be a string"]),
    ("softcap-negative", with_(GEMMA2, final_logit_softcapping=-1.0), ["field 'final_logit_softcapping' must be a finite number"]),
    ("softcap-string", with_(GEMMA2, attn_logit_softcapping="50"), ["field 'attn_logit_softcapping' must be a number"]),
    ("dropout-one", with_(LLAMA, attention_dropout=1), ["field 'attention_dropout' is a dropout probability and must be below 1"]),
    ("gpt2-dropout-negative", with_(GPT2, resid_pdrop=-0.5), ["field 'resid_pdrop' must be a finite number"]),
    ("gpt2-dropout-string", with_(GPT2, embd_pdrop="0.1"), ["field 'embd_pdrop' must be a number"]),
    pytest.param("deep-value", with_(LLAMA)[:-1].replace('"hidden_size": 64', '"hidden_size": ' + "[" * 100000 + "]" * 100000) + "}",
                 ["JSON nested deeper than 128 levels"]),
    ("deep-object", "{" + '"a":{' * 50000 + "}" * 50001, ["JSON nested deeper than 128 levels"]),
    # The checkpoint's class and weights: another head, a pre-quantized checkpoint.
    ("architectures-another-head", with_(LLAMA, architectures=["LlamaForSequenceClassification"]),
     ["architectures names LlamaForSequenceClassification; trainmem models LlamaForCausalLM"]),
    ("architectures-not-a-list", with_(LLAMA, architectures="LlamaForCausalLM"), ["architectures must be a list"]),
    ("quantization-config", with_(LLAMA, quantization_config={"quant_method": "gptq", "bits": 4}),
     ["quantization_config (a pre-quantized checkpoint, quant_method gptq) is not modelled"]),
    ("rope-type-a-number", with_(LLAMA, rope_scaling={"type": 7, "factor": 2.0}), ["rope_scaling.type must be a string"]),
    ("rope-scaling-a-string", with_(LLAMA, rope_scaling="linear"), ["rope_scaling must be an object (or null)"]),
]


@pytest.mark.parametrize("text, needles", cases(BAD_CONFIGS))
def test_bad_config(trainmem_bin, tmp_path, text, needles):
    cfg = tmp_path / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_bad_input(run_cli(trainmem_bin, ["estimate", cfg, "--json"]), *needles)
    # The same file through a model directory.
    assert_bad_input(run_cli(trainmem_bin, ["estimate", tmp_path]), *needles)


# ---- 2b. sizes whose byte counts overflow -----------------------------------------------------------
# (id, config.json text, extra arguments, words the one line must contain)
WIDE_Q = with_(LLAMA, num_attention_heads=2**24, num_key_value_heads=1, head_dim=2**24)
BAD_SIZES = [
    ("q-width-overflows", WIDE_Q, ["--seq", "65535"], ["overflows a 64-bit byte count"]),
    pytest.param("q-width-wraps", WIDE_Q, ["--seq", "65536"], ["overflows a 64-bit byte count"]),
    ("tokens-times-vocab", with_(LLAMA, vocab_size=2**24), ["--batch", "16777216", "--seq", "8192"],
     ["tokens * width bytes overflows a 64-bit byte count"]),
    ("heads-times-seq-squared", with_(LLAMA, hidden_size=2**24, num_attention_heads=2**24),
     ["--seq", "524288"], ["attention scores", "overflows a 64-bit byte count"]),
    ("step-beyond-address-space", with_(LLAMA, hidden_size=2**24, intermediate_size=2**24, vocab_size=2**24,
                                        num_hidden_layers=1000, num_attention_heads=1024), [], ["bytes"]),
]


@pytest.mark.parametrize("text, extra, needles", cases(BAD_SIZES))
def test_sizes_that_overflow(trainmem_bin, tmp_path, text, extra, needles):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    assert_bad_input(run_cli(trainmem_bin, ["estimate", cfg, *extra]), *needles)


# ---- 3. files, directories, checkpoints -------------------------------------------------------------

def _model_dir(tmp_path, config=None):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config or (MODELS / "qwen3-0.6b.json").read_text())
    return d


def _safetensors(d, header: bytes, declared=None, name="model.safetensors", data_bytes=0):
    n = len(header) if declared is None else declared
    path = d / name
    path.write_bytes(struct.pack("<Q", n) + header)
    if data_bytes:
        with open(path, "r+b") as f:  # the tensors' data, as zeros (sparse)
            f.truncate(8 + len(header) + data_bytes)
    return d


def _tensor(name, shape, dtype="BF16"):
    return {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}}


def _tensor_at(name, shape, dtype, begin=0):
    """A tensor whose data_offsets hold its shape, from `begin`."""
    size = {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    for d in shape:
        size *= d
    return {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}}


def _st_json(*tensors):
    d = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        d.update(t)
    return json.dumps(d).encode()


def _put(path, data: bytes):
    path.write_bytes(data)


def _fifo(path):
    os.mkfifo(path)
    return path


def _sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# (id, setup(tmp_path) -> the model argument, words the one line must contain, timeout)
BAD_PATHS = [
    ("st-shorter-than-8", lambda t: _put(_model_dir(t) / "a.safetensors", b"\x01\x02") or t / "model",
     ["is shorter than its 8-byte header length"]),
    ("st-length-0", lambda t: _safetensors(_model_dir(t), b"", declared=0), ["declares a header of 0 bytes"]),
    ("st-length-2^63", lambda t: _safetensors(_model_dir(t), b"{}", declared=2**63),
     ["declares a header of 9223372036854775808 bytes"]),
    ("st-length-100MiB-truncated", lambda t: _safetensors(_model_dir(t), b"{}", declared=100 << 20),
     ["is truncated inside its header"]),
    ("st-not-json", lambda t: _safetensors(_model_dir(t), b"\xff\xfe\x00garbage"), ["header is not a JSON object"]),
    ("st-array", lambda t: _safetensors(_model_dir(t), b"[1, 2]"), ["header is not a JSON object"]),
    ("st-truncated-json", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("w", [4, 4]))[:-5]),
     ["header is not a JSON object"]),
    ("st-no-shape", lambda t: _safetensors(_model_dir(t), b'{"w": {"dtype": "F32"}}'), ["tensor 'w' lacks a dtype or shape"]),
    ("st-no-dtype", lambda t: _safetensors(_model_dir(t), b'{"w": {"shape": [4]}}'), ["tensor 'w' lacks a dtype or shape"]),
    ("st-negative-dim", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("w", [-1, 4]))), ["tensor 'w' has a bad shape"]),
    ("st-float-dim", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("w", [1.5, 4]))), ["tensor 'w' has a bad shape"]),
    ("st-shape-overflow", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("w", [2**32, 2**32, 2]))),
     ["safetensors tensor size overflows a 64-bit byte count"]),
    ("st-bytes-overflow", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("a", [2**63]), _tensor("b", [2**63]))),
     ["safetensors tensor size overflows"]),
    ("st-offsets-not-the-shape", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("a", [4, 4]))),
     ["tensor 'a' has data_offsets [0, 0] that do not hold its shape"]),
    ("st-quantized-dtype", lambda t: _safetensors(_model_dir(t), _st_json(_tensor("q", [4], "U8"))),
     ["tensor 'q' is U8; only F32, F16 and BF16 checkpoints are read"]),
    ("st-not-the-configs-count", lambda t: _safetensors(_model_dir(t, json.dumps(GPT2)),
                                                       _st_json(_tensor_at("w", [4], "F32")), data_bytes=16),
     ["the *.safetensors files hold 4 parameters, config.json describes 28544"]),
    ("st-is-a-directory", lambda t: (_model_dir(t) / "x.safetensors").mkdir() or t / "model", ["x.safetensors"]),
    ("st-symlink-loop", lambda t: os.symlink("l.safetensors", _model_dir(t) / "l.safetensors") or t / "model",
     ["l.safetensors"]),
    pytest.param("st-fifo", lambda t: _fifo(_model_dir(t) / "model.safetensors") and t / "model", ["model.safetensors"]),
    pytest.param("st-no-tensors", lambda t: _safetensors(_model_dir(t), b'{"__metadata__": {}}'), ["safetensors"]),
    ("dir-config-is-dir", lambda t: (t / "m").mkdir() or (t / "m" / "config.json").mkdir() or t / "m",
     ["directory has no config.json"]),
    ("dir-config-100MB", lambda t: (t / "m").mkdir() or _sparse(t / "m" / "config.json", 100 * 1024 * 1024) and t / "m",
     ["too large to be a config.json"]),
    pytest.param("dir-config-loop",
                 lambda t: (t / "m").mkdir() or os.symlink("config.json", t / "m" / "config.json") or t / "m",
                 ["config.json"]),
    ("path-symlink-loop", lambda t: os.symlink("loop", t / "loop") or t / "loop", ["loop", "symbolic links"]),
    ("path-missing", lambda t: t / "my-model" / "config.json", ["my-model/config.json': No such file or directory"]),
    ("path-fifo", lambda t: _fifo(t / "fifo.json"), ["fifo.json"]),
    ("path-dev-null", lambda t: Path("/dev/null"), ["/dev/null"]),
    ("path-dev-zero", lambda t: Path("/dev/zero"), ["/dev/zero"]),
    ("path-proc-file", lambda t: Path("/proc/self/status"), ["not valid JSON"]),
    ("path-name-too-long", lambda t: t / ("x" * 300 + ".json"), ["File name too long"]),
    ("path-dir-without-config", lambda t: ROOT / "data" / "models", ["directory has no config.json"]),
]


@pytest.mark.parametrize("setup, needles", cases(BAD_PATHS))
def test_bad_files(trainmem_bin, tmp_path, setup, needles):
    model = setup(tmp_path)
    # A reader that blocks (FIFO) must not block the suite: 10 s is ample for a bad file.
    assert_bad_input(run_cli(trainmem_bin, ["estimate", model, "--seq", "16"], timeout=10), *needles)


# ---- 4. odd but valid: must succeed ------------------------------------------------------------------

def _cfg_file(tmp_path, text, name="config.json"):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


# (id, setup(tmp_path) -> model argument, extra args)
ODD_BUT_VALID = [
    ("utf8-bom", lambda t: _cfg_file(t, b"\xef\xbb\xbf" + json.dumps(LLAMA).encode()), []),
    ("all-dims-1", lambda t: _cfg_file(t, with_(LLAMA, hidden_size=1, intermediate_size=1, vocab_size=1,
                                                num_attention_heads=1)), []),
    ("head-dim-not-dividing", lambda t: _cfg_file(t, with_(LLAMA, hidden_size=100, num_attention_heads=3, head_dim=6)), []),
    ("float-whole-dims", lambda t: _cfg_file(t, with_(LLAMA, hidden_size=64.0, num_hidden_layers=2.0)), []),
    ("duplicate-keys", lambda t: _cfg_file(t, json.dumps(LLAMA)[:-1] + ', "vocab_size": 200}'), []),
    ("unknown-keys", lambda t: _cfg_file(t, with_(LLAMA, rope_scaling={"type": "yarn"}, extra=[[[[1]]]])), []),
    ("seq-1-batch-1", lambda t: _cfg_file(t, json.dumps(GPT2)), ["--seq", "1"]),
    ("1e15-parameters", lambda t: _cfg_file(t, with_(LLAMA, hidden_size=2**20, intermediate_size=2**20,
                                                     vocab_size=2**20, num_hidden_layers=300, num_attention_heads=1024)), []),
    ("max-seq", lambda t: "qwen3-0.6b", ["--seq", "16777216"]),
    ("gpt2-all-positions", lambda t: "gpt2", ["--seq", "1024"]),
    ("gpt2-generation-to-the-last-position", lambda t: "gpt2", ["--inference", "--seq", "1000", "--new-tokens", "25"]),
    ("path-with-spaces-and-unicode", lambda t: _cfg_file(t, json.dumps(GPT2), name="my model \u00e9\u6a21\u578b.json"), []),
    # GPT2's 28,544 parameters (the config's count), in two tensors.
    ("dir-with-checkpoint", lambda t: _safetensors(_model_dir(t, json.dumps(GPT2)),
                                                   _st_json(_tensor_at("w", [64, 32], "BF16"),
                                                            _tensor_at("b", [26496], "F32", begin=4096)),
                                                   data_bytes=4096 + 4 * 26496), []),
    ("one-layer", lambda t: _cfg_file(t, with_(LLAMA, num_hidden_layers=1)), []),
    # A base-model export: AutoModelForCausalLM loads it as the causal LM.
    ("architectures-base-model", lambda t: _cfg_file(t, with_(LLAMA, architectures=["LlamaModel"])), []),
    ("one-layer-gpt2", lambda t: _cfg_file(t, with_(GPT2, n_layer=1)), []),
    pytest.param("non-utf8-path", lambda t: _cfg_file(t, json.dumps(GPT2), name=os.fsdecode(b"cfg\xff.json")), []),
]


@pytest.mark.parametrize("setup, extra", cases(ODD_BUT_VALID))
def test_odd_but_valid_inputs_succeed(trainmem_bin, tmp_path, setup, extra):
    model = setup(tmp_path)
    r = run_cli(trainmem_bin, ["estimate", model, "--json", *extra])
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-500:]!r}"
    assert r.stderr == b""
    j = json.loads(r.stdout)
    assert sum(j["breakdown_at_peak"].values()) == j["peak_allocated_bytes"]
    assert j["peak_reserved_bytes"] >= j["peak_allocated_bytes"]


def test_largest_grad_accum_finishes(trainmem_bin):
    """The largest accepted grad_accum (1024) finishes in seconds; anything larger is refused."""
    try:
        r = run_cli(trainmem_bin, ["estimate", "gpt2", "--seq", "128", "--grad-accum", "1024", "--json"], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("--grad-accum 1024 still running after 60 s")
    assert r.returncode == 0, r.stderr[-300:]
    r = run_cli(trainmem_bin, ["estimate", "gpt2", "--grad-accum", "1048576"], timeout=10)
    assert r.returncode == 2 and b"grad_accum: must be between 1 and 1024" in r.stderr


def test_deepest_model_with_most_micro_batches_is_bounded(trainmem_bin, tmp_path):
    """The largest accepted layers x micro-batches must be refused or finish, not run for hours."""
    cfg = tmp_path / "config.json"
    cfg.write_text(with_(LLAMA, hidden_size=8, intermediate_size=8, num_attention_heads=1, vocab_size=8,
                         num_hidden_layers=100000))
    try:
        r = run_cli(trainmem_bin, ["estimate", cfg, "--seq", "8", "--grad-accum", "1024"], timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("100000 layers x grad_accum 1024 still running after 15 s")
    assert_bad_input(r, "num_hidden_layers * grad_accum", "layer passes")


def test_input_count():
    """The size of the suite, for the record (README of tests/fuzz quotes it)."""
    n = len(BAD_ARGS) + len(BAD_CONFIGS) + len(BAD_SIZES) + len(BAD_PATHS) + len(ODD_BUT_VALID) + 2  # + the two work bounds
    assert n >= 100, n


# ---- compare's measured JSON, and the trace file -------------------------------------------------

MEASURED = {"model": "gpt2", "source": "measured-cpu", "recipe": {"seq": 16, "precision": "fp32"},
            "peak_allocated_bytes": 1 << 20, "breakdown_at_peak": {"weights": 1 << 20}}


def _measured(t, **changes):
    d = json.loads(json.dumps(MEASURED))
    for k, v in changes.items():
        d[k] = v
    path = t / "measured.json"
    path.write_text(json.dumps(d))
    return path


BAD_MEASUREMENTS = [
    ("deep-value", lambda t: _put(t / "m.json", json.dumps({**MEASURED, "peak": "DEEP"}).replace(
        '"DEEP"', "[" * 100000 + "]" * 100000).encode()) or t / "m.json", ["JSON nested deeper than 128 levels"]),
    ("fifo", lambda t: _fifo(t / "m.json"), ["is not a regular file"]),
    ("dev-zero", lambda t: Path("/dev/zero"), ["is not a regular file"]),
    ("missing", lambda t: t / "missing.json", ["cannot read", "No such file or directory"]),
    ("unknown-recipe-key", lambda t: _measured(t, recipe={"seq": 16, "grad-accum": 8}),
     ["recipe.grad-accum is not a knob trainmem-measure writes"]),
    ("rank-bytes-a-string", lambda t: _measured(t, recipe={"seq": 16, "gpus": 2, "parallel": "ddp"}, diagnostics={
        "parallel": {"ranks": [{"rank": 0, "peak_allocated_bytes": "abc"}]}}), ["'peak_allocated_bytes' (bytes)"]),
]


@pytest.mark.parametrize("setup, needles", cases(BAD_MEASUREMENTS))
def test_bad_measurements(trainmem_bin, tmp_path, setup, needles):
    assert_bad_input(run_cli(trainmem_bin, ["compare", setup(tmp_path), "--json"], timeout=20), *needles)


def test_compare_keeps_byte_counts_past_2_to_the_53(trainmem_bin, tmp_path):
    huge = 2**64 - 1  # read as an integer, never through a double
    path = _measured(tmp_path, breakdown_at_peak={"weights": huge})
    r = run_cli(trainmem_bin, ["compare", path, "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["categories"]["weights"]["measured"] == huge
    r = run_cli(trainmem_bin, ["compare", path])
    assert str(huge) in r.stdout.decode()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_trace_that_cannot_be_written_is_an_error(trainmem_bin):
    assert_bad_input(run_cli(trainmem_bin, ["estimate", "gpt2", "--seq", "16", "--trace", "/dev/full"]),
                     "trace: writing '/dev/full' failed")
    assert_bad_input(run_cli(trainmem_bin, ["estimate", "gpt2", "--seq", "16", "--trace", ""]), "trace: needs a file name")
