// Generation (Mode::kInference): one call of transformers' model.generate(), greedy or beam
// search, with its KV cache, on the step builder of step_builder.h (Note [Generation]).
#include "graph/step_builder.h"

namespace trainmem::graph::step {

// Note [Sliding-window layers]
// DynamicCache(config=...) gives every layer whose config slides a DynamicSlidingWindowLayer
// (cache_utils.get_layer_types_and_kwargs): the layer_types list when the config has one,
// otherwise "sliding_attention" wherever config.sliding_window is set. Which layers slide, and
// with which window, comes from the model stage (model::attention_windows, with each config
// class's defaults: config.cpp, parse_generation_keys); so does whether the config has a
// bos_token_id, which generate() turns into a 0-dim device tensor.

// Note [Generation]
// Mode::kInference mirrors one call of transformers 5.25's model.generate() with the reference
// arguments of docs/schema.md (greedy or beam search, max_new_tokens, eos_token_id=None,
// pad_token_id=0, use_cache=True, the default DynamicCache), model in eval mode, under
// torch.no_grad(). Nothing requires grad, so no op records a node and nothing is saved: a
// tensor lives exactly as long as a Python reference holds it. That makes the lifetimes of
// the Python variables the whole story, and the builders below follow the modules' forward
// code variable by variable (no grad: the training builders' order of frees is not the one
// that counts here):
//  * generate() before the first forward (generation/utils.py): the special tokens become
//    0-dim int64 tensors (bos from the model config, pad; eos is None), kept by the generation
//    config until generate returns; batch > 1 checks right padding (attention_mask[:, -1] ==
//    0).any(); position_ids = attention_mask.cumsum(-1) - 1, masked_fill(mask == 0, 0) (kept
//    by generate's model_kwargs to the end); an all-ones mask is dropped from model_kwargs
//    ((mask == 1).all()), so no mask grows and SDPA runs without one; beam search expands
//    input_ids and position_ids by repeat_interleave; the logits processors check
//    (input_ids < 0).any();
//  * every forward gets input_ids[:, -q:].clone() and position_ids[..., -q:].clone() (q = the
//    prompt length for the prefill, no clone of position_ids then, 1 per decode step) from
//    prepare_inputs_for_generation, logits_to_keep=1 (lm_head on the last position only), and
//    the cache. The clones live until the next step's inputs replace them (the prefill's
//    until _prefill returns);
//  * DynamicLayer.update: keys = torch.cat([keys, key_states], dim=-2), the same for values.
//    The prefill's cat with the empty initial tensor copies the new keys; every decode step
//    allocates the grown cache and frees the old one. Cache tensors are `activations` (the
//    measuring side's category for the KV cache), [batch·beams, kv_heads, len, head_dim];
//  * after each forward (_sample): position_ids grow by cat (arange + last + 1), logits[:, -1]
//    is copied to fp32 (.to(copy=True)), argmax, input_ids grow by cat, the stopping criteria
//    (MaxLengthCriteria: full | full, ~, &) and max() == 0, then `del outputs` frees the logits;
//  * SDPA: no mask, so GQA is native (enable_gqa) and there is no repeat_kv; eager builds the
//    4-D float mask in every forward (masking_utils) and repeats K/V (Note [Generation masks]);
//    sliding-window layers: Note [Sliding-window layers]; beam search: Note [Beam search];
//  * when generate returns, its tensors go, then the output (the caller drops it), the cache
//    (last layer first), then the caller's batch.
// Every cpu-gen-* measurement of data/ground_truth matches this event by event (sizes,
// categories and order; docs/mechanics_notes.md, "Generation").
// max_new_tokens forwards run: the prefill (micro_batch 0) and new_tokens - 1 decode steps
// (micro_batch i for the i-th).

Trace StepBuilder::build_generation() {
  if (r_.lora.enabled()) throw Error("lora_rank: inference with adapters is not modelled (merge them first)");
  const std::uint64_t N = r_.new_tokens, K = r_.beams;
  // Every forward of every layer is simulated: bound the work so the largest accepted input
  // finishes in seconds (Llama-3.1-70B: 80 layers x 3,276 new tokens).
  constexpr std::uint64_t kMaxLayerPasses = std::uint64_t{1} << 18;
  if (detail::mul(a_.num_layers, N, "layers * new_tokens") > kMaxLayerPasses) {
    throw Error("num_hidden_layers * new_tokens = " + std::to_string(a_.num_layers * N) +
                " layer passes is more than trainmem simulates (" + std::to_string(kMaxLayerPasses) +
                "); use fewer new_tokens");
  }
  Bg_ = detail::mul(B_, K, "batch * beams");
  const std::uint64_t total = S_ + N;
  detail::mul({Bg_, a_.num_heads + 2 * a_.num_kv_heads, total, a_.head_dim, 8}, "KV cache bytes");
  detail::mul({Bg_, a_.num_heads, S_, total, 8}, "attention scores bytes");
  detail::mul({Bg_, total, std::max({a_.hidden_size, a_.intermediate_size * 2, a_.vocab_size}), 8},
              "tokens * width bytes");
  t_.step = 1;
  t_.micro = 0;
  t_.at(Phase::kSetup, kNoLayer, "model");
  create_parameters();
  for (Param& p : params_) p.trainable = false;  // eval under no_grad: nothing requires grad
  t_.at(Phase::kSetup, kNoLayer, "batch");
  input_ids_ = t_.make(tok_, DType::kI64, Category::kOther);
  T attention_mask = t_.make(tok_, DType::kI64, Category::kOther);  // kept by the caller
  kc_.assign(a_.num_layers, T{});
  vc_.assign(a_.num_layers, T{});
  stored_.assign(a_.num_layers, 0);
  swt_.assign(a_.num_layers, T{});

  phase_ = Phase::kPrefill;
  layer_ = kNoLayer;
  // ---- generate(): before the first forward
  op("generate.special_tokens");
  T bos = a_.bos_token ? fresh(1, DType::kI64) : T{};  // bos_token_id from the model config
  T pad = fresh(1, DType::kI64);                    // pad_token_id=0
  if (B_ > 1) {
    op("generate.padding_check");
    T last = fresh(B_, DType::kU8);
    T any = fresh(1, DType::kU8);
    t_.drop(last);
    t_.drop(any);
  }
  op("generate.position_ids");
  T cs = fresh(tok_, DType::kI64);
  T m1 = fresh(tok_, DType::kI64);
  t_.drop(cs);
  T zero = fresh(tok_, DType::kU8);
  T pos0 = fresh(tok_, DType::kI64);
  t_.drop(zero);
  t_.drop(m1);
  op("generate.mask_check");
  {
    T eq = fresh(tok_, DType::kU8);
    T all = fresh(1, DType::kU8);
    t_.drop(eq);
    t_.drop(all);
  }
  T ids = t_.ref(input_ids_);  // the growing input_ids
  T pos = t_.ref(pos0);        // model_kwargs["position_ids"] of the decoding loop
  T pos_expanded;
  if (K > 1) {
    // _expand_inputs_for_generation: repeat_interleave(K, dim=0) of input_ids, then of the
    // tensors in model_kwargs (position_ids).
    op("generate.expand_inputs");
    T ie = expand_rows(ids);
    t_.drop(ids);
    ids = ie;
    pos_expanded = expand_rows(pos);
    t_.drop(pos);
    pos = t_.ref(pos_expanded);
    t_.drop(pos0);  // generate's model_kwargs now holds the expanded position_ids
  }
  if (!cuda_) {
    // _prepare_cache_for_generation: DynamicCache(config=...); each sliding layer makes its
    // window tensor on the CPU (Note [Sliding-window layers]).
    op("generate.prepare_cache");
    for (std::size_t l = 0; l < window_.size(); ++l) {
      if (window_[l] > 0) swt_[l] = fresh(1, DType::kI64);
    }
  }
  op("generate.logits_processor");
  {
    T lt = fresh(tok_, DType::kU8);
    T any = fresh(1, DType::kU8);
    t_.drop(lt);
    t_.drop(any);
  }
  T beam_output;  // beam search returns a view of its `sequences`
  if (K > 1) {
    beam_output = beam_search(pos);
  } else {
    greedy(ids, pos);  // ids becomes the output
  }
  // generate() returns: the generation config's token tensors and generate's model_kwargs go, in
  // the phase of the last forward (prefill when one new token made no decode forward).
  op("generate.return");
  if (bos.id != kNone) t_.drop(bos);
  t_.drop(pad);
  if (pos_expanded.id != kNone) {
    t_.drop(pos_expanded);
  } else {
    t_.drop(pos0);
  }
  t_.drop(ids);  // greedy: the returned sequences, dropped by the caller; beams: the expanded ids
  if (beam_output.id != kNone) t_.drop(beam_output);
  // The DynamicCache goes last (its list of layers is freed from the last layer to the first),
  // then the caller drops its batch.
  for (std::size_t l = kc_.size(); l-- > 0;) {
    t_.drop(kc_[l]);
    t_.drop(vc_[l]);
    if (swt_[l].id != kNone) t_.drop(swt_[l]);
  }
  t_.drop(input_ids_);
  t_.drop(attention_mask);
  TRAINMEM_ASSERT(t_.node_count() == 0, "generation recorded an autograd node");
  Trace trace = t_.take();
  trace.trainable_parameters = 0;  // eval under no_grad: nothing trains
  return trace;
}

// x.repeat_interleave(K, dim=0) for a [B, cols] int64 tensor (beam search's expansion).
T StepBuilder::expand_rows(const T& x) {
  return fresh(x.numel * r_.beams, x.dtype);
}

// One forward of generate's loop: prepare_inputs_for_generation, then the model.
// Returns the logits [rows, V] (the CausalLM output's logits, held by `outputs`).
T StepBuilder::generation_forward(const T& pos, std::uint64_t q, std::uint32_t step, T& prev_ids_in,
                                  T& prev_pos_in) {
  const bool prefill = step == 0;
  phase_ = prefill ? Phase::kPrefill : Phase::kDecode;
  t_.micro = step;
  layer_ = kNoLayer;
  op("generate.prepare_inputs");
  T ids_in = fresh(Bg_ * q, DType::kI64);  // input_ids[:, -q:].clone()
  T pos_in;
  if (prefill) {
    pos_in = t_.ref(pos);  // already as long as the inputs: passed as it is
  } else {
    pos_in = fresh(Bg_ * q, DType::kI64);  // position_ids[..., -q:].clone()
  }
  // model_inputs is rebound: last step's inputs go.
  if (prev_ids_in.id != kNone) t_.drop(prev_ids_in);
  if (prev_pos_in.id != kNone) t_.drop(prev_pos_in);
  q_ = q;
  past_ = prefill ? 0 : S_ + step - 1;
  T logits = model_forward();
  layer_ = kNoLayer;
  if (prefill) {
    // _prefill returns: its model_inputs go.
    t_.drop(ids_in);
    t_.drop(pos_in);
  } else {
    prev_ids_in = ids_in;
    prev_pos_in = pos_in;
  }
  return logits;
}

// _update_model_kwargs_for_generation: position_ids grow by one column.
void StepBuilder::grow_position_ids(T& pos, std::uint64_t len) {
  op("generate.update_position_ids");
  T ar = fresh(1, DType::kI64);          // arange(1)
  T a1 = fresh(Bg_, DType::kI64);        // + position_ids[..., -1:]
  t_.drop(ar);
  T a2 = fresh(Bg_, DType::kI64);        // + 1
  t_.drop(a1);
  T cat = fresh(Bg_ * (len + 1), DType::kI64);
  t_.drop(a2);
  t_.drop(pos);
  pos = cat;
}

// StoppingCriteriaList with MaxLengthCriteria only: is_done = full(False) | full(done);
// unfinished = unfinished & ~is_done; then unfinished.max() == 0.
void StepBuilder::stopping_criteria(T& unfinished, std::uint64_t rows) {
  op("generate.stopping_criteria");
  T f1 = fresh(rows, DType::kU8);
  T f2 = fresh(rows, DType::kU8);
  T o = fresh(rows, DType::kU8);
  t_.drop(f2);
  t_.drop(f1);
  T n = fresh(rows, DType::kU8);
  t_.drop(o);
  T u = fresh(rows, DType::kI64);
  t_.drop(n);
  t_.drop(unfinished);
  unfinished = u;
  T mx = fresh(1, DType::kI64);
  T eq = fresh(1, DType::kU8);
  t_.drop(mx);
  t_.drop(eq);
}

// _sample with do_sample=False.
void StepBuilder::greedy(T& ids, T& pos) {
  const std::uint64_t N = r_.new_tokens, V = a_.vocab_size;
  op("generate.unfinished_sequences");
  T unfinished = fresh(Bg_, DType::kI64);
  T ids_in, pos_in, next_logits, next_tokens;
  for (std::uint32_t i = 0; i < N; ++i) {
    T logits = generation_forward(pos, i == 0 ? S_ : 1, i, ids_in, pos_in);
    const std::uint64_t len = S_ + i;
    grow_position_ids(pos, len);
    op("generate.next_token_logits");
    T nl = fresh(Bg_ * V, DType::kF32);  // logits[:, -1].to(copy=True, dtype=float32)
    if (next_logits.id != kNone) t_.drop(next_logits);
    next_logits = nl;
    op("generate.argmax");
    T nt = fresh(Bg_, DType::kI64);
    if (next_tokens.id != kNone) t_.drop(next_tokens);
    next_tokens = nt;
    op("generate.append_tokens");
    T grown = fresh(Bg_ * (len + 1), DType::kI64);
    t_.drop(ids);
    ids = grown;
    stopping_criteria(unfinished, Bg_);
    op("generate.del_outputs");
    t_.drop(logits);
  }
  // _sample returns: its model_kwargs (position_ids), the loop's locals.
  op("generate.return");
  t_.drop(pos);
  t_.drop(unfinished);
  if (ids_in.id != kNone) t_.drop(ids_in);
  if (pos_in.id != kNone) t_.drop(pos_in);
  t_.drop(next_logits);
  t_.drop(next_tokens);
}

namespace {

// Note [Beam search]
// _beam_search (generation/utils.py) with num_beams = K, beams_to_keep K2 = 2K (no eos), on
// B prompts: the running and finished hypotheses are [B, K, max_length] int64 sequences,
// [B, K] fp32 scores, [B, K, max_new_tokens] int32 beam indices and [B, K] bool flags, all
// allocated before the prefill. Each step copies the last logits to fp32, takes log_softmax,
// adds the running scores ([B, K, V] fp32), keeps the top K2 continuations, gathers the
// sequences and indices they extend (take_along_dim: an int64 index broadcast, then the
// gather), selects the next running beams and merges the finished ones (cat, topk, gather),
// and reorders every layer's cache with index_select (a new tensor per layer, the old one
// freed). Variables hold storages across iterations the way the loop binds them:
// flat_running_sequences is a view of the last step's running_sequences (freed one step
// late), beam_idx a view of running_beam_indices.
// int32 (the beam indices): DType has no int32; only the size matters here, fp32's.
constexpr DType kInt32 = DType::kF32;

struct BeamState {
  T running_sequences, sequences, running_beam_scores, beam_scores, is_sent_finished, unsat, hits,
      running_beam_indices, beam_indices, top_num_beam_mask;
  T topk_log_probs, topk_running_sequences, topk_running_beam_indices;
  T logits, log_probs, flat_view, beam_idx_view;
};

}  // namespace

// take_along_dim(x, idx, dim=1): an int64 copy of the broadcast index (% size), then the gather.
T StepBuilder::gather_beams(std::uint64_t out_numel, DType d) {
  T idx = fresh(out_numel, DType::kI64);
  T y = fresh(out_numel, d);
  t_.drop(idx);
  return y;
}

void StepBuilder::replace(T& var, T value) {
  if (var.id != kNone) t_.drop(var);
  var = value;
}

T StepBuilder::beam_search(T& pos) {
  const std::uint64_t B = B_, K = r_.beams, K2 = 2 * K, N = r_.new_tokens, V = a_.vocab_size;
  const std::uint64_t L = S_ + N, G = N;
  BeamState s;
  op("generate.beam_search_init");
  if (cuda_) {
    s.top_num_beam_mask = fresh(K2, DType::kU8);  // built on the CPU, then .to(device)
  } else {
    T ones = fresh(K, DType::kU8);
    T zeros = fresh(K2 - K, DType::kU8);
    s.top_num_beam_mask = fresh(K2, DType::kU8);
    t_.drop(zeros);
    t_.drop(ones);
  }
  s.running_sequences = fresh(B * K * L, DType::kI64);
  s.sequences = fresh(B * K * L, DType::kI64);
  s.running_beam_scores = fresh(B * K, DType::kF32);
  if (!cuda_) {
    T scalar = fresh(1, DType::kF32);  // running_beam_scores[:, 1:] = -1e9 wraps the scalar (CPU)
    t_.drop(scalar);
  }
  s.beam_scores = fresh(B * K, DType::kF32);
  s.is_sent_finished = fresh(B * K, DType::kU8);
  s.unsat = fresh(B, DType::kU8);
  s.hits = fresh(B * K, DType::kU8);
  s.running_beam_indices = fresh(B * K * G, kInt32);
  s.beam_indices = fresh(B * K * G, kInt32);
  T ids_in, pos_in;
  for (std::uint32_t i = 0; i < N; ++i) {
    const std::uint64_t cur = S_ + i;
    if (i > 0) {
      // flat_running_sequences = running_sequences[:, :, :cur] flattened (a view)
      T view = t_.ref(s.running_sequences);
      replace(s.flat_view, view);
    }
    T model_logits = generation_forward(pos, i == 0 ? S_ : 1, i, ids_in, pos_in);
    grow_position_ids(pos, cur);
    op("generate.beam_scores");
    replace(s.logits, fresh(Bg_ * V, DType::kF32));  // logits[:, -1, :].to(copy=True, float32)
    replace(s.log_probs, fresh(Bg_ * V, DType::kF32));  // log_softmax
    t_.drop(model_logits);  // del model_outputs
    {
      T added = fresh(Bg_ * V, DType::kF32);  // + running_beam_scores[:, :, None]
      replace(s.log_probs, added);
    }
    // _get_top_k_continuations
    op("generate.top_k_continuations");
    T topk_indices = fresh(B * K2, DType::kI64);
    T topk_log_probs = fresh(B * K2, DType::kF32);
    T cur_beam = fresh(B * K2, DType::kI64);  // // vocab_size
    T trbi = gather_beams(B * K2 * G, kInt32);
    T trs = gather_beams(B * K2 * L, DType::kI64);
    T topk_ids = fresh(B * K2, DType::kI64);  // % vocab_size
    T ar = fresh(B, DType::kI64);
    T offset = fresh(B, DType::kI64);  // arange(B).view(-1, 1) * num_beams
    t_.drop(ar);
    T modified = fresh(B * K2, DType::kI64);
    t_.drop(topk_indices);
    t_.drop(cur_beam);
    t_.drop(topk_ids);
    t_.drop(offset);
    t_.drop(modified);
    replace(s.topk_log_probs, topk_log_probs);
    replace(s.topk_running_sequences, trs);
    replace(s.topk_running_beam_indices, trbi);
    // stopping_criteria on the flattened top-k sequences: [B * K2] flags
    op("generate.stopping_criteria");
    {
      T f1 = fresh(B * K2, DType::kU8);
      T f2 = fresh(B * K2, DType::kU8);
      T o = fresh(B * K2, DType::kU8);
      t_.drop(f2);
      t_.drop(f1);
      replace(s.hits, o);
    }
    // _get_running_beams_for_next_iteration
    op("generate.next_running_beams");
    {
      T hf = fresh(B * K2, DType::kF32);
      T hm = fresh(B * K2, DType::kF32);
      t_.drop(hf);
      T trlp = fresh(B * K2, DType::kF32);
      t_.drop(hm);
      T next_idx = fresh(B * K, DType::kI64);
      T vals = fresh(B * K, DType::kF32);
      t_.drop(vals);
      T rs = gather_beams(B * K * L, DType::kI64);
      T rbs = gather_beams(B * K, DType::kF32);
      T rbi = gather_beams(B * K * G, kInt32);
      t_.drop(trlp);
      t_.drop(next_idx);
      replace(s.running_sequences, rs);
      replace(s.running_beam_scores, rbs);
      replace(s.running_beam_indices, rbi);
    }
    // _update_finished_beams
    op("generate.update_finished_beams");
    {
      T did = fresh(B * K2, DType::kU8);
      T tlp = fresh(B * K2, DType::kF32);  // / length penalty
      T all = fresh(B, DType::kU8);
      T full = fresh(B, DType::kU8);  // & (early_stopping is True)
      t_.drop(all);
      T c1 = fresh(B, DType::kF32);
      T m1 = fresh(B, DType::kF32);
      t_.drop(c1);
      t_.drop(m1);  // added in place
      T n2 = fresh(B, DType::kU8);
      T c2 = fresh(B, DType::kF32);
      t_.drop(n2);
      T m2 = fresh(B, DType::kF32);
      t_.drop(c2);
      t_.drop(m2);
      T n3 = fresh(B * K2, DType::kU8);
      T m3 = fresh(B * K2, DType::kF32);
      t_.drop(n3);
      t_.drop(m3);
      const std::uint64_t KM = K + K2;
      T ms = fresh(B * KM * L, DType::kI64);
      T msc = fresh(B * KM, DType::kF32);
      T mbi = fresh(B * KM * G, kInt32);
      T mf = fresh(B * KM, DType::kU8);
      T idx = fresh(B * K, DType::kI64);
      T vals = fresh(B * K, DType::kF32);
      t_.drop(vals);
      T seq = gather_beams(B * K * L, DType::kI64);
      T bs = gather_beams(B * K, DType::kF32);
      T bi = gather_beams(B * K * G, kInt32);
      T fin = gather_beams(B * K, DType::kU8);
      for (T* x : {&tlp, &did, &full, &ms, &msc, &mbi, &mf, &idx}) t_.drop(*x);
      replace(s.sequences, seq);
      replace(s.beam_scores, bs);
      replace(s.beam_indices, bi);
      replace(s.is_sent_finished, fin);
    }
    // Reorder the cache: beam_idx is a view of running_beam_indices; each layer's keys and
    // values are index_select'ed into new tensors.
    op("generate.reorder_cache");
    replace(s.beam_idx_view, t_.ref(s.running_beam_indices));
    for (std::uint32_t l = 0; l < kc_.size(); ++l) {
      const std::uint64_t tokens = visible(l);  // a sliding layer's keys are a window view
      for (T* c : {&kc_[l], &vc_[l]}) {
        if (c->id == kNone) continue;
        T y = t_.make(Bg_ * a_.num_kv_heads * a_.head_dim * tokens, c->dtype, Category::kActivations);
        t_.drop(*c);
        *c = y;
      }
      stored_[l] = tokens;
    }
    // _check_early_stop_heuristic
    op("generate.early_stop_heuristic");
    {
      T best = fresh(B, DType::kF32);
      T mi = fresh(B, DType::kI64);
      T mv = fresh(B, DType::kF32);
      t_.drop(mi);
      T sc = fresh(1, DType::kF32);
      T worst = fresh(B * K, DType::kF32);
      t_.drop(sc);
      t_.drop(mv);
      T gt = fresh(B * K, DType::kU8);
      T any = fresh(B, DType::kU8);
      t_.drop(gt);
      T u = fresh(B, DType::kU8);
      t_.drop(any);
      t_.drop(best);
      t_.drop(worst);
      replace(s.unsat, u);
    }
    // _beam_search_has_unfinished_sequences: 0-dim flags
    op("generate.has_unfinished");
    {
      T improvement = fresh(1, DType::kU8);
      T all = fresh(1, DType::kU8);
      T a1 = fresh(1, DType::kU8);
      t_.drop(all);
      T open = fresh(1, DType::kU8);
      t_.drop(a1);
      T all2 = fresh(1, DType::kU8);
      T valid = fresh(1, DType::kU8);
      t_.drop(all2);
      T r1 = fresh(1, DType::kU8);
      T r2 = fresh(1, DType::kU8);
      t_.drop(r1);
      t_.drop(improvement);
      t_.drop(open);
      t_.drop(valid);
      t_.drop(r2);
    }
  }
  // After the loop: max_generated_length = ((beam_indices + 1).bool()).sum(1).max(), and
  // output_length = prompt + that (0-dim tensors); the output is a view of `sequences`.
  op("generate.finalize");
  T p1 = fresh(B * G, kInt32);
  T pb = fresh(B * G, DType::kU8);
  t_.drop(p1);
  T sum = fresh(B, DType::kI64);
  t_.drop(pb);
  T mx = fresh(1, DType::kI64);
  t_.drop(sum);
  T out_len = fresh(1, DType::kI64);
  op("generate.return");
  // _beam_search returns: its model_kwargs, then its locals in the order Python frees them.
  t_.drop(pos);
  for (T* x : {&s.top_num_beam_mask, &s.beam_indices, &s.running_sequences, &s.running_beam_scores,
               &s.beam_scores, &s.is_sent_finished, &s.unsat, &s.hits, &s.flat_view, &ids_in, &pos_in,
               &s.logits, &s.log_probs, &s.topk_log_probs, &s.topk_running_sequences,
               &s.topk_running_beam_indices, &s.running_beam_indices, &s.beam_idx_view, &mx, &out_len}) {
    if (x->id != kNone) t_.drop(*x);
  }
  return s.sequences;
}

// ---- the model's forward under no_grad, on q_ new tokens per row with past_ cached.
std::uint64_t StepBuilder::rows() const { return Bg_ * q_; }

T StepBuilder::model_forward() {
  const std::uint64_t h = a_.hidden_size, n = rows() * h;
  const bool gpt2 = a_.family == Family::kGpt2;
  const DType dt = pol_.param;
  T embeds, pembeds, hs;
  if (gpt2) {
    op("wte");
    embeds = fresh(n, dt);
    op("wpe");
    pembeds = fresh(n, dt);  // position_ids come from generate: [rows, q]
    op("add");
    hs = fresh(n, dt);
  } else {
    op("embed_tokens");
    embeds = fresh(n, dt);
    if (a_.embedding_scale) {  // Gemma2TextScaledWordEmbedding: * embed_scale, inside the module
      T scaled = fresh(n, dt);
      t_.drop(embeds);
      embeds = scaled;
    }
    hs = t_.ref(embeds);  // hidden_states = inputs_embeds
  }
  std::vector<T> masks = generation_masks();
  if (!gpt2) generation_rotary();
  for (std::uint32_t l = 0; l < a_.num_layers; ++l) {
    T next = gpt2 ? g_gpt2_block(hs, l) : g_decoder_layer(hs, l);
    t_.drop(hs);
    hs = next;
  }
  layer_ = kNoLayer;
  T normed = gpt2 ? g_layer_norm(hs, "ln_f") : g_rms_norm(hs, global("norm.weight"), rows(), "norm");
  t_.drop(hs);
  // The base model returns: its locals go (inputs_embeds, then the position embeddings, last
  // element first; the masks).
  // Frame locals go in definition order: Qwen2/3 and Gemma-2 keep inputs_embeds in their
  // mask_kwargs dict, defined after the mask mapping; the others free the inputs_embeds
  // argument first.
  const bool embeds_in_mask_kwargs =
      a_.family == Family::kQwen2 || a_.family == Family::kQwen3 || a_.family == Family::kGemma2;
  if (embeds_in_mask_kwargs) {
    for (T& m : masks) t_.drop(m);
    t_.drop(embeds);
  } else {
    t_.drop(embeds);
    if (gpt2) t_.drop(pembeds);
    for (T& m : masks) t_.drop(m);
  }
  if (!gpt2) {
    t_.drop(sin_);
    t_.drop(cos_);
  }
  // lm_head on hidden_states[:, -1:, :] (logits_to_keep=1).
  op("lm_head");
  std::uint32_t emb = global(gpt2 ? "wte.weight" : "embed_tokens.weight");
  T last = t_.ref(normed);
  last.numel = Bg_ * h;
  T logits = linear(last, lm_head_param(emb), kNone, a_.vocab_size);
  t_.drop(last);
  if (a_.final_logit_softcap > 0) {  // Gemma-2: logits / cap, tanh, * cap (each rebinds)
    for (int k = 0; k < 3; ++k) {
      T y = fresh(logits.numel, logits.dtype);
      t_.drop(logits);
      logits = y;
    }
  }
  t_.drop(normed);  // the CausalLM forward returns
  return logits;
}

// ---- attention masks of one forward (masking_utils).
// Note [Generation masks]
// create_causal_mask / create_sliding_window_causal_mask build the mask from index vectors:
// arange(batch), arange(1), arange(q) + q_offset, arange(kv) + kv_offset (int64), then the
// mask function on broadcast views: causal is kv_idx <= q_idx ([1, 1, q, kv] bool); sliding
// is and_masks(overlay, causal): a 0-dim True, (q_idx - window) [q], kv_idx > that, &, then
// the causal le and another &. eager_mask turns it into [batch, 1, q, kv] of the hidden dtype
// with torch.where(mask, zeros(()), min) (a 0-dim zero and the wrapped min). SDPA skips the
// mask (None: is_causal, or q == 1) unless a sliding layer's window is reached (kv >= window),
// where the bool mask is kept. Which masks a model builds: Llama, GPT-2 the causal one;
// Mistral and Phi-3 one, sliding when the config has a window; Qwen2/3 the causal one plus a
// sliding one when some layer slides; Gemma-2 both. The forward keeps them to its end.

std::vector<StepBuilder::MaskKind> StepBuilder::mask_kinds() const {
  const bool any_sliding = std::any_of(window_.begin(), window_.end(), [](std::uint64_t w) { return w > 0; });
  switch (a_.family) {
    case Family::kGemma2: return {MaskKind::kFull, MaskKind::kSliding};
    case Family::kQwen2:
    case Family::kQwen3:
      if (any_sliding) return {MaskKind::kFull, MaskKind::kSliding};
      return {MaskKind::kFull};
    case Family::kMistral:
    case Family::kPhi3: return {any_sliding ? MaskKind::kSliding : MaskKind::kFull};
    default: return {MaskKind::kFull};
  }
}

std::uint64_t StepBuilder::window_of_model() const {
  for (std::uint64_t w : window_) {
    if (w > 0) return w;
  }
  return 0;
}

std::vector<T> StepBuilder::generation_masks() {
  std::vector<T> masks;
  const bool eager = attention_ == Attention::kEager;
  for (MaskKind kind : mask_kinds()) {
    const std::uint64_t W = kind == MaskKind::kSliding ? window_of_model() : 0;
    std::uint64_t kv = past_ + q_;
    if (W > 0 && past_ >= W) kv = W - 1 + q_;  // DynamicSlidingWindowLayer.get_mask_sizes
    // SDPA: no mask unless a sliding window is reached; flash-attention takes the window
    // as an argument and never gets a mask.
    if (!eager && (attention_ == Attention::kFlash || !(W > 0 && kv >= W))) continue;
    masks.push_back(attention_mask(kind, Bg_, q_, kv, eager, pol_.param));
  }
  return masks;
}

// One mask as Note [Generation masks] says: the index vectors, the mask function's bool
// [1, 1, q, kv], and for eager attention the float [batch, 1, q, kv] that replaces it. With
// `padding` (a training batch's attention_mask, Note [Padding masks] in step.cpp) the mask
// function is and_masks(that one, padding_mask_function): a 0-dim True, the inner mask, their
// &, then the padding mask indexed at [batch, 1, 1, kv] and its & [batch, 1, q, kv].
T StepBuilder::attention_mask(MaskKind kind, std::uint64_t batch, std::uint64_t q, std::uint64_t kv, bool eager,
                              DType dtype, bool padding) {
  op(kind == MaskKind::kSliding ? "sliding_window_mask" : "causal_mask");
  T rows = fresh(batch, DType::kI64);
  T head = fresh(1, DType::kI64);
  T qa0 = fresh(q, DType::kI64);
  T qa = fresh(q, DType::kI64);
  t_.drop(qa0);
  T ka0 = fresh(kv, DType::kI64);
  T ka = fresh(kv, DType::kI64);
  t_.drop(ka0);
  const std::uint64_t qk = detail::mul(q, kv, "mask size");
  T outer = padding ? fresh(1, DType::kU8) : T{};
  T m;
  if (kind == MaskKind::kSliding) {
    T one = fresh(1, DType::kU8);
    T sub = fresh(q, DType::kI64);
    T gt = fresh(qk, DType::kU8);
    t_.drop(sub);
    T a1 = fresh(qk, DType::kU8);
    t_.drop(gt);
    t_.drop(one);
    T le = fresh(qk, DType::kU8);
    m = fresh(qk, DType::kU8);
    t_.drop(le);
    t_.drop(a1);
  } else {
    m = fresh(qk, DType::kU8);
  }
  if (padding) {
    T inner = fresh(qk, DType::kU8);
    t_.drop(m);
    t_.drop(outer);
    T index = fresh(detail::mul(batch, kv, "mask size"), DType::kU8);
    m = fresh(detail::mul(batch, qk, "mask size"), DType::kU8);
    t_.drop(index);
    t_.drop(inner);
  }
  t_.drop(rows);
  t_.drop(head);
  t_.drop(qa);
  t_.drop(ka);
  if (eager) {
    T w = where_of_scalars(detail::mul(batch, qk, "mask size"), dtype);
    t_.drop(m);
    m = w;
  }
  return m;
}

// LlamaRotaryEmbedding on position_ids [rows, q]: cos/sin [rows, q, rotary_dim], computed in
// fp32 and cast to the hidden dtype at return.
void StepBuilder::generation_rotary() {
  op("rotary_emb");
  const std::uint64_t r = rows(), d = a_.head_dim;
  T pf = fresh(r, DType::kF32);                  // position_ids[:, None, :].float()
  T freqs = fresh(r * d / 2, DType::kF32);       // inv_freq @ positions
  t_.drop(pf);
  T emb = fresh(r * d, DType::kF32);             // cat((freqs, freqs))
  T c0 = fresh(r * d, DType::kF32);
  T cos = fresh(r * d, DType::kF32);             // * attention_scaling
  t_.drop(c0);
  T s0 = fresh(r * d, DType::kF32);
  T sin = fresh(r * d, DType::kF32);
  t_.drop(s0);
  if (pol_.param != DType::kF32) {
    cos_ = fresh(r * d, pol_.param);
    sin_ = fresh(r * d, pol_.param);
    t_.drop(freqs);
    t_.drop(emb);
    t_.drop(cos);
    t_.drop(sin);
  } else {
    t_.drop(freqs);
    t_.drop(emb);
    cos_ = cos;
    sin_ = sin;
  }
}

// RMSNorm without autograd (LlamaRMSNorm; Gemma2RMSNorm's (1 + weight) form).
T StepBuilder::g_rms_norm(const T& x, std::uint32_t w, std::uint64_t nrows, std::string_view name) {
  op(name);
  const std::uint64_t n = x.numel;
  const bool up = x.dtype != DType::kF32;
  if (a_.family == Family::kGemma2) {
    T h = up ? fresh(n, DType::kF32) : t_.ref(x);  // x.float()
    T sq = fresh(n, DType::kF32);
    T mean = fresh(nrows, DType::kF32);
    t_.drop(sq);
    T ve = fresh(nrows, DType::kF32);
    t_.drop(mean);
    T rs = fresh(nrows, DType::kF32);
    t_.drop(ve);
    T hn = fresh(n, DType::kF32);
    t_.drop(rs);
    t_.drop(h);  // _norm returns: its argument x.float() goes
    const std::uint64_t hw = params_[w].numel;
    T wf = params_[w].dtype != DType::kF32 ? fresh(hw, DType::kF32) : T{};
    T onep = fresh(hw, DType::kF32);  // 1.0 + weight.float()
    if (wf.id != kNone) t_.drop(wf);
    T out = fresh(n, DType::kF32);
    t_.drop(onep);
    t_.drop(hn);
    if (up) {
      T cast = fresh(n, x.dtype);  // type_as(x)
      t_.drop(out);
      out = cast;
    }
    return out;
  }
  T h = up ? fresh(n, DType::kF32) : t_.ref(x);  // hidden_states.to(float32)
  T sq = fresh(n, DType::kF32);                  // pow(2)
  T var = fresh(nrows, DType::kF32);             // mean(-1, keepdim=True), a local
  t_.drop(sq);
  T ve = fresh(nrows, DType::kF32);              // + eps
  T rs = fresh(nrows, DType::kF32);              // rsqrt
  t_.drop(ve);
  T hn = fresh(n, DType::kF32);                  // hidden_states * rsqrt(...)
  t_.drop(rs);
  t_.drop(h);
  T hc = up ? fresh(n, x.dtype) : t_.ref(hn);    // .to(input_dtype)
  T out = fresh(n, promote(params_[w].dtype, x.dtype));
  t_.drop(hc);
  t_.drop(hn);
  t_.drop(var);
  return out;
}

// nn.LayerNorm without autograd (GPT-2): the kernel's two statistics, then the output.
T StepBuilder::g_layer_norm(const T& x, std::string_view name) {
  op(name);
  const std::uint64_t r = x.numel / a_.hidden_size;
  const DType stat = cuda_ ? DType::kF32 : x.dtype;
  T s1 = fresh(r, stat);
  T s2 = fresh(r, stat);
  T out = fresh(x.numel, x.dtype);
  t_.drop(s2);
  t_.drop(s1);
  return out;
}

// apply_rotary_pos_emb on one of q, k: x*cos + rotate_half(x)*sin (Phi-3: then cat with the
// pass-through channels).
T StepBuilder::g_rope(const T& x) {
  const std::uint64_t n = x.numel;
  T a = fresh(n, x.dtype);
  T neg = fresh(n / 2, x.dtype);
  T rot = fresh(n, x.dtype);
  t_.drop(neg);
  T b = fresh(n, x.dtype);
  t_.drop(rot);
  T y = fresh(n, x.dtype);
  t_.drop(a);
  t_.drop(b);
  if (a_.family == Family::kPhi3) {
    T c = fresh(n, x.dtype);
    t_.drop(y);
    y = c;
  }
  return y;
}

// DynamicLayer.update: keys = cat([keys, key_states], -2), values likewise.
// DynamicSlidingWindowLayer.update: the same cat, then keys = full[:, :, -window + 1:] (a view:
// the storage stays whole) and the full states go to attention; its `_sliding_window_tensor`
// (torch.tensor(window), made on the CPU with the cache) moves to the device at the layer's
// first update (Note [Sliding-window layers]).
void StepBuilder::cache_update(std::uint32_t l, const T& k, const T& v) {
  op("self_attn.kv_cache");
  if (cuda_ && window_[l] > 0 && swt_[l].id == kNone) swt_[l] = fresh(1, DType::kI64);
  const std::uint64_t tokens = visible(l) + q_;
  const std::uint64_t per = detail::mul({Bg_, a_.num_kv_heads, a_.head_dim, tokens}, "KV cache size");
  // DynamicLayer assigns each cat as it is made; the sliding layer makes both full states
  // before it rebinds keys and values to their windows.
  const bool sliding = window_[l] > 0;
  T kn = t_.make(per, k.dtype, Category::kActivations);
  if (!sliding && kc_[l].id != kNone) t_.drop(kc_[l]);
  T vn = t_.make(per, v.dtype, Category::kActivations);
  if (sliding && kc_[l].id != kNone) t_.drop(kc_[l]);
  kc_[l] = kn;
  if (vc_[l].id != kNone) t_.drop(vc_[l]);
  vc_[l] = vn;
  stored_[l] = tokens;
}

// Cached positions a layer hands on to the next update (a sliding layer keeps window - 1).
std::uint64_t StepBuilder::visible(std::uint32_t l) const {
  return window_[l] > 0 ? std::min(stored_[l], window_[l] - 1) : stored_[l];
}

// Whether this forward built a mask for layer l (see generation_masks).
bool StepBuilder::layer_has_mask(std::uint32_t l) const {
  if (attention_ == Attention::kEager) return true;
  if (attention_ == Attention::kFlash) return false;
  const std::uint64_t W = window_[l];
  return W > 0 && stored_[l] >= W;
}

// Attention of one layer on the cached keys and values; returns the output before o_proj,
// laid out [rows, heads * head_dim]. q_bshd: q is laid out [b, s, heads, d] (a projection
// view, or rope's elementwise output that kept that layout).
T StepBuilder::g_attention_core(const T& q, std::uint32_t l, bool q_bshd) {
  const std::uint64_t H = a_.num_heads, d = a_.head_dim, r = rows();
  const DType c = q.dtype;
  if (attention_ == Attention::kEager) {
    return a_.family == Family::kGpt2 ? g_gpt2_eager_core(q, l) : g_eager_core(q, l, q_bshd);
  }
  op(a_.family == Family::kGpt2 ? "attn.sdpa" : "self_attn.sdpa");
  ensure_workspace(false);
  // sdpa_attention_forward: without a mask GQA is native (enable_gqa) where the head dim is at
  // most 256 (use_gqa_in_sdpa); with one (a sliding window reached), or a wider head, one query
  // token packs the heads (a view) and more repeat K/V (a view too of a single key/value head,
  // which the CPU kernel takes as it is).
  T kr, vr;
  const std::uint64_t groups = a_.num_heads / a_.num_kv_heads;
  if (sdpa_repeats_kv(layer_has_mask(l), q_) && groups > 1 && a_.num_kv_heads > 1 && q_ > 1) {
    kr = fresh(Bg_ * H * stored_[l] * d, kc_[l].dtype);
    vr = fresh(Bg_ * H * stored_[l] * d, vc_[l].dtype);
  }
  // A bool mask becomes a float one inside scaled_dot_product_attention
  // (convert_boolean_attn_mask: where(mask, 0, -inf) with two wrapped scalars), [b, 1, q, kv]
  // of q's dtype, freed after the kernel.
  T fmask;
  if (layer_has_mask(l)) fmask = where_of_scalars(detail::mul({Bg_, q_, stored_[l]}, "mask size"), c);
  // No dropout in eval (See Note [SDPA kernels on CUDA] in step_builder.h).
  auto [o, lse, seed, offset] = sdpa_outputs(r * H * d, Bg_ * H * q_, c, /*grad_mode=*/false,
                                             sdpa_kernel(c, layer_has_mask(l), 0.0, stored_[l]));
  for (T* x : {&lse, &seed, &offset}) {
    if (x->id != kNone) t_.drop(*x);
  }
  if (fmask.id != kNone) t_.drop(fmask);
  if (!(q_bshd || q_ == 1)) {
    T oc = fresh(o.numel, c);  // transpose(1, 2).contiguous()
    t_.drop(o);
    o = oc;
  }
  if (kr.id != kNone) {
    t_.drop(kr);
    t_.drop(vr);
  }
  return o;
}

// eager_attention_forward (Llama family): repeat_kv copies K and V up to the query heads (one
// head: an expanded view, copied by matmul's folds where b > 1), q @ k^T (matmul folds
// [b, heads]: a copy of q when it is laid out [b, s, heads, d] with b > 1 and more than one
// token), * scaling, Gemma-2's soft-capping (/ cap, tanh, * cap),
// + the mask, softmax in fp32 (a half input is upcast first) cast back, @ v, and
// transpose(1, 2).contiguous() (a copy unless one token). The probabilities are returned and
// held by the decoder layer until it returns.
T StepBuilder::g_eager_core(const T& q, std::uint32_t l, bool q_bshd) {
  const std::uint64_t H = a_.num_heads, d = a_.head_dim, kv = stored_[l];
  const std::uint64_t groups = H / a_.num_kv_heads;
  const std::uint64_t scores = detail::mul({Bg_, H, q_, kv}, "attention scores");
  const DType c = q.dtype;
  op("self_attn.attn_weights");
  // One key/value head: repeat_kv is a view with the heads of stride 0 (as in training,
  // StepBuilder::repeat_kv), which matmul's folds copy where b > 1: K's copy made after q's and
  // freed before it, V's around its bmm.
  const bool expanded = groups > 1 && a_.num_kv_heads == 1;
  const bool copies = groups > 1 && !expanded;
  T kr = copies ? fresh(Bg_ * H * kv * d, kc_[l].dtype) : t_.ref(kc_[l]);
  T vr = copies ? fresh(Bg_ * H * kv * d, vc_[l].dtype) : t_.ref(vc_[l]);
  T qc = (q_bshd && Bg_ > 1 && q_ > 1) ? fresh(q.numel, c) : T{};
  T kf = expanded && Bg_ > 1 ? fresh(Bg_ * H * kv * d, kc_[l].dtype) : T{};
  ensure_workspace(false);
  T s = fresh(scores, c);
  for (T* x : {&kf, &qc}) {
    if (x->id != kNone) t_.drop(*x);
  }
  T s1 = fresh(scores, c);  // * scaling
  t_.drop(s);
  if (a_.attn_logit_softcap > 0) {
    for (int k = 0; k < 3; ++k) {  // / softcap, tanh, * softcap
      T y = fresh(scores, c);
      t_.drop(s1);
      s1 = y;
    }
  }
  T s2 = fresh(scores, c);  // + causal_mask
  t_.drop(s1);
  op("self_attn.softmax");
  T p;
  if (c != DType::kF32 && cuda_) {
    // softmax(dtype=float32) of a half CUDA tensor is one kernel (_softmax half_to_float).
    T p32 = fresh(scores, DType::kF32);
    p = fresh(scores, c);  // .to(query.dtype)
    t_.drop(p32);
  } else if (c != DType::kF32) {
    T up = fresh(scores, DType::kF32);  // the CPU upcasts the input first
    T p32 = fresh(scores, DType::kF32);
    t_.drop(up);
    p = fresh(scores, c);  // .to(query.dtype)
    t_.drop(p32);
  } else {
    p = fresh(scores, DType::kF32);
  }
  t_.drop(s2);
  op("self_attn.attn_output");
  T vf = expanded && Bg_ > 1 ? fresh(Bg_ * H * kv * d, vc_[l].dtype) : T{};
  T o = fresh(Bg_ * H * q_ * d, c);
  if (vf.id != kNone) t_.drop(vf);
  if (q_ > 1) {
    T oc = fresh(o.numel, c);
    t_.drop(o);
    o = oc;
  }
  t_.drop(kr);
  t_.drop(vr);
  attn_weights_ = p;
  return o;
}

// GPT-2's eager_attention_forward: q is a strided view of c_attn's output, so matmul copies
// it for b > 1 (one token or more); no repeat_kv; softmax in the input dtype.
T StepBuilder::g_gpt2_eager_core(const T& q, std::uint32_t l) {
  const std::uint64_t H = a_.num_heads, d = a_.head_dim, kv = stored_[l];
  const std::uint64_t scores = detail::mul({Bg_, H, q_, kv}, "attention scores");
  const DType c = q.dtype;
  op("attn.attn_weights");
  T qc = Bg_ > 1 ? fresh(q.numel, c) : T{};
  ensure_workspace(false);
  T s = fresh(scores, c);
  if (qc.id != kNone) t_.drop(qc);
  T s1 = fresh(scores, c);  // scaling
  t_.drop(s);
  T s2 = fresh(scores, c);  // + causal_mask
  t_.drop(s1);
  op("attn.softmax");
  T p = fresh(scores, c);
  t_.drop(s2);
  op("attn.attn_output");
  T o = fresh(Bg_ * H * q_ * d, c);
  if (q_ > 1) {
    T oc = fresh(o.numel, c);
    t_.drop(o);
    o = oc;
  }
  attn_weights_ = p;
  return o;
}

T StepBuilder::g_attention(const T& x, std::uint32_t l) {
  const LayerParams& lp = layers_[l];
  const std::uint64_t H = a_.num_heads, kvh = a_.num_kv_heads, d = a_.head_dim, r = rows();
  const std::uint64_t qw = H * d, kvw = kvh * d;
  if (lp.qkv != kNone) {  // Phi-3: one qkv projection, sliced
    T qkv = proj(x, "self_attn.qkv_proj", lp.qkv, lp.qkv_b, qw + 2 * kvw);
    T q = t_.ref(qkv);
    q.numel = r * qw;
    T k = t_.ref(qkv);
    k.numel = r * kvw;
    T v = t_.ref(qkv);
    v.numel = r * kvw;
    return g_attend(q, k, v, l, /*q_bshd=*/false, &qkv);
  }
  T q = proj(x, "self_attn.q_proj", lp.q, lp.q_b, qw);
  if (lp.q_norm != kNone) {
    T qn = g_rms_norm(q, lp.q_norm, r * H, "self_attn.q_norm");
    t_.drop(q);
    q = qn;
  }
  T k = proj(x, "self_attn.k_proj", lp.k, lp.k_b, kvw);
  if (lp.k_norm != kNone) {
    T kn = g_rms_norm(k, lp.k_norm, r * kvh, "self_attn.k_norm");
    t_.drop(k);
    k = kn;
  }
  T v = proj(x, "self_attn.v_proj", lp.v, lp.v_b, kvw);
  return g_attend(q, k, v, l, /*q_bshd=*/true, nullptr);
}

// The attention block after its projections: rotary on q and k, the cache update, attention
// and o_proj, releasing each tensor where the Python variable dies. `fused` is Phi-3's qkv
// output (q, k and v are views of it), released after o_proj.
T StepBuilder::g_attend(T& q, T& k, T& v, std::uint32_t l, bool q_bshd, T* fused) {
  const LayerParams& lp = layers_[l];
  op("self_attn.rotary");
  T qr = g_rope(q);
  T kr = g_rope(k);
  t_.drop(q);
  t_.drop(k);
  cache_update(l, kr, v);
  t_.drop(kr);
  t_.drop(v);
  T o = g_attention_core(qr, l, q_bshd);
  T y = proj(o, "self_attn.o_proj", lp.o, lp.o_b, a_.hidden_size);
  t_.drop(o);
  if (fused) t_.drop(*fused);
  t_.drop(qr);
  return y;
}

// The activation under no_grad (See act_fn): n elements of dtype d out; NewGELUActivation's
// formula, 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) left to right, allocates and
// frees its intermediates on the way.
T StepBuilder::g_act_fn(std::uint64_t n, DType d) {
  if (a_.activation != Activation::kGeluNew) return fresh(n, d);
  T half = fresh(n, d);
  T p3 = fresh(n, d);
  T m1 = fresh(n, d);
  t_.drop(p3);
  T s = fresh(n, d);
  t_.drop(m1);
  T m2 = fresh(n, d);
  t_.drop(s);
  T th = fresh(n, d);
  t_.drop(m2);
  T p1 = fresh(n, d);
  t_.drop(th);
  T act = fresh(n, d);
  t_.drop(half);
  t_.drop(p1);
  return act;
}

T StepBuilder::g_mlp(const T& x, const LayerParams& lp) {
  const std::uint64_t i = a_.intermediate_size, n = rows() * i;
  if (lp.gate_up != kNone) {  // Phi-3: up * act(gate) on chunks of one projection
    T gu = proj(x, "mlp.gate_up_proj", lp.gate_up, kNone, 2 * i);
    op("mlp.activation_fn");
    T act = g_act_fn(n, gu.dtype);
    op("mlp.mul");
    T prod = fresh(n, gu.dtype);
    t_.drop(act);
    T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
    t_.drop(prod);
    t_.drop(gu);
    return y;
  }
  T gate = proj(x, "mlp.gate_proj", lp.gate, lp.gate_b, i);
  op("mlp.act_fn");
  T act = g_act_fn(n, gate.dtype);
  t_.drop(gate);
  T up = proj(x, "mlp.up_proj", lp.up, lp.up_b, i);
  op("mlp.act_fn*up");
  T prod = fresh(n, promote(act.dtype, up.dtype));
  t_.drop(act);
  t_.drop(up);
  T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
  t_.drop(prod);
  return y;
}

// Gemma-2's norm after a branch (the generation twin of post_norm); the identity elsewhere.
T StepBuilder::g_post_norm(T y, std::uint32_t norm, std::uint64_t rows, std::string_view name) {
  if (!a_.sandwich_norms) return y;
  T pn = g_rms_norm(y, norm, rows, name);
  t_.drop(y);
  return pn;
}

T StepBuilder::g_decoder_layer(const T& x, std::uint32_t l) {
  const LayerParams& lp = layers_[l];
  layer_ = static_cast<std::int32_t>(l);
  const std::uint64_t r = rows();
  T n1 = g_rms_norm(x, lp.in_norm, r, "input_layernorm");
  T att = g_attention(n1, l);
  t_.drop(n1);
  att = g_post_norm(att, lp.post_attn_norm, r, "post_attention_layernorm");
  op("residual_add");
  T h1 = fresh(x.numel, promote(x.dtype, att.dtype));
  t_.drop(att);
  T n2 = g_rms_norm(h1, a_.sandwich_norms ? lp.pre_ff_norm : lp.post_attn_norm, r,
                    a_.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  T m = g_mlp(n2, lp);
  t_.drop(n2);
  m = g_post_norm(m, lp.post_ff_norm, r, "post_feedforward_layernorm");
  op("residual_add");
  T out = fresh(h1.numel, promote(h1.dtype, m.dtype));
  t_.drop(m);
  t_.drop(h1);
  if (attn_weights_.id != kNone) t_.drop(attn_weights_);  // the layer's `_` (eager)
  return out;
}

// GPT2Block without autograd (dropout is the identity in eval).
T StepBuilder::g_gpt2_block(const T& x, std::uint32_t l) {
  const LayerParams& lp = layers_[l];
  layer_ = static_cast<std::int32_t>(l);
  const std::uint64_t h = a_.hidden_size, i = a_.intermediate_size, r = rows();
  T n1 = g_layer_norm(x, "ln_1");
  T qkv = proj(n1, "attn.c_attn", lp.qkv, lp.qkv_b, 3 * h);
  T k = t_.ref(qkv);
  k.numel = r * h;
  cache_update(l, k, k);
  t_.drop(k);
  T q = t_.ref(qkv);
  q.numel = r * h;
  T o = g_attention_core(q, l, true);
  t_.drop(q);
  T a = proj(o, "attn.c_proj", lp.o, lp.o_b, h);
  t_.drop(o);
  t_.drop(qkv);
  op("residual_add");
  T h1 = fresh(x.numel, x.dtype);  // attn_output + residual
  t_.drop(n1);
  T n2 = g_layer_norm(h1, "ln_2");
  T f = proj(n2, "mlp.c_fc", lp.up, lp.up_b, i);
  op("mlp.act");
  T act = g_act_fn(f.numel, f.dtype);
  t_.drop(f);
  T m = proj(act, "mlp.c_proj", lp.down, lp.down_b, h);
  t_.drop(act);
  op("residual_add");
  T out = fresh(h1.numel, h1.dtype);  // residual + feed_forward_hidden_states
  t_.drop(n2);
  t_.drop(h1);
  t_.drop(a);
  if (attn_weights_.id != kNone) t_.drop(attn_weights_);  // self_attn_weights (eager)
  t_.drop(m);
  return out;
}

}  // namespace trainmem::graph::step
