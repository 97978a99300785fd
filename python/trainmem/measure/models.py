"""Model resolution and construction for the measuring side.

The model argument is the one `trainmem estimate` takes: a catalog name or alias from
`data/models/index.json`, a path to a Hugging Face `config.json`, or a directory that holds one.
The model is always built from that config with random weights; nothing is downloaded.

Three ways to build it:

* real (CPU or CUDA): `AutoModelForCausalLM.from_config` inside Hugging Face's `no_init_weights`
  (the initialisers are skipped, the tied embeddings are tied again afterwards), then every
  parameter is filled with a fixed pseudo-random pattern. The values never change what is
  allocated, and this is much faster on a small CPU than the initialisers;
* fake: built on the meta device, then every parameter and buffer is replaced by a FakeTensor
  of the same shape and dtype (no memory, no compute), so 70B shapes can be measured anywhere.

With `lora_rank > 0` the built model is wrapped by `peft.get_peft_model` (see `apply_lora`):
after the pattern fill for a real model, before the fake replacement for a fake one (peft then
puts the adapters on the meta device like the base layers, and they become fake tensors too).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from .recipe import HF_ATTENTION, Recipe, RecipeError


class ModelError(ValueError):
    """The model argument does not name a catalog entry or a readable config (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str          # what the output's "model" key says
    config: dict       # the config.json content
    source: str        # where it came from (catalog file or path)


def resolved_for_model(spec: ModelSpec, recipe: Recipe) -> Recipe:
    """The recipe as the model runs it, as trainmem estimate takes it (detail::resolved_for_model in
    src/estimate.cpp): transformers has no SDPA for Gemma-2 (it refuses attn_implementation="sdpa"
    and loads Gemma-2 eager by default), so sdpa means eager there; GPT-2 fails past its positions."""
    if spec.config.get("model_type") == "gpt2":  # its learned positions end at n_positions
        limit = spec.config.get("n_positions", 1024)
        positions = recipe.seq + (recipe.new_tokens - 1 if recipe.is_inference else 0)
        if positions > limit:
            raise RecipeError(f"seq: {positions} positions (seq {recipe.seq}"
                              f"{f' and {recipe.new_tokens} new tokens' if recipe.is_inference else ''}) are past "
                              f"the model's {limit} (n_positions: GPT-2's position embedding has no row past them)")
    if spec.config.get("model_type") == "gemma2" and recipe.attention == "sdpa":
        return dataclasses.replace(recipe, attention="eager")
    return recipe


def data_dir() -> Path:
    """The repository's data/ folder (TRAINMEM_DATA_DIR overrides)."""
    env = os.environ.get("TRAINMEM_DATA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "data" / "models" / "index.json").is_file():
            return parent / "data"
    return here.parents[3] / "data"


def catalog() -> list[dict]:
    index = data_dir() / "models" / "index.json"
    if not index.is_file():
        return []
    with open(index) as f:
        return json.load(f)


def _read_config(path: Path) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read model config {path}: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{path} is not a Hugging Face config.json (no model_type key)")
    if not isinstance(config["model_type"], str) or not config["model_type"].isprintable():
        raise ModelError(f"{path}: model_type must be a name, got {config['model_type']!r}"[:300])
    for key in ("rope_scaling", "rope_parameters"):  # transformers fails on an unknown kind with a KeyError
        rope = config.get(key)
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if kind is not None and kind != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if kind not in ROPE_INIT_FUNCTIONS:
                raise ModelError(f"{path}: {key} rope_type {kind!r} is not one transformers knows "
                                 f"({', '.join(['default', *sorted(ROPE_INIT_FUNCTIONS)])})"[:300])
    for key in ("num_hidden_layers", "n_layer"):  # the engine's bound: past it building the model never ends
        layers = config.get(key)
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > 100_000:
            raise ModelError(f"{path}: {key} must be between 1 and 100000, got {layers}")
    return config


def resolve_model(arg: str) -> ModelSpec:
    """Catalog name/alias/hf_id (case-insensitive), a config.json path, or a model directory."""
    wanted = arg.strip().lower()
    for entry in catalog():
        names = [entry.get("name", ""), entry.get("hf_id", ""), *entry.get("aliases", [])]
        if wanted in (n.lower() for n in names if n):
            path = data_dir() / "models" / entry["file"]
            return ModelSpec(entry["name"], _read_config(path), str(path))
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"{arg} is a directory without a config.json")
    if path.is_file():
        return ModelSpec(arg, _read_config(path), str(path))
    names = sorted(e["name"] for e in catalog())
    hint = f"; catalog names: {', '.join(names)}" if names else " (no catalog found under data/models)"
    raise ModelError(f"unknown model {arg!r}: not a catalog name and not a config.json path{hint}")


def hf_config(config: dict):
    from transformers import AutoConfig

    data = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as e:  # ValueError, KeyError, huggingface_hub's StrictDataclassFieldValidationError...
        detail = " ".join(str(e).split())[:300]  # one line, whatever the message holds
        raise ModelError(f"transformers cannot build a config for model_type={model_type!r}: "
                         f"{type(e).__name__}: {detail}") from None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(recipe: Recipe) -> torch.dtype:
    return _DTYPES[recipe.weight_dtype_name]


def compute_dtype(recipe: Recipe) -> torch.dtype:
    """The matmuls' dtype: autocast's under bf16-/fp16-mixed, else the weights'."""
    return _DTYPES[recipe.autocast_dtype_name or recipe.weight_dtype_name]


def _causal_lm_from_config(cfg, recipe: Recipe):
    from transformers import AutoModelForCausalLM

    attn = HF_ATTENTION[recipe.attention]
    try:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=model_dtype(recipe))
    except ImportError as e:  # flash_attention_2 without the flash-attn package
        raise RecipeError(f"attention={recipe.attention} is not available here: {e}") from None
    except ValueError as e:
        if "attn" in str(e).lower() or "attention" in str(e).lower():
            raise RecipeError(f"attention={recipe.attention} is not available for this model here: {e}") from None
        raise


@torch.no_grad()
def _fill_pattern(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter with a fixed pattern of N(0, 0.02) values (cheap, finite, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(1 << 20, generator=gen) * 0.02)
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        flat = p.data.view(-1)
        src = base.to(device=flat.device, dtype=flat.dtype)
        for start in range(0, flat.numel(), src.numel()):
            n = min(src.numel(), flat.numel() - start)
            flat[start:start + n].copy_(src[:n])


def build_real_model(spec: ModelSpec, recipe: Recipe, device: str):
    from transformers.initialization import no_init_weights

    cfg = hf_config(spec.config)
    with torch.device(device), no_init_weights():
        model = _causal_lm_from_config(cfg, recipe)
    model.tie_weights()
    _fill_pattern(model)
    if recipe.is_quantized:
        model = build_quantized_model(model, recipe, device)
    if recipe.uses_lora:
        model = apply_lora(model, recipe)
    model.train()
    return model


def build_fake_model(spec: ModelSpec, recipe: Recipe, fake_mode, device: str):
    """Meta construction, then every parameter, buffer and tensor attribute becomes a FakeTensor."""
    cfg = hf_config(spec.config)
    with torch.device("meta"):
        model = _causal_lm_from_config(cfg, recipe)
    model.tie_weights()
    if recipe.uses_lora:
        model = apply_lora(model, recipe)
    memo: dict[int, torch.Tensor] = {}  # id of the meta tensor -> its fake replacement
    originals: list[torch.Tensor] = []  # keeps the meta tensors alive so that ids stay unique

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            originals.append(t)
            with fake_mode:
                memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return memo[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                originals.append(p)
                with fake_mode:
                    data = torch.empty(p.shape, dtype=p.dtype, device=device)
                memo[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake_like(b)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(module, name, fake_like(value))
    model.train()
    return model


# ---------------------------------------------------------------------------------------- QLoRA

_QUANT_STORAGE = {"uint8": torch.uint8, "bf16": torch.bfloat16}


def bnb_config(recipe: Recipe):
    """transformers' BitsAndBytesConfig as a QLoRA (or 4-bit inference) script writes it;
    bnb_4bit_compute_dtype is the precision's dtype (transformers' own default would be float32).
    8-bit: BitsAndBytesConfig(load_in_8bit=True) with transformers' defaults (llm_int8_threshold 6.0,
    llm_int8_has_fp16_weight False, lm_head kept)."""
    from transformers import BitsAndBytesConfig

    if recipe.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=recipe.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=recipe.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(recipe),
                              bnb_4bit_quant_storage=_QUANT_STORAGE[recipe.bnb_4bit_quant_storage])


def build_quantized_model(model, recipe: Recipe, device: str):
    """The base model as a bitsandbytes user gets it: a checkpoint loaded with a BitsAndBytesConfig,
    then, for training (QLoRA), `peft.prepare_model_for_kbit_training`.

    Nothing can be downloaded, so the checkpoint is the built (pattern-filled) model saved to a
    temporary directory. `from_pretrained` replaces every linear layer of the decoder layers by
    bitsandbytes' Linear4bit (Linear8bitLt with load_in_8bit) and quantizes its weight as it is
    loaded (Params4bit: packed uint8 and a QuantState; Int8Params: int8 CB and its fp32 row
    scales SCB); the embeddings, lm_head and norms stay in the load dtype: the precision's weights'
    dtype, or the half of recipe.load_dtype "bf16" / "fp16" (the QuantState's dtype then too).
    For training, prepare_model_for_kbit_training then freezes every parameter and casts every
    bf16/fp16 parameter that is not 4-bit to float32 (`param.data = param.data.to(torch.float32)`:
    the embeddings, norms and lm_head become fp32, and so does the residual stream). It is called
    with use_gradient_checkpointing=False: with True (its default) it would turn on Hugging Face's
    *reentrant* checkpointing; the recipe's checkpointing knob turns on the non-reentrant one, or
    with full-reentrant that one (enable_checkpointing), as for every other recipe. Inference (generate()) uses the
    loaded model as it is: nothing is cast.
    """
    import tempfile

    key = "load_in_8bit" if recipe.load_in_8bit else "load_in_4bit"
    try:
        import bitsandbytes  # noqa: F401
        if not recipe.is_inference:
            from peft import prepare_model_for_kbit_training
    except ImportError as e:
        raise RecipeError(f"{key} needs the bitsandbytes and peft packages: {e}") from None
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the save and load bars would fill the CLI's stderr
    with tempfile.TemporaryDirectory(prefix="trainmem-qlora-") as tmp:
        # Each rank of a data-parallel run quantizes its own copy from its own directory;
        # save_pretrained writes on rank 0 only once torch.distributed is up (should_save_on_this_rank).
        model.should_save_on_this_rank = lambda is_main_process: True
        model.save_pretrained(tmp)
        del model
        load = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.load_dtype, model_dtype(recipe))
        quantized = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=bnb_config(recipe), dtype=load, device_map=device,
            attn_implementation=HF_ATTENTION[recipe.attention])
    if device == "cpu":
        _generic_bitsandbytes_cpu_kernels(quantized, recipe)
    if recipe.is_inference or not recipe.prepare_kbit_training:  # sharded QLoRA keeps the half rest
        return quantized
    return prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=False)


def _generic_bitsandbytes_cpu_kernels(model, recipe: Recipe) -> None:
    """Note [bitsandbytes' CPU kernels]
    The CPU runs stand in for CUDA ones, so they must allocate the same on every machine.
    bitsandbytes 0.50 picks other kernels on a CPU with AVX-512: with AVX512-BF16 an eval-mode
    Linear4bit repacks its weight for a fused kernel at its first forward
    (`_convert_weight_packed_for_cpu`, a uint8 reshuffle through int32 and uint8 temporaries) and
    then runs `gemv_4bit`; when torch's CPU capability is AVX512, `int8_linear_matmul` gets a CPU
    kernel (`torch._int_mm`, one opaque op) instead of the generic fp32 matmul, whose `float()`
    copies the tracker sees. The engine models the generic kernels, those of a CPU without
    AVX-512, where the corpus's quantized entries were measured. So the measurement is pinned to
    them: no repacking (per module), and torch's capability capped at AVX2 by
    ATEN_CPU_CAPABILITY=avx2, which trainmem.measure sets before torch is imported (torch reads
    it once; bitsandbytes registers its kernels when imported). (The dequantize_4bit fallback
    for blocksizes of 2048 and more is not pinned; no recipe uses one.)
    That cap alone breaks bf16 SDPA on a CPU with AMX: torch's CPU flash attention asks oneDNN
    whether to pack its bf16 blocks, oneDNN says yes, and the packing kernel only exists in the
    AVX512 build ("pack_vnni2 is only supported when avx512 is supported"). So oneDNN is capped
    too, ONEDNN_MAX_CPU_ISA=AVX2 (read when oneDNN first runs), and attention takes the unpacked
    path of a CPU without AVX-512: cpu-pp2-llamaw512l4-bf16true-adamw-ga2-b1s64, measured on
    such a CPU, re-measured to the byte on an AMX one with both caps."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    if recipe.load_in_8bit and torch.backends.cpu.get_cpu_capability() == "AVX512":
        raise RecipeError("load_in_8bit on this CPU: torch was imported with AVX512 kernels, so bitsandbytes "
                          "uses torch._int_mm; set ATEN_CPU_CAPABILITY=avx2 before torch is imported "
                          "(trainmem-measure does; see Note [bitsandbytes' CPU kernels])")


def quant_state_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The tensors of bitsandbytes weights that are neither parameters nor buffers, module order:
    every 4-bit weight's QuantState (absmax: fp32 per block of 64, or with double quant uint8; the
    16-entry code; with double quant the offset and the nested state's fp32 absmax and 256-entry
    code), and every 8-bit weight's SCB (fp32 per output row; its CB is the parameter's data)."""
    out = []
    # Under FSDP2 a parameter is a DTensor shard that no longer carries its QuantState; bnb's
    # Linear4bit keeps it as the module's `quant_state` too (and gives it back to the gathered
    # weight before each matmul: fix_4bit_weight_quant_state_from_module), so the module's is read.
    owners = [(name, p) for name, p in model.named_parameters()]
    owners += [(f"{name}.weight", m) for name, m in model.named_modules()
               if getattr(m, "quant_state", None) is not None
               and getattr(getattr(m, "weight", None), "quant_state", None) is None]
    for name, p in owners:
        scb = getattr(p, "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append((f"{name}.SCB", scb))
        state = getattr(p, "quant_state", None)
        if state is None:
            continue
        for key in ("absmax", "code", "offset"):
            t = getattr(state, key, None)
            if isinstance(t, torch.Tensor):
                out.append((f"{name}.quant_state.{key}", t))
        nested = getattr(state, "state2", None)
        if nested is not None:
            for key in ("absmax", "code"):
                t = getattr(nested, key, None)
                if isinstance(t, torch.Tensor):
                    out.append((f"{name}.quant_state.state2.{key}", t))
    return out


# ---------------------------------------------------------------------------------------- LoRA

def _path_in_layer(qualname: str) -> str | None:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj`; None outside the decoder layers.

    The same rule as the tracker's labels: the part after the first numeric component.
    """
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[i + 1:]) or None
    return None


def _linear_types() -> tuple:
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def _peft_matches(qualname: str, target: str) -> bool:
    """peft's rule for a list of target names: the name itself, or a suffix after a dot."""
    return qualname == target or qualname.endswith("." + target)


def lora_target_paths(model, recipe: Recipe) -> tuple[list[str] | str | None, list[str]]:
    """Resolve `recipe.lora_targets` for this model, as the engine does (src/recipe/lora.cpp).

    Returns (what to pass as LoraConfig.target_modules, the resolved paths inside a decoder
    layer in the layer's module order). `default` passes None: peft looks up its own default
    for the model type; `all-linear` is passed as such (peft then wraps every nn.Linear and
    Conv1D except the output layer). Names are peft's: they match a module whose qualified name
    is the name or ends with "." + name. Names that match no linear layer of the decoder layers,
    or that would also wrap a linear layer outside them (lm_head), are refused as the engine
    refuses them.
    """
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    model_type = getattr(model.config, "model_type", "?")
    linear = _linear_types()
    inside: list[str] = []   # paths in a layer, in module order
    outside: list[str] = []  # qualified names of linear layers outside the decoder layers
    for qualname, module in model.named_modules():
        if not isinstance(module, linear):
            continue
        path = _path_in_layer(qualname)
        if path is None:
            outside.append(qualname)
        elif path not in inside:
            inside.append(path)
    names = recipe.lora_target_names
    short = ", ".join(p.rsplit(".", 1)[-1] for p in inside)
    if names == ["default"]:
        default = peft_defaults.get(model_type)
        if not default:
            raise RecipeError(f"lora_targets: peft has no default target modules for {model_type}; "
                              f"name them ({short}) or use all-linear")
        peft_targets, names = None, list(default)
    elif names == ["all-linear"]:
        return "all-linear", inside
    else:
        peft_targets = names
    chosen = set()
    for name in names:
        hits = [p for p in inside if _peft_matches(p, name)]
        if not hits:
            raise RecipeError(f"lora_targets: {name!r} names no linear layer of {model_type} decoder layers; "
                              f"expected some of {short}, default or all-linear")
        stray = [q for q in outside if _peft_matches(q, name)]
        if stray:
            raise RecipeError(f"lora_targets: {name!r} would also wrap {', '.join(stray)} outside the decoder "
                              "layers; name the layers' modules only")
        chosen.update(hits)
    return peft_targets, [p for p in inside if p in chosen]


def apply_lora(model, recipe: Recipe):
    """Wrap a built model with peft's LoRA, as a user does: `get_peft_model(model, LoraConfig(...))`.

    r = lora_rank, lora_alpha = 2·r, lora_dropout, bias="none", peft's defaults otherwise:
    autocast_adapter_dtype=True (bf16/fp16 adapters are made fp32), init_lora_weights=True
    (A kaiming-uniform, B zeros). GPT-2's Conv1D layers need fan_in_fan_out=True. peft freezes
    every base parameter; only the adapters require grad. The resolved paths are kept on the
    returned PeftModel as `trainmem_lora_targets` (the JSON's `recipe.lora_targets`).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise RecipeError(f"lora_rank > 0 needs the peft package: {e}") from None
    from transformers.pytorch_utils import Conv1D

    peft_targets, paths = lora_target_paths(model, recipe)
    fan_in_fan_out = any(isinstance(m, Conv1D) for q, m in model.named_modules() if _path_in_layer(q) in paths)
    config = LoraConfig(r=recipe.lora_rank, lora_alpha=2 * recipe.lora_rank, lora_dropout=float(recipe.lora_dropout),
                        target_modules=peft_targets, bias="none", fan_in_fan_out=fan_in_fan_out)
    peft_model = get_peft_model(model, config)
    wrapped = []
    for qualname, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            path = _path_in_layer(qualname)
            if path is None:
                raise RuntimeError(f"peft wrapped {qualname}, outside the decoder layers")
            if path not in wrapped:
                wrapped.append(path)
    if set(wrapped) != set(paths):  # our resolution and peft's disagree: the JSON would lie
        raise RuntimeError(f"peft wrapped {wrapped}, but lora_targets resolved to {paths}")
    peft_model.trainmem_lora_targets = paths
    return peft_model


def lora_targets_of(model) -> list[str] | None:
    return getattr(model, "trainmem_lora_targets", None)


def underlying_model(model):
    """The Hugging Face model inside a PeftModel, DistributedDataParallel or a DeepSpeed engine (the
    model itself otherwise)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def enable_checkpointing(model, reentrant: bool = False) -> None:
    """Hugging Face's full activation checkpointing, non-reentrant, or with `reentrant` the
    reentrant variant (torch.utils.checkpoint's use_reentrant=True; see the package docstring)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # older transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
