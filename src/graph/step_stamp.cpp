// Stamping repeated decoder layers (Note [Stamped decoder layers] in tape.h): the step
// builder's side, which decides when a layer's forward may be stamped from the last one built.
#include "graph/step_builder.h"

namespace trainmem::graph {

namespace {
thread_local bool t_stamping = true;
thread_local bool t_backward_stamping = true;
thread_local std::uint64_t t_stamped = 0;
}  // namespace

void set_layer_stamping(bool on) { t_stamping = on; }
bool layer_stamping() { return t_stamping; }
void set_backward_stamping(bool on) { t_backward_stamping = on; }
bool backward_stamping() { return t_backward_stamping; }
std::uint64_t stamped_layers() { return t_stamped; }

}  // namespace trainmem::graph

namespace trainmem::graph::step {

// Note [Layer stamp keys]
// A decoder layer's forward (decoder_layer) reads, besides constants of the builder (the
// model, the recipe, the policy, the batch shape): its input (numel, dtype, layout, whether it
// requires grad), its parameters (LayerParams and its LoRA adapters: presence, numel, dtype,
// trainable, quantized, the matmul flag and rows, and the autocast cache entry, which must be
// empty), the shared tensors of the forward (cos_, sin_, mask_, position_ids_), the forward's
// cuBLAS workspace (made at the first GEMM), the op label it starts under, the phase, and
// whether the stream is a DTensor or lm_head is running. Two layers that agree in all of these
// make the same calls on the tape, with other ids. Under data parallelism, ZeRO, FSDP2, tensor,
// context or pipeline parallelism, quantized bases and checkpointing the layer also reads or
// changes state of its wrappers (fetches, hooks, units, closures), so those recipes build every
// layer (stamps_ is false). The tape checks what the captured layer did beyond that (Note
// [Stamped decoder layers]); after a stamp the builder repeats the layer's own changes: the
// current layer and op label, and the autocast cache entries of the layer's weights.
namespace {
constexpr std::uint32_t LayerParams::*kLayerFields[] = {
    &LayerParams::in_norm, &LayerParams::in_norm_b,      &LayerParams::qkv,          &LayerParams::qkv_b,
    &LayerParams::q,       &LayerParams::q_b,            &LayerParams::k,            &LayerParams::k_b,
    &LayerParams::v,       &LayerParams::v_b,            &LayerParams::o,            &LayerParams::o_b,
    &LayerParams::q_norm,  &LayerParams::k_norm,         &LayerParams::post_attn_norm,
    &LayerParams::post_attn_norm_b, &LayerParams::pre_ff_norm, &LayerParams::post_ff_norm,
    &LayerParams::gate_up, &LayerParams::gate,           &LayerParams::gate_b,       &LayerParams::up,
    &LayerParams::up_b,    &LayerParams::down,           &LayerParams::down_b};
static_assert(sizeof(kLayerFields) / sizeof(kLayerFields[0]) * sizeof(std::uint32_t) == sizeof(LayerParams),
              "a LayerParams field is missing from the stamp's roles");

bool same_param(const Param& a, const Param& b) {
  return a.numel == b.numel && a.dtype == b.dtype && a.trainable == b.trainable && a.quantized == b.quantized &&
         a.matmul == b.matmul && a.rows == b.rows && a.cast == kNone && b.cast == kNone;
}

bool same_op(std::string_view a, std::string_view b) { return a.data() == b.data() && a.size() == b.size(); }
}  // namespace

// The layer's parameters by role, and the outside storages, values and parameter slots the tape
// substitutes: the input and the shared tensors, then each present role's parameter storage.
void StepBuilder::layer_tables(const T& x, std::uint32_t l) {
  roles_.clear();
  for (auto f : kLayerFields) roles_.push_back(layers_[l].*f);
  if (!adapters_.empty()) {
    for (const Adapter& ad : adapters_[l]) {
      roles_.push_back(ad.a);
      roles_.push_back(ad.b);
    }
  }
  outside_.clear();
  outside_.insert(outside_.end(), {x.id, cos_.id, sin_.id, mask_.id, position_ids_.id});
  slots_.clear();
  for (std::uint32_t pi : roles_) {
    if (pi == kNone) continue;
    outside_.push_back(params_[pi].storage);
    slots_.push_back(params_[pi].slot);
  }
  outside_values_.assign(1, x.value);
}

bool StepBuilder::matches(const LayerTemplate& k, const T& x, std::uint32_t l) const {
  if (!k.valid || x.numel != k.x_numel || x.dtype != k.x_dtype || x.bshd != k.x_bshd ||
      x.requires_grad() != k.x_grad || (ws_fwd_ != kNone) != k.ws_fwd || !same_op(op_, k.op_before) ||
      phase_ != Phase::kForward || dtensor_ || in_lm_head_ || roles_.size() != k.roles.size() ||
      cos_.dtype != k.cos_dtype || cos_.numel != k.cos_numel || mask_.dtype != k.mask_dtype ||
      mask_.numel != k.mask_numel) {
    return false;
  }
  for (std::size_t r = 0; r < roles_.size(); ++r) {
    if ((roles_[r] == kNone) != (k.roles[r] == kNone)) return false;
    if (roles_[r] != kNone && !same_param(params_[roles_[r]], k.params[r])) return false;
  }
  if (!adapters_.empty()) {
    const std::vector<Adapter>& ads = adapters_[l];
    if (ads.size() != k.adapters.size()) return false;
    for (std::size_t i = 0; i < ads.size(); ++i) {
      if (ads[i].path != k.adapters[i].path || ads[i].in != k.adapters[i].in || ads[i].out != k.adapters[i].out) {
        return false;
      }
    }
  }
  return t_.can_stamp(k.span, outside_);
}

T StepBuilder::layer_forward(const T& x, std::uint32_t l) {
  if (!stamps_) return decoder_layer(x, l);
  layer_tables(x, l);
  if (matches(templates_[last_template_], x, l)) return stamp_layer(templates_[last_template_], l);
  for (std::uint32_t i = 0; i < templates_.size(); ++i) {
    if (i != last_template_ && matches(templates_[i], x, l)) {
      last_template_ = i;
      return stamp_layer(templates_[i], l);
    }
  }
  // Built, and captured as a template unless two captures failed already (the recipe then
  // builds the rest: a capture costs a copy of the storage table).
  if (stamp_failures_ >= 2) return decoder_layer(x, l);
  last_template_ = next_template_;
  LayerTemplate& k = templates_[next_template_];
  next_template_ = (next_template_ + 1) % static_cast<std::uint32_t>(templates_.size());
  k.valid = false;
  k.x_numel = x.numel;
  k.x_dtype = x.dtype;
  k.x_bshd = x.bshd;
  k.x_grad = x.requires_grad();
  k.ws_fwd = ws_fwd_ != kNone;
  k.op_before = op_;
  k.cos_dtype = cos_.dtype;
  k.cos_numel = cos_.numel;
  k.mask_dtype = mask_.dtype;
  k.mask_numel = mask_.numel;
  k.roles = roles_;
  k.params.assign(roles_.size(), Param{});
  bool keyed = phase_ == Phase::kForward && !dtensor_ && !in_lm_head_;
  for (std::size_t r = 0; r < roles_.size(); ++r) {
    if (roles_[r] == kNone) continue;
    k.params[r] = params_[roles_[r]];
    keyed = keyed && k.params[r].cast == kNone;
  }
  k.adapters.clear();
  if (!adapters_.empty()) k.adapters = adapters_[l];
  if (keyed) t_.mark(mark_);
  const std::size_t casts_before = casts_.size();
  const TensorId ws_fwd = ws_fwd_, ws_bwd = ws_bwd_;
  T out = decoder_layer(x, l);
  if (keyed && ws_fwd == ws_fwd_ && ws_bwd == ws_bwd_) capture_layer(k, l, out, casts_before);
  if (!k.valid) ++stamp_failures_;
  return out;
}

void StepBuilder::capture_layer(LayerTemplate& k, std::uint32_t l, const T& out, std::size_t casts_before) {
  const TensorId s0 = mark_.storages;
  if (layer_ != static_cast<std::int32_t>(l) || phase_ != Phase::kForward || out.id == kNone || out.id < s0 ||
      (out.value != kNone && out.value < mark_.values)) {
    return;
  }
  // The layer's parameters are as they were but for the autocast cache entries it made, each
  // listed in casts_ (weight() lists every one it makes).
  std::size_t cached = 0;
  for (std::size_t r = 0; r < roles_.size(); ++r) {
    if (roles_[r] == kNone) continue;
    const Param& now = params_[roles_[r]];
    const Param& was = k.params[r];
    if (now.storage != was.storage || now.dtype != was.dtype || now.slot != was.slot ||
        now.trainable != was.trainable || now.master != was.master) {
      return;
    }
    if (now.cast != kNone) ++cached;
  }
  k.casts.clear();
  for (std::size_t i = casts_before; i < casts_.size(); ++i) {
    const std::uint32_t pi = casts_[i];
    const auto role = std::find(roles_.begin(), roles_.end(), pi);
    const TensorId cast = params_[pi].cast;
    const ValueId value = params_[pi].cast_value;
    if (role == roles_.end() || cast == kNone || cast < s0 || value == kNone || value < mark_.values) return;
    k.casts.push_back({static_cast<std::uint32_t>(role - roles_.begin()), cast - s0, value - mark_.values});
  }
  if (cached != k.casts.size()) return;
  k.out = out;
  k.out.id = out.id - s0;
  if (out.value != kNone) k.out.value = out.value - mark_.values;
  k.op_after = op_;
  k.valid = t_.capture(mark_, outside_, outside_values_, slots_, layer_, k.span);
}

T StepBuilder::stamp_layer(LayerTemplate& k, std::uint32_t l) {
  const TensorId s0 = static_cast<TensorId>(t_.trace().storages.size());
  const ValueId v0 = t_.value_count();
  layer_ = static_cast<std::int32_t>(l);
  t_.stamp(k.span, outside_, outside_values_, slots_, layer_);
  op_ = k.op_after;
  for (const auto& [role, cast, value] : k.casts) {
    const std::uint32_t pi = roles_[role];
    params_[pi].cast = cast + s0;
    params_[pi].cast_value = value + v0;
    casts_.push_back(pi);
  }
  T out = k.out;
  out.id += s0;
  if (out.value != kNone) out.value += v0;
  ++t_stamped;
  return out;
}

}  // namespace trainmem::graph::step
