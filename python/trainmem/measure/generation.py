"""The reference generation (recipe mode `inference`), driven under the tracker.

Both trainmem sides model this call (the engine predicts it, this package measures it):

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=..., dtype=...)   # fp32 / bf16 / fp16
    model.eval()
    input_ids = randint(vocab, (batch, seq))
    attention_mask = ones(batch, seq, dtype=int64)          # what a tokenizer gives for unpadded prompts
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=new_tokens, num_beams=beams, do_sample=False,
                             eos_token_id=None,             # no early stop: exactly new_tokens tokens
                             pad_token_id=0, use_cache=True)
    del out                                                 # the output is dropped at once

transformers' defaults otherwise: no generation_config is passed, so generate() starts from the
model's own (built from config.json by from_config) and the keywords above override it; the
cache is the default DynamicCache built from the model's config.

Phases and labels (see tracker.py, Note [Labels]):

* `setup` (step 0): the inputs (category `other`), the weights (registered before).
* `prefill` (step 1, micro_batch 0): from the generate() call through the first forward over the
  prompt and the selection of the first new token: generate()'s preparation (generation config,
  special-token tensors, position ids, the cache object, beam search's buffers) and
  `prepare_inputs_for_generation` for the first forward are in it.
* `decode` (step 1, micro_batch i = 1 .. new_tokens - 1): the i-th later forward, from the
  `prepare_inputs_for_generation` call that makes its inputs through its token selection (and,
  with beams, the cache reordering); dropping the output is in the last one.
* ops outside the model are labelled `generate.<aten op>`; ops inside it as in training.

Categories (tracker.py, Note [Categories]): weights = parameters and buffers; activations = the
KV cache (every storage that is, at some point, a key or value tensor held by a cache layer:
marked after every `Cache.update` and `Cache.reorder_cache`); other = the two inputs the driver
makes; temporaries = everything else.

What transformers does with these arguments (5.24): it uses the model's GenerationConfig
(from_config makes one from config.json: bos/eos/pad ids) under the keywords; eos_token_id=None
really removes the eos stopping criterion (exactly max_new_tokens tokens, `new_tokens` forwards:
one prefill and new_tokens - 1 decodes; the last token is selected but never fed back, so the
cache ends at seq + new_tokens - 1 positions). No cache_implementation is set for any catalog
model, so every model gets `DynamicCache(config=...)`, Gemma-2 and Phi-3 included: the cache
builds one layer per decoder layer from `config.layer_types` (or from `sliding_window` when
there are none): `DynamicSlidingWindowLayer` for sliding layers (Gemma-2's even layers, window
4096; every Phi-3 layer, window 2047), `DynamicLayer` for the rest (Mistral v0.3 has no window).
No compiled forward (only static caches are compiled), no deferred stop check (MPS only).
With these arguments generate() logs no warning (checked at warning verbosity; the measuring
side sets error verbosity anyway). Gemma-2 refuses attn_implementation="sdpa" at construction
(transformers 5.24), so it is measured with eager only.

Note [What generate allocates]
    Seen in the traces of the ground-truth corpus (transformers 5.24, torch 2.13, CPU);
    b = batch, k = beams, s = seq, V = vocab, L = decoder layers, t = positions cached so far.

    Before the first forward (phase prefill): 0-dim int64 tensors for the special tokens
    (pad, and bos where the config has one: 512 B each, alive until generate returns); the
    position ids, `attention_mask.cumsum(-1) - 1` masked where the mask is 0: (b, s) int64
    (with beams the (b·k, s) expansion), held by generate()'s frame for the whole call while the
    loop grows its own copies; then, the mask being all ones, generate() *drops the attention
    mask* (it passes None to the model, so no mask grows) after a `(mask == 1).all()` check;
    there is no cache_position any more (the position ids play its part); the cache object
    (a sliding layer holds a 0-dim int64 copy of its window, 512 B, until generate returns);
    `unfinished_sequences` (b,) int64. With beams: input_ids and position ids are
    `repeat_interleave`d to (b·k, s) int64 (the original input_ids stays referenced too), and
    beam search allocates its fixed-size state: running sequences (b, k, s + n) int64 and a
    clone, running/finished scores (b, k) fp32, flags, beam indices (b, k, n) int32 and a clone
    (n = new_tokens). All these are small.

    Each forward (prefill and decode): `prepare_inputs_for_generation` clones the input ids it
    feeds ((b·k, s) in prefill, (b·k, 1) after) and, in decode, the last column of the
    position ids ((b·k, 1)); the model is called with logits_to_keep=1 (every model measured
    here supports it), so the head runs on the last position only: logits (b·k, 1, V) in the
    weights' dtype, never (b·k, s, V), in prefill too. Gemma-2's final softcapping makes three
    more (b·k, 1, V) tensors in turn (div, tanh, mul; each frees the previous).

    The KV cache (`DynamicLayer.update`): no preallocation. The first update concatenates an
    empty tensor with the new keys, so the prefill's cache is a *copy* of the rotated keys and
    of the values, (b·k, kv_heads, s, head_dim) each, in the weights' dtype (GPT-2: 12 heads of
    64), contiguous; the rotated key tensor is freed after. Every decode update is again
    `torch.cat([cache, new], dim=-2)` per layer, keys then values: the (t + 1)-long tensor is
    allocated while the t-long one is alive, then the old one is freed; so the transient on top
    of the cache is one layer's keys (or values) of t positions. A sliding layer keeps a view
    (slice) of the concatenation, the same storage (at these lengths, below the window, nothing
    is dropped). After the last forward the cache holds seq + new_tokens - 1 positions:
    2 · L · b · k · kv_heads · (s + n - 1) · head_dim · dtype bytes.

    After each forward, outside the model (label generate.*): position ids grow by one column
    (arange + add + cat: a new (b·k, t + 1) int64, old freed); the float32 copy of the last
    logits `logits[:, -1].to(float32, copy=True)`: (b·k, V) fp32, made even when the logits are
    already fp32. Greedy: argmax (b,) int64, input_ids `cat` to (b, t + 1) int64, stopping
    criteria and `unfinished_sequences` bookkeeping ((b,) bool/int64, 0-dim max/eq), then the
    model output (the logits) is deleted. The fp32 copy and the argmax of step i stay alive
    (loop variables) until step i + 1 has made its own: the peak of a decode step with a large
    vocabulary is at its `_to_copy`: logits (b, V, weights' dtype) + the previous fp32 copy +
    the new one. Beam search: log_softmax of the fp32 copy (b·k, V) fp32, plus the running beam
    scores: another (b, k, V) fp32, viewed as (b, k·V); topk of 2k over it; gathers of the
    running sequences/indices ((b, 2k, s + n) int64, (b, 2k, n) int32), merges with the
    finished ones ((b, 3k, ...) cats), topk of k; again the previous step's fp32 copy and
    its (b, k, V) scores stay alive until the new ones exist, so at the new `_to_copy` four
    (b·k, V) fp32-sized tensors are live (logits in the weights' dtype, old copy, old scores,
    new copy), and at the `_log_softmax` again four. Then, after every forward including the
    last, `cache.reorder_cache(beam_idx)`: per layer `keys.index_select(0, idx)` then
    `values.index_select(0, idx)`, each a new full-size tensor allocated before the old one is
    freed (transient: one layer's keys of t + 1 positions).

    The causal mask: with sdpa and no padding no mask is ever materialized (prefill and
    decode: the model passes None and SDPA runs causal); with eager a 4D additive mask
    (b·k, 1, q, t) in the weights' dtype is built per forward (prefill (b·k, 1, s, s), decode
    (b·k, 1, 1, t + 1)), from a bool (1, 1, q, t) and alive through the forward; Gemma-2 builds
    two per forward (full and sliding window), Phi-3 one (every layer sliding). Eager attention
    with GQA repeats keys and values (`repeat_kv`: expand + reshape, a (b·k, heads, t, d) copy
    each) per layer and forward; Gemma-2's attention softcapping and every eager softmax upcast
    to fp32 are as in training.

    Model-specific: GPT-2 keeps the word and position embedding outputs (b·k, q, 768) through
    the forward and computes its tanh-GELU op by op; its keys and values are views of c_attn's
    output until the cache copies them. Gemma-2 scales the embeddings (a second (b, q, h)
    tensor) and softcaps the logits. Phi-3's fused qkv_proj output (b·k·q, 3·h) lives until
    o_proj; its RoPE ends in a `cat` with the (empty) pass-through part, one more copy of q and
    k. The returned sequences ((b, s + n) int64, greedy and beam search alike) are dropped by
    the driver at once; when generate returns, the cache, the scores and everything else are
    freed: only the weights are left.
"""

from __future__ import annotations

import functools

import torch

from .recipe import Recipe
from .tracker import MemoryTracker


def _cache_of(kwargs: dict):
    for key in ("cache", "past_key_values"):
        value = kwargs.get(key)
        if value is not None and hasattr(value, "layers"):
            return value
    return None


class _CacheWatcher:
    """Marks every key/value storage a cache holds as `activations`, after each update and reorder.

    The hooks are instance attributes on the cache object generate() creates (found in the kwargs
    of `prepare_inputs_for_generation`), so any cache class works and nothing global is patched.
    """

    def __init__(self, tracker: MemoryTracker, info: dict) -> None:
        self.tracker = tracker
        self.info = info
        self.caches: list = []

    def watch(self, cache) -> None:
        if cache is None or any(c is cache for c in self.caches):
            return
        self.caches.append(cache)
        self.info.setdefault("cache_class", type(cache).__name__)
        update, reorder = cache.update, getattr(cache, "reorder_cache", None)

        @functools.wraps(update)
        def tracked_update(key_states, value_states, layer_idx, *args, **kwargs):
            out = update(key_states, value_states, layer_idx, *args, **kwargs)
            self.mark_layer(cache.layers[layer_idx])
            return out

        cache.update = tracked_update
        if reorder is not None:
            @functools.wraps(reorder)
            def tracked_reorder(beam_idx, *args, **kwargs):
                out = reorder(beam_idx, *args, **kwargs)
                self.info["cache_reorders"] = self.info.get("cache_reorders", 0) + 1
                for layer in cache.layers:
                    self.mark_layer(layer)
                return out

            cache.reorder_cache = tracked_reorder

    def mark_layer(self, layer) -> None:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                self.tracker.mark(t, "activations")

    def summary(self) -> dict:
        """Layer classes and the final key/value shapes of the (first) cache."""
        if not self.caches:
            return {}
        cache = self.caches[0]
        layers = []
        for layer in cache.layers:
            keys = getattr(layer, "keys", None)
            layers.append({"class": type(layer).__name__,
                           "keys": list(keys.shape) if isinstance(keys, torch.Tensor) else None,
                           "dtype": str(keys.dtype).replace("torch.", "") if isinstance(keys, torch.Tensor) else None})
        return {"layers": layers}

    def release(self) -> None:
        for cache in self.caches:
            for name in ("update", "reorder_cache"):
                cache.__dict__.pop(name, None)
        self.caches.clear()


def run_generation(model: torch.nn.Module, recipe: Recipe, tracker: MemoryTracker, *, device: str,
                   make_inputs, fake_mode=None) -> dict:
    """One generate() call of the reference generation under an active tracker.

    make_inputs() makes (input_ids, attention_mask) (category other). Returns what the run saw:
    forwards, prepare_inputs calls, cache class and final shapes, output shape.
    """
    info: dict = {"forwards": 0}
    watcher = _CacheWatcher(tracker, info)
    tracker.set_phase("setup", 0, 0)
    with tracker.forced("other"):
        input_ids, attention_mask = make_inputs()

    calls = {"prepare": 0}
    original_prepare = model.prepare_inputs_for_generation

    @functools.wraps(original_prepare)
    def prepare_inputs_for_generation(*args, **kwargs):
        calls["prepare"] += 1
        if calls["prepare"] > 1:  # the inputs of decode forward i start decode phase i
            tracker.set_phase("decode", 1, calls["prepare"] - 1)
        watcher.watch(_cache_of(kwargs))
        return original_prepare(*args, **kwargs)

    def count_forward(module, args, kwargs):
        info["forwards"] += 1
        watcher.watch(_cache_of(kwargs))

    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    handle = model.register_forward_pre_hook(count_forward, with_kwargs=True)
    try:
        tracker.set_phase("prefill", 1, 0)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=recipe.new_tokens, num_beams=recipe.beams, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, use_cache=True)
        # A config that asks for hidden states, attentions or scores (return_dict_in_generate and the
        # output_* keys) makes generate() return an output object; its sequences are the tensor.
        info["output_shape"] = list(getattr(out, "sequences", out).shape)
        info["cache"] = watcher.summary()
        del out
        tracker.collect_garbage()
    finally:
        handle.remove()
        model.__dict__.pop("prepare_inputs_for_generation", None)
        watcher.release()
    info["prepare_inputs_calls"] = calls["prepare"]
    return info
