// Fuzzes the recipe side: the parse_* spellings, Recipe::validate and trainmem::estimate over
// fuzzed recipes on fuzzed (mostly valid) architectures, so the graph builder and the
// simulator see every knob on every family with odd shapes (head_dim 1, GQA groups, tied or
// untied embeddings, biases, soft-capping) and extreme batch/seq values.
//
// For every cheap estimate it also checks the checkpointing property: with
// checkpointing=full the activations live at the start of backward are never more than with
// checkpointing=none (the same model and recipe otherwise).
//
// Input: FuzzedDataProvider bytes (see README.md). Seeds: corpus/fuzz_recipe/.
#include <fuzzer/FuzzedDataProvider.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_common.h"

namespace {

constexpr const char* kPrecisions[] = {"fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true", "fp16-true"};
constexpr const char* kOptimizers[] = {"adamw", "adamw-fused", "adamw-8bit", "sgd", "adafactor"};
constexpr const char* kCheckpointing[] = {"none", "full"};
constexpr const char* kAttention[] = {"sdpa", "eager", "flash"};
constexpr const char* kLoss[] = {"standard", "fused"};
constexpr const char* kAttentionMasks[] = {"none", "ones", "padded", "left"};  // "left": not a value
constexpr const char* kAllocator[] = {"default", "expandable"};
constexpr const char* kGpus[] = {"h100-80gb", "cpu", "a100-40gb", "t4-16gb", "rtx-4090"};
constexpr const char* kFamilies[] = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2"};
constexpr const char* kDtypes[] = {"float32", "bfloat16", "float16"};
constexpr const char* kModes[] = {"training", "inference"};
constexpr const char* kParallel[] = {"none", "ddp", "fsdp", "zero1", "zero2"};
constexpr const char* kLoraTargets[] = {"default", "all-linear", "q_proj,v_proj", "c_attn", "down_proj,up_proj"};
constexpr const char* kQuantTypes[] = {"fp4", "nf4"};
constexpr const char* kOffload[] = {"none", "optimizer", "params", "both"};
constexpr const char* kSchedules[] = {"1f1b", "gpipe", "interleaved-1f1b", "looped-bfs"};
constexpr const char* kFsdpDtypes[] = {"none", "bf16", "fp32"};
constexpr const char* kLoadDtypes[] = {"auto", "bf16", "fp16"};
constexpr const char* kQuantStorages[] = {"uint8", "bf16"};

// A valid spelling most of the time, otherwise a fuzzed string (typos, case, empty, bytes).
template <std::size_t N>
std::string pick(FuzzedDataProvider& p, const char* const (&valid)[N]) {
  std::uint8_t b = p.ConsumeIntegral<std::uint8_t>();
  if (b < 240) return valid[b % N];
  return p.ConsumeRandomLengthString(24);
}

// A count: small, moderate, any 64-bit value, or a power of two ± 1.
std::uint64_t count(FuzzedDataProvider& p, std::uint64_t small_max) {
  switch (p.ConsumeIntegral<std::uint8_t>() % 5) {
    case 0:
    case 1: return p.ConsumeIntegralInRange<std::uint64_t>(1, small_max);
    case 2: return p.ConsumeIntegralInRange<std::uint64_t>(0, 1u << 16);
    case 3: return p.ConsumeIntegral<std::uint64_t>();
    default: {
      std::uint64_t v = std::uint64_t{1} << p.ConsumeIntegralInRange(0, 63);
      return v + static_cast<std::uint64_t>(p.ConsumeIntegralInRange(-1, 1));
    }
  }
}

// A config.json object. Shapes are chosen to be valid most of the time (heads × head_dim =
// hidden, kv heads dividing heads); some fields are then replaced by fuzzed JSON values.
nlohmann::json make_config(FuzzedDataProvider& p) {
  using nlohmann::json;
  json c;
  const std::string family = kFamilies[p.ConsumeIntegralInRange<std::size_t>(0, 6)];
  c["model_type"] = family;
  // Now and then widths at the reader's limits (2^k ± 1 up to 2^24): each is accepted alone,
  // and their products with batch × seq are what the overflow checks must catch.
  const bool at_limits = p.ConsumeIntegral<std::uint8_t>() < 48;
  auto width = [&](std::uint64_t small_max) -> std::uint64_t {
    if (!at_limits) return p.ConsumeIntegralInRange<std::uint64_t>(1, small_max);
    std::uint64_t v = std::uint64_t{1} << p.ConsumeIntegralInRange(0, 24);
    return std::max<std::uint64_t>(1, v + static_cast<std::uint64_t>(p.ConsumeIntegralInRange(-1, 1)));
  };
  const std::uint64_t heads = width(16);
  const std::uint64_t head_dim = width(64);
  std::vector<std::uint64_t> divisors;  // small ones, the powers of two, and heads itself
  for (std::uint64_t d = 1; d <= std::min<std::uint64_t>(heads, 16); ++d) if (heads % d == 0) divisors.push_back(d);
  for (std::uint64_t d = 32; d <= heads; d <<= 1) if (heads % d == 0) divisors.push_back(d);
  divisors.push_back(heads);
  const std::uint64_t kv = divisors[p.ConsumeIntegralInRange<std::size_t>(0, divisors.size() - 1)];
  const std::uint64_t hidden = heads * head_dim;
  const std::uint64_t layers = p.ConsumeIntegralInRange<std::uint64_t>(1, 4);
  const std::uint64_t inter = width(512);
  const std::uint64_t vocab = p.ConsumeBool() ? width(1024) : p.ConsumeIntegralInRange<std::uint64_t>(1, 1u << 24);
  if (family == "gpt2") {
    c["n_embd"] = hidden <= (1u << 24) ? hidden : width(1024);
    c["n_head"] = heads;
    c["n_layer"] = layers;
    c["n_positions"] = p.ConsumeIntegralInRange<std::uint64_t>(1, 4096);
    if (p.ConsumeBool()) c["n_inner"] = inter;
  } else {
    c["hidden_size"] = p.ConsumeBool() && hidden <= (1u << 24) ? hidden : width(1024);
    if (p.ConsumeBool()) c["head_dim"] = head_dim;
    c["num_attention_heads"] = heads;
    c["num_key_value_heads"] = kv;
    c["num_hidden_layers"] = layers;
    c["intermediate_size"] = inter;
    if (p.ConsumeBool()) c["max_position_embeddings"] = p.ConsumeIntegral<std::uint32_t>();
    if (p.ConsumeBool()) c["attention_bias"] = p.ConsumeBool();
    if (p.ConsumeBool()) c["mlp_bias"] = p.ConsumeBool();
    if (family == "gemma2") {
      if (p.ConsumeBool()) c["attn_logit_softcapping"] = p.ConsumeFloatingPointInRange<double>(0, 100);
      if (p.ConsumeBool()) c["final_logit_softcapping"] = p.ConsumeFloatingPointInRange<double>(0, 100);
    }
  }
  c["vocab_size"] = vocab;
  if (p.ConsumeBool()) c["tie_word_embeddings"] = p.ConsumeBool();
  if (p.ConsumeBool()) c["torch_dtype"] = kDtypes[p.ConsumeIntegralInRange<std::size_t>(0, 2)];
  // Now and then, one field of any kind replaced by a fuzzed value.
  static constexpr const char* kKeys[] = {"hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "vocab_size", "n_embd", "n_head", "n_inner", "torch_dtype",
                                          "hidden_act", "tie_word_embeddings", "model_type",
                                          "attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"};
  while (p.remaining_bytes() > 0 && p.ConsumeIntegral<std::uint8_t>() >= 224) {
    const std::string key = kKeys[p.ConsumeIntegralInRange<std::size_t>(0, std::size(kKeys) - 1)];
    // A dropout probability is mostly a valid one: 0 (no dropout at all) or in (0, 1).
    if (key.find("drop") != std::string::npos && p.ConsumeBool()) {
      c[key] = p.ConsumeBool() ? 0.0 : p.ConsumeProbability<double>();
      continue;
    }
    switch (p.ConsumeIntegralInRange(0, 5)) {
      case 0: c[key] = p.ConsumeIntegral<std::int64_t>(); break;
      case 1: c[key] = p.ConsumeIntegral<std::uint64_t>(); break;
      case 2: c[key] = p.ConsumeFloatingPoint<double>(); break;
      case 3: c[key] = p.ConsumeRandomLengthString(16); break;
      case 4: c[key] = nullptr; break;
      default: c.erase(key); break;
    }
  }
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  const bool from_catalog = p.ConsumeIntegral<std::uint8_t>() < 32;
  std::string catalog_name;
  nlohmann::json config;
  if (from_catalog) {
    static const std::vector<trainmem::CatalogEntry> kCatalog = trainmem::catalog();
    catalog_name = kCatalog[p.ConsumeIntegralInRange<std::size_t>(0, kCatalog.size() - 1)].name;
  } else {
    config = make_config(p);
  }
  const std::string precision = pick(p, kPrecisions), optimizer = pick(p, kOptimizers),
                    checkpointing = pick(p, kCheckpointing), attention = pick(p, kAttention),
                    loss = pick(p, kLoss), allocator = pick(p, kAllocator), gpu = pick(p, kGpus);
  const std::uint64_t batch = count(p, 8), seq = count(p, 512), accum = count(p, 3);
  const std::uint64_t steps = p.ConsumeIntegralInRange<std::uint64_t>(0, 3);
  // The name a config is known by is the path the user typed: any bytes.
  const std::string name = p.ConsumeBool() ? p.ConsumeRandomLengthString(12) : "fuzz/config.json";
  // The knobs beyond the basic recipe (adapters, 4-bit bases, generation, data parallelism, the
  // rank to report), each left at its default most of the time so that combinations stay valid
  // often enough to reach the step builder.
  trainmem::RecipeSpelling sp;
  sp.batch = batch;
  sp.seq = seq;
  sp.grad_accum = accum;
  sp.precision = precision;
  sp.optimizer = optimizer;
  sp.checkpointing = checkpointing;
  sp.attention = attention;
  sp.loss = loss;
  sp.gpu = gpu;
  sp.allocator = allocator;
  std::int64_t rank = -1;
  if (p.ConsumeIntegral<std::uint8_t>() < 96) {
    if (p.ConsumeBool()) {
      sp.lora_rank = count(p, 16);
      sp.lora_targets = pick(p, kLoraTargets);
      sp.lora_dropout = p.ConsumeBool() ? 0.0 : p.ConsumeFloatingPointInRange<double>(-0.5, 1.5);
      if (p.ConsumeBool()) {
        sp.load_in_4bit = true;
        sp.bnb_4bit_quant_type = pick(p, kQuantTypes);
        sp.bnb_4bit_use_double_quant = p.ConsumeBool();
      }
    }
    if (p.ConsumeIntegral<std::uint8_t>() < 64) {
      sp.mode = pick(p, kModes);
      sp.new_tokens = count(p, 16);
      sp.beams = count(p, 4);
    }
    if (p.ConsumeBool()) {
      sp.gpus = count(p, 4);
      sp.parallel = pick(p, kParallel);
      if (p.ConsumeBool()) rank = p.ConsumeIntegralInRange<std::int64_t>(-1, 4);
    }
  }
  // The knobs added since (ZeRO-3, DDP's find_unused_parameters, offload, tensor, pipeline and
  // context parallelism, FSDP2's knobs) are drawn after everything above: an input made before
  // them decodes as it did (an exhausted provider gives 0: none of them). One group at a time,
  // half of the time, so that a combination stays valid often enough to reach the step builder.
  const std::uint8_t more = p.ConsumeIntegral<std::uint8_t>();
  // TP, PP and CP take few of the other knobs (docs/parallelism.md); half of the time those are
  // set to ones they take, so that the sharded step builders are reached, not only refused.
  auto plain_training = [&] {
    if (!p.ConsumeBool()) return;
    sp.mode = "training";
    sp.precision = "fp32";
    sp.optimizer = "adamw";
    sp.loss = "standard";
    sp.attention = "sdpa";
    sp.lora_rank = 0;
    sp.lora_dropout = 0;
    sp.load_in_4bit = false;
    sp.bnb_4bit_quant_type = "fp4";
    sp.bnb_4bit_use_double_quant = false;
    sp.grad_accum = 4;  // a 1F1B pipeline needs at least as many micro-batches as stages
    sp.seq = 64;
  };
  if (more >= 128) {
    switch (more % 8) {
      case 0:
        sp.gpus = count(p, 4);
        sp.parallel = "zero3";
        break;
      case 1: sp.ddp_find_unused_parameters = true; break;
      case 2: sp.offload = pick(p, kOffload); break;
      case 7:  // PP x TP: both groups
      case 3:
        plain_training();
        sp.tp = count(p, 4);
        sp.sequence_parallel = p.ConsumeBool();
        sp.loss_parallel = p.ConsumeBool();
        if (more % 8 == 3) break;
        [[fallthrough]];
      case 4:
        if (more % 8 == 4) plain_training();
        sp.pp = count(p, 4);
        sp.pp_schedule = pick(p, kSchedules);
        sp.pp_stages_per_rank = p.ConsumeBool() ? 1 : count(p, 3);
        break;
      case 5:
        plain_training();
        sp.cp = count(p, 4);
        break;
      default:
        sp.fsdp_reshard_after_forward = p.ConsumeBool();
        sp.fsdp_replicate = p.ConsumeBool() ? 1 : count(p, 4);
        sp.fsdp_param_dtype = pick(p, kFsdpDtypes);
        sp.fsdp_reduce_dtype = pick(p, kFsdpDtypes);
        break;
    }
  }
  // Drawn after the groups (the same reason): the load dtype (a 4-bit base's or a LoRA model's), now and then.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.load_dtype = pick(p, kLoadDtypes);
  // And after that (older inputs decode as before): the packed weights' storage dtype.
  if (p.ConsumeIntegral<std::uint8_t>() >= 160) sp.bnb_4bit_quant_storage = pick(p, kQuantStorages);
  // And after that: a 4-bit base not prepared by prepare_model_for_kbit_training.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.prepare_kbit_training = false;
  // And after that: per-layer checkpointing under torch.utils.checkpoint's reentrant variant.
  if (p.ConsumeIntegral<std::uint8_t>() >= 128 && sp.checkpointing == "full") sp.checkpointing = "full-reentrant";
  // And after that: the batch's attention_mask.
  if (p.ConsumeIntegral<std::uint8_t>() >= 128) sp.attention_mask = pick(p, kAttentionMasks);
  // And after that: DDP's .grads as views of its buckets.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.ddp_gradient_as_bucket_view = true;
  // And after that: DDP's no_sync on every micro-batch but the last.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.ddp_no_sync = true;
  // And after that: Accelerate's conversion of the outputs to fp32.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.fp32_outputs = true;
  // And after that: FSDP2's no_sync accumulation.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.fsdp_no_sync = true;
  // And after that: a training forward's DynamicCache.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.use_cache = true;
  // And after that: the Trainer's clip_grad_norm_.
  if (p.ConsumeIntegral<std::uint8_t>() >= 192) sp.clip_grad_norm = true;

  if (std::getenv("TRAINMEM_FUZZ_VERBOSE")) {  // to read a reproducer: what the bytes decode to
    std::fprintf(stderr, "model: %s\nname: %s\nrecipe: precision=%s optimizer=%s checkpointing=%s "
                 "attention=%s loss=%s allocator=%s gpu=%s batch=%llu seq=%llu grad_accum=%llu steps=%llu\n"
                 "lora=%llu targets=%s dropout=%g 4bit=%d %s dq=%d mode=%s new_tokens=%llu beams=%llu "
                 "gpus=%llu parallel=%s rank=%lld\n",
                 from_catalog ? catalog_name.c_str()
                              : config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str(),
                 nlohmann::json(name).dump(-1, ' ', true, nlohmann::json::error_handler_t::replace).c_str(),
                 precision.c_str(), optimizer.c_str(), sp.checkpointing.c_str(), attention.c_str(), loss.c_str(),
                 allocator.c_str(), gpu.c_str(), static_cast<unsigned long long>(batch),
                 static_cast<unsigned long long>(seq), static_cast<unsigned long long>(accum),
                 static_cast<unsigned long long>(steps), static_cast<unsigned long long>(sp.lora_rank),
                 sp.lora_targets.c_str(), sp.lora_dropout, sp.load_in_4bit, sp.bnb_4bit_quant_type.c_str(),
                 sp.bnb_4bit_use_double_quant, sp.mode.c_str(), static_cast<unsigned long long>(sp.new_tokens),
                 static_cast<unsigned long long>(sp.beams), static_cast<unsigned long long>(sp.gpus),
                 sp.parallel.c_str(), static_cast<long long>(rank));
    std::fprintf(stderr, "find_unused=%d gradient_as_bucket_view=%d no_sync=%d fp32_outputs=%d fsdp_no_sync=%d use_cache=%d clip=%d offload=%s tp=%llu sp=%d lp=%d pp=%llu schedule=%s stages=%llu cp=%llu "
                 "fsdp: reshard=%d replicate=%llu param=%s reduce=%s load_dtype=%s quant_storage=%s prepare_kbit=%d "
                 "attention_mask=%s\n",
                 sp.ddp_find_unused_parameters, sp.ddp_gradient_as_bucket_view, sp.ddp_no_sync, sp.fp32_outputs, sp.fsdp_no_sync, sp.use_cache, sp.clip_grad_norm, sp.offload.c_str(), static_cast<unsigned long long>(sp.tp),
                 sp.sequence_parallel, sp.loss_parallel, static_cast<unsigned long long>(sp.pp), sp.pp_schedule.c_str(),
                 static_cast<unsigned long long>(sp.pp_stages_per_rank), static_cast<unsigned long long>(sp.cp),
                 sp.fsdp_reshard_after_forward, static_cast<unsigned long long>(sp.fsdp_replicate),
                 sp.fsdp_param_dtype.c_str(), sp.fsdp_reduce_dtype.c_str(), sp.load_dtype.c_str(),
                 sp.bnb_4bit_quant_storage.c_str(), sp.prepare_kbit_training, sp.attention_mask.c_str());
  }
  fuzz::expected_outcome([&] {
    trainmem::Recipe r = trainmem::parse_recipe(sp);
    if (r.mode == trainmem::Mode::kTraining) r.steps = steps;
    r.validate();
    // Round trip of every spelling.
    FUZZ_CHECK(trainmem::parse_precision(trainmem::to_string(r.precision)) == r.precision);
    FUZZ_CHECK(trainmem::parse_optimizer(trainmem::to_string(r.optimizer)) == r.optimizer);
    FUZZ_CHECK(trainmem::parse_allocator(trainmem::to_string(r.allocator)) == r.allocator);
    FUZZ_CHECK(trainmem::parse_attention_mask(trainmem::to_string(r.attention_mask)) == r.attention_mask);
    trainmem::Model m = from_catalog ? trainmem::load_model(catalog_name)
                                     : trainmem::model_from_config_json(
                                           config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                                           name);
    fuzz::check_estimate(m, r, false, rank);
    if (std::getenv("TRAINMEM_FUZZ_VERBOSE")) std::fprintf(stderr, "valid: %s\n", fuzz::cheap(m, r) ? "estimated" : "not cheap");
    if (fuzz::cheap(m, r) && r.mode == trainmem::Mode::kTraining && r.checkpointing == trainmem::Checkpointing::kNone) {
      trainmem::Recipe full = r;
      full.checkpointing = trainmem::Checkpointing::kFull;
      const auto act = trainmem::Category::kActivations;
      std::uint64_t none_bytes = fuzz::live_at_backward_start(m, r, act);
      std::uint64_t full_bytes = fuzz::live_at_backward_start(m, full, act);
      if (full_bytes > none_bytes) {
        std::string d = "checkpointing=full has " + std::to_string(full_bytes) +
                        " B of activations at the start of backward, none has " + std::to_string(none_bytes);
        fuzz::finding("property broken:", d.c_str());
      }
    }
  });
  return 0;
}
