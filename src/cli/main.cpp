// The `trainmem` command: estimate, fit, compare, models, gpus.
//
// Output contract: on success the whole report is built first and printed at once; on bad
// input one line "trainmem: error: ..." goes to stderr, exit code 2, and nothing to stdout.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <cstdio>
#include <iostream>
#include <string>
#include <tuple>

#include "common/json_input.h"
#include "report/report.h"
#include "trainmem/trainmem.h"

namespace {

using trainmem::Error;

// `zero_ok`: 0 means something (no adapters, rank 0), so the message asks for 0 or more.
std::uint64_t parse_count(const std::string& s, const char* field, bool zero_ok = false) {
  std::uint64_t v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || ptr != end) {
    throw Error(std::string(field) + (zero_ok ? ": must be a whole number (0 or more), got '"
                                              : ": must be a positive integer, got '") + s + "'");
  }
  return v;
}

// --host-memory: whole GiB, 1 to 1 PiB (See Note [Host memory in the planner] in src/plan/fit.cpp).
std::uint64_t host_memory_bytes(const std::string& gib) {
  const std::uint64_t n = parse_count(gib, "host_memory (GiB)");
  if (n == 0 || n > (1ull << 20)) {
    throw Error("host_memory: must be between 1 and 1048576 GiB of host memory per GPU, got '" + gib + "'");
  }
  return n << 30;
}

bool parse_bool(const std::string& s, const char* field) {
  if (s == "true") return true;
  if (s == "false") return false;
  throw Error(std::string(field) + ": must be true or false, got '" + s + "'");
}

// A non-negative decimal number ("0.05"); the whole string must parse.
double parse_fraction(const std::string& s, const char* field) {
  double v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || ptr != end || !std::isfinite(v)) {
    throw Error(std::string(field) + ": must be a number, got '" + s + "'");
  }
  return v;
}

// The recipe knobs, shared by `estimate` and `fit`. Values are kept as typed and checked by
// parse_recipe, so every front end reports the same errors.
struct RecipeFlags {
  std::string batch = "1", seq = "2048", accum = "1";
  std::string precision = "", optimizer = "adamw", ckpt = "none", attention = "sdpa",
              loss = "standard", attention_mask = "none", gpu = "h100-80gb", allocator = "default";
  std::string lora_rank = "0", lora_targets = "default", lora_dropout = "0";
  bool inference = false;
  bool load_in_4bit = false, double_quant = false, qlora = false, load_in_8bit = false, no_prepare_kbit = false;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  bool ddp_find_unused_parameters = false;
  bool ddp_gradient_as_bucket_view = false;
  bool ddp_no_sync = false;
  bool fp32_outputs = false;
  bool fsdp_no_sync = false;
  bool use_cache = false;
  bool clip_grad_norm = false;
  std::string quant_type = "";
  std::string load_dtype = "auto";
  std::string quant_storage = "uint8";
  std::string new_tokens = "128", beams = "1";
  std::string gpus = "1", parallel = "none", tp = "1", cp = "1", zero = "", offload = "none", pp = "1", pp_schedule = "1f1b",
              pp_stages_per_rank = "1";
  std::string fsdp_reshard_after_forward = "true", fsdp_replicate = "1", fsdp_param_dtype = "none",
              fsdp_reduce_dtype = "none";
  std::vector<std::pair<std::string, CLI::Option*>> options;  // knob name → its flag

  // `fit`: the planner's help where it reads the flags otherwise (it searches the GPUs' use and
  // plans training only).
  void add_to(CLI::App* app, bool fit) {
    auto opt = [&](const char* knob, const char* flag, std::string& v, const char* help) {
      CLI::Option* o = app->add_option(flag, v, help)->capture_default_str();
      options.emplace_back(knob, o);
    };
    opt("batch", "--batch", batch, "Micro-batch size");
    opt("grad_accum", "--grad-accum", accum, "Micro-batches per optimizer step");
    opt("seq", "--seq", seq,
        "Sequence length in tokens (unset: 2048, or the model's positions where fewer: GPT-2 1024, less "
        "--new-tokens - 1 with --inference)");
    opt("precision", "--precision", precision,
        fit ? "fp32 | bf16-mixed | fp16-mixed | bf16-master | bf16-true | fp16-true (default: bf16-mixed; over a "
              "4-bit or 8-bit base bf16-true; with --load-dtype its autocast; under ZeRO bf16-master)"
            : "fp32 | bf16-mixed | fp16-mixed | bf16-master | bf16-true | fp16-true (default: bf16-mixed; over a "
              "4-bit or 8-bit base and in inference bf16-true; with --load-dtype its autocast; under ZeRO "
              "bf16-master)");
    opt("optimizer", "--optimizer", optimizer, "adamw | adamw-fused | adamw-8bit | sgd | adafactor");
    opt("checkpointing", "--checkpointing", ckpt,
        "none | full (per decoder layer, use_reentrant=False) | full-reentrant (use_reentrant=True, as peft's "
        "prepare_model_for_kbit_training turns on; not with --pp or --cp, DDP's find_unused_parameters, or a "
        "4-bit base under ZeRO or FSDP2)");
    opt("attention", "--attention", attention, "eager | sdpa | flash");
    opt("loss", "--loss", loss, "standard (fp32 logits) | fused (chunked linear + cross-entropy)");
    opt("attention_mask", "--attention-mask", attention_mask,
        "The batch's attention_mask: none | ones (unpadded, as a tokenizer gives it) | padded (some tokens are "
        "padding; SDPA then gets a [batch, 1, seq, seq] mask)");
    opt("gpu", "--gpu", gpu, "GPU from `trainmem gpus`, or cpu");
    opt("allocator", "--allocator", allocator, "default | expandable (expandable_segments:True)");
    opt("lora_rank", "--lora", lora_rank, "LoRA rank; 0 trains every parameter");
    opt("lora_targets", "--lora-targets", lora_targets,
        "Modules LoRA wraps: default (peft's), all-linear, or names (q_proj,v_proj)");
    opt("lora_dropout", "--lora-dropout", lora_dropout, "lora_dropout (0: no dropout, nothing saved)");
    options.emplace_back("load_in_4bit", app->add_flag("--load-in-4bit", load_in_4bit,
                                                       fit ? "4-bit weights (bitsandbytes); needs --lora"
                                                           : "4-bit weights (bitsandbytes); needs --lora or --inference"));
    opt("bnb_4bit_quant_type", "--bnb-4bit-quant-type", quant_type, "With --load-in-4bit: fp4 (transformers' default) | nf4");
    options.emplace_back("bnb_4bit_use_double_quant",
                         app->add_flag("--bnb-4bit-use-double-quant", double_quant,
                                       "With --load-in-4bit: quantize the block constants again"));
    options.emplace_back("load_in_4bit", app->add_flag("--qlora", qlora,
                                                       "QLoRA's base: --load-in-4bit --bnb-4bit-quant-type nf4 "
                                                       "--bnb-4bit-use-double-quant"));
    opt("load_dtype", "--load-dtype", load_dtype,
        "The dtype the model is loaded in; auto (the precision's) | bf16 (with bf16-mixed: a Trainer with "
        "bf16=True over a bf16-loaded model: a QLoRA base, a half model whose fp32 adapters run under autocast, or "
        "a half model trained whole) | fp16 (with fp16-mixed, and --load-in-4bit or --lora)");
    options.emplace_back("prepare_kbit_training",
                         app->add_flag("--no-prepare-kbit-training", no_prepare_kbit,
                                       "With --load-in-4bit and --load-dtype bf16/fp16: skip peft's "
                                       "prepare_model_for_kbit_training, so what is not 4-bit stays half (TRL's "
                                       "sharded QLoRA under FSDP or ZeRO-3)"));
    opt("bnb_4bit_quant_storage", "--bnb-4bit-quant-storage", quant_storage,
        "With --load-in-4bit: the packed weights' dtype; uint8 (bitsandbytes' default) | bf16 (the FSDP / ZeRO-3 "
        "QLoRA recipe's; the same bytes, sharded as bf16 elements)");
    options.emplace_back("load_in_8bit", app->add_flag("--load-in-8bit", load_in_8bit,
                                                       "8-bit weights (bitsandbytes LLM.int8, threshold 6.0); --inference only"));
    CLI::Option* inf = app->add_flag("--inference", inference, "Generation (prefill + decode with a KV cache), not training");
    options.emplace_back("mode", inf);
    opt("new_tokens", "--new-tokens", new_tokens, "Inference: tokens generated after the prompt of --seq tokens");
    opt("beams", "--beams", beams, "Inference: beam-search width (1: greedy)");
    opt("gpus", "--gpus", gpus,
        fit ? "GPUs to plan for; the search picks the wrapper, tensor, pipeline and context parallelism over them "
              "unless --parallel or --tp holds them"
            : "Data-parallel GPUs (ranks); more than 1 needs --parallel (with --tp or --pp: the data-parallel degree)");
    opt("parallel", "--parallel", parallel,
        fit ? "Holds the wrapper: none (plain DDP on several GPUs, or a tensor-parallel group alone) | ddp | fsdp | "
              "zero1 | zero2 | zero3; left out, the search tries them"
            : "none | ddp (DistributedDataParallel) | fsdp (FSDP2 per decoder layer) | zero1 | zero2 | zero3 (DeepSpeed ZeRO)");
    opt("parallel", "--zero", zero, "DeepSpeed ZeRO stage 1 | 2 | 3: --zero N is --parallel zeroN");
    opt("tp", "--tp", tp, "Tensor-parallel degree (torch parallelize_module, Megatron plan); 1: none");
    options.emplace_back("sequence_parallel",
                         app->add_flag("--sequence-parallel", sequence_parallel,
                                       "With --tp: sequence parallelism (SequenceParallel on the norms, the residual "
                                       "stream sharded on the sequence)"));
    options.emplace_back("ddp_find_unused_parameters",
                         app->add_flag("--ddp-find-unused-parameters", ddp_find_unused_parameters,
                                       "With --parallel ddp: DistributedDataParallel(find_unused_parameters=True), "
                                       "what Hugging Face's Trainer passes for a peft model or without checkpointing"));
    options.emplace_back("ddp_gradient_as_bucket_view",
                         app->add_flag("--ddp-gradient-as-bucket-view", ddp_gradient_as_bucket_view,
                                       "With --parallel ddp: DistributedDataParallel(gradient_as_bucket_view=True), "
                                       "the .grads views of the buckets (one copy of the gradients, not two)"));
    options.emplace_back("ddp_no_sync",
                         app->add_flag("--ddp-no-sync", ddp_no_sync,
                                       "With --parallel ddp: every micro-batch but the step's last under "
                                       "DistributedDataParallel.no_sync(), as Accelerate and Hugging Face's Trainer "
                                       "accumulate (one all-reduce per step)"));
    options.emplace_back("fsdp_no_sync",
                         app->add_flag("--fsdp-no-sync", fsdp_no_sync,
                                       "With --parallel fsdp: every micro-batch but the step's last under "
                                       "set_requires_gradient_sync(False), as Accelerate and Hugging Face's Trainer "
                                       "accumulate (each rank holds unsharded gradients until the last)"));
    options.emplace_back("use_cache",
                         app->add_flag("--use-cache", use_cache,
                                       "Training forwards with use_cache true (the config's default, which a Trainer "
                                       "run without checkpointing keeps): each layer's keys and values copied into a "
                                       "DynamicCache held to the loss"));
    options.emplace_back("clip_grad_norm",
                         app->add_flag("--clip-grad-norm", clip_grad_norm,
                                       "accelerator.clip_grad_norm_ before each optimizer step, as Hugging Face's "
                                       "Trainer runs it (the total norm kept to the next step)"));
    options.emplace_back("fp32_outputs",
                         app->add_flag("--fp32-outputs", fp32_outputs,
                                       "With bf16-mixed or fp16-mixed: the model's half logits copied to fp32 when "
                                       "its forward returns, as Accelerate's prepare() wraps it (convert_outputs_to_fp32; "
                                       "Hugging Face's Trainer)"));
    options.emplace_back("loss_parallel",
                         app->add_flag("--loss-parallel", loss_parallel,
                                       "With --tp: vocab-parallel lm_head (ColwiseParallel, Shard(-1) logits) and "
                                       "the cross-entropy inside torch's loss_parallel()"));
    opt("cp", "--cp", cp, "Context-parallel degree (torch context_parallel, ring attention; unmeasured); 1: none");
    opt("pp", "--pp", pp,
        "Pipeline-parallel degree (torch.distributed.pipelining, one stage per GPU; --grad-accum is the number of "
        "micro-batches; with --gpus D --parallel ddp or fsdp: D replicas of each stage, pp x D GPUs; with --tp T: each stage "
        "tensor-parallel over T GPUs); 1: none");
    opt("pp_schedule", "--pp-schedule", pp_schedule,
        "With --pp: 1f1b (Schedule1F1B) | gpipe (ScheduleGPipe) | interleaved-1f1b (ScheduleInterleaved1F1B) | "
        "looped-bfs (ScheduleLoopedBFS); the last two with --pp-stages-per-rank 2 or more");
    opt("pp_stages_per_rank", "--pp-stages-per-rank", pp_stages_per_rank,
        "With --pp and interleaved-1f1b / looped-bfs: V stages per GPU (rank r holds stages r, r + pp, ...; the "
        "decoder layers split over pp x V stages); 1 with 1f1b and gpipe");
    opt("fsdp_reshard_after_forward", "--fsdp-reshard-after-forward", fsdp_reshard_after_forward,
        "With --parallel fsdp: true | false (the decoder layers stay gathered from forward to backward: SHARD_GRAD_OP)");
    opt("fsdp_replicate", "--fsdp-replicate", fsdp_replicate,
        "With --parallel fsdp: HSDP replica groups R, mesh (R, gpus / R); 1 shards over every GPU");
    opt("fsdp_param_dtype", "--fsdp-param-dtype", fsdp_param_dtype,
        "With --parallel fsdp and fp32 (or bf16-mixed: Accelerate's policy under autocast): MixedPrecisionPolicy "
        "param_dtype, none | bf16");
    opt("fsdp_reduce_dtype", "--fsdp-reduce-dtype", fsdp_reduce_dtype,
        "With --fsdp-param-dtype: MixedPrecisionPolicy reduce_dtype, none (param_dtype) | fp32 | bf16");
    opt("offload", "--offload", offload,
        "none | optimizer (DeepSpeed offload_optimizer {device: cpu}: zero1 / zero2 / zero3) | params "
        "(offload_param {device: cpu}: zero3) | both (zero3; fsdp: FSDP2's CPUOffloadPolicy)");
  }

  bool was_given(std::string_view knob) const {
    const std::vector<std::string> typed = given();
    return std::find(typed.begin(), typed.end(), knob) != typed.end();
  }
  // Knobs the user typed on the command line.
  std::vector<std::string> given() const {
    std::vector<std::string> out;
    for (const auto& [knob, o] : options) {
      if (o->count() > 0) out.push_back(knob);
    }
    return out;
  }

  trainmem::RecipeSpelling spelling() const {
    trainmem::RecipeSpelling sp;
    sp.batch = parse_count(batch, "batch");
    sp.seq = parse_count(seq, "seq");
    sp.grad_accum = parse_count(accum, "grad_accum");
    sp.precision = precision;
    sp.optimizer = optimizer;
    sp.checkpointing = ckpt;
    sp.attention = attention;
    sp.loss = loss;
    sp.attention_mask = attention_mask;
    sp.gpu = gpu;
    sp.allocator = allocator;
    sp.lora_rank = parse_count(lora_rank, "lora_rank", /*zero_ok=*/true);
    sp.lora_targets = lora_targets;
    sp.lora_dropout = parse_fraction(lora_dropout, "lora_dropout");
    if (qlora && !quant_type.empty() && quant_type != "nf4") {
      throw Error("bnb_4bit_quant_type: --qlora is an nf4 base with double quant; for " + quant_type +
                  " use --load-in-4bit --bnb-4bit-quant-type " + quant_type);
    }
    sp.load_in_4bit = load_in_4bit || qlora;
    sp.bnb_4bit_quant_type = !quant_type.empty() ? quant_type : (qlora ? "nf4" : sp.bnb_4bit_quant_type);
    sp.bnb_4bit_use_double_quant = double_quant || qlora;
    sp.load_dtype = load_dtype;
    sp.bnb_4bit_quant_storage = quant_storage;
    sp.prepare_kbit_training = !no_prepare_kbit;
    sp.load_in_8bit = load_in_8bit;
    sp.mode = inference ? "inference" : "training";
    sp.new_tokens = parse_count(new_tokens, "new_tokens");
    sp.beams = parse_count(beams, "beams");
    sp.gpus = parse_count(gpus, "gpus");
    sp.parallel = parallel;
    sp.tp = parse_count(tp, "tp");
    sp.sequence_parallel = sequence_parallel;
    sp.loss_parallel = loss_parallel;
    sp.cp = parse_count(cp, "cp");
    sp.pp = parse_count(pp, "pp");
    sp.pp_schedule = pp_schedule;
    sp.pp_stages_per_rank = parse_count(pp_stages_per_rank, "pp_stages_per_rank");
    sp.fsdp_reshard_after_forward = parse_bool(fsdp_reshard_after_forward, "fsdp_reshard_after_forward");
    sp.ddp_find_unused_parameters = ddp_find_unused_parameters;
    sp.ddp_gradient_as_bucket_view = ddp_gradient_as_bucket_view;
    sp.ddp_no_sync = ddp_no_sync;
    sp.fp32_outputs = fp32_outputs;
    sp.fsdp_no_sync = fsdp_no_sync;
    sp.use_cache = use_cache;
    sp.clip_grad_norm = clip_grad_norm;
    sp.fsdp_replicate = parse_count(fsdp_replicate, "fsdp_replicate");
    sp.fsdp_param_dtype = fsdp_param_dtype;
    sp.fsdp_reduce_dtype = fsdp_reduce_dtype;
    if (!zero.empty()) {
      if (zero != "1" && zero != "2" && zero != "3") {
        throw trainmem::Error("zero: '" + zero + "' is not a ZeRO stage; expected 1, 2 or 3 (--zero N is --parallel zeroN)");
      }
      if (parallel != "none" && parallel != "zero" + zero) {
        throw trainmem::Error("zero: --zero " + zero + " and --parallel " + parallel + " disagree; give one of them");
      }
      sp.parallel = "zero" + zero;
    }
    sp.offload = offload;
    return sp;
  }
};

// Error lines echo user input (model names, paths); control characters are escaped so the
// message stays one line whatever was typed, and a line past 2,000 characters (a 100 KB module
// list echoed back) is cut.
int fail(const std::string& msg) {
  constexpr std::size_t kMaxErrorChars = 2000;
  std::string line;
  for (unsigned char c : msg) {
    if (line.size() >= kMaxErrorChars) {
      line += " [...]";
      break;
    }
    if (c < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02x", c);
      line += esc;
    } else {
      line += static_cast<char>(c);
    }
  }
  std::fprintf(stderr, "trainmem: error: %s\n", line.c_str());
  return 2;
}

// The model a measurement names: a catalog name or id, or a path. A relative path that does not
// resolve from the working directory is looked for beside the measurement and in the directories
// above it: the corpus names its configs from the repository's root (data/ground_truth/configs/...).
// Catalog names are never looked for.
std::string measured_model_source(const std::string& model, const std::string& measurement) {
  namespace fs = std::filesystem;
  if (trainmem::is_catalog_name(model)) return model;  // never a folder that shares its name
  std::error_code ec;
  const fs::path p(model);
  if (p.is_absolute() || fs::exists(p, ec)) return model;
  for (fs::path dir = fs::absolute(fs::path(measurement), ec).parent_path(); !ec && !dir.empty();
       dir = dir.parent_path()) {
    if (fs::exists(dir / p, ec)) return (dir / p).string();
    if (dir == dir.root_path()) break;
  }
  return model;
}

// `trainmem compare`: re-estimates the measured model and recipe and reports the differences.
// CPU and fake-tensor measurements sum 512-byte blocks with no cuBLAS workspace, so they are
// compared with `--gpu cpu --allocator expandable`; CUDA measurements with their own recipe.
std::string compare(const std::string& path, bool as_json) {
  // trainmem-measure writes a few kilobytes (a timeline, a few megabytes).
  constexpr std::uintmax_t kMaxMeasuredBytes = 64ull << 20;
  nlohmann::json m = trainmem::detail::parse_input_json(
      trainmem::detail::read_input_file(path, "compare", kMaxMeasuredBytes), "compare: '" + path + "'");
  if (!m.is_object()) throw Error("compare: '" + path + "' is not a JSON object");
  for (const char* key : {"model", "recipe", "peak_allocated_bytes", "breakdown_at_peak", "source"}) {
    if (!m.contains(key)) throw Error(std::string("compare: '") + path + "' has no '" + key + "' (is it trainmem-measure --json output?)");
  }
  if (!m["model"].is_string() || !m["source"].is_string()) throw Error("compare: 'model' and 'source' must be strings");
  if (!m["recipe"].is_object()) throw Error("compare: 'recipe' must be an object of knobs");
  if (!m["peak_allocated_bytes"].is_number_unsigned() || m["peak_allocated_bytes"].get<std::uint64_t>() == 0) {
    throw Error("compare: 'peak_allocated_bytes' must be a positive integer (bytes)");
  }
  if (!m["breakdown_at_peak"].is_object()) throw Error("compare: 'breakdown_at_peak' must be an object of category bytes");
  for (const auto& [name, bytes] : m["breakdown_at_peak"].items()) {
    if (!bytes.is_number_unsigned()) throw Error("compare: breakdown_at_peak." + name + " must be a non-negative integer");
  }
  if (m.contains("peak")) {
    const nlohmann::json& pk = m["peak"];
    if (!pk.is_object() || (pk.contains("phase") && !pk["phase"].is_string()) || (pk.contains("op") && !pk["op"].is_string())) {
      throw Error("compare: 'peak' must be an object whose phase and op are strings");
    }
  }
  const nlohmann::json& jr = m["recipe"];
  std::set<std::string> known{"gpu", "allocator", "lora_targets", "lora_dropout"};  // the knobs read below
  auto text = [&](const char* k, const char* d) {
    known.insert(k);
    if (!jr.contains(k)) return std::string(d);
    if (!jr[k].is_string()) throw Error(std::string("compare: recipe.") + k + " must be a string");
    return jr[k].get<std::string>();
  };
  auto count = [&](const char* k, std::uint64_t d) {
    known.insert(k);
    if (!jr.contains(k)) return d;
    if (!jr[k].is_number_unsigned()) throw Error(std::string("compare: recipe.") + k + " must be a positive integer");
    return jr[k].get<std::uint64_t>();
  };
  const std::string source = m["source"].get<std::string>();
  const bool on_cpu = source != "measured-cuda";
  trainmem::RecipeSpelling sp;
  sp.batch = count("batch", sp.batch);
  sp.seq = count("seq", sp.seq);
  sp.grad_accum = count("grad_accum", sp.grad_accum);
  sp.precision = text("precision", sp.precision.c_str());
  sp.optimizer = text("optimizer", sp.optimizer.c_str());
  sp.checkpointing = text("checkpointing", sp.checkpointing.c_str());
  sp.attention = text("attention", sp.attention.c_str());
  sp.loss = text("loss", sp.loss.c_str());
  sp.attention_mask = text("attention_mask", sp.attention_mask.c_str());
  sp.gpu = on_cpu ? "cpu" : text("gpu", sp.gpu.c_str());
  sp.allocator = on_cpu ? "expandable" : text("allocator", sp.allocator.c_str());
  sp.lora_rank = count("lora_rank", 0);
  sp.mode = text("mode", "training");
  sp.new_tokens = count("new_tokens", sp.new_tokens);
  sp.beams = count("beams", sp.beams);
  sp.gpus = count("gpus", sp.gpus);  // a data-parallel measurement: rank 0 of `gpus`
  sp.parallel = text("parallel", sp.parallel.c_str());
  sp.tp = count("tp", sp.tp);  // a tensor-parallel measurement: rank 0 of `tp`
  sp.pp = count("pp", sp.pp);  // a pipeline measurement: the worst stage of `pp` (its rank is named)
  sp.pp_schedule = text("pp_schedule", sp.pp_schedule.c_str());
  sp.pp_stages_per_rank = count("pp_stages_per_rank", sp.pp_stages_per_rank);
  sp.offload = text("offload", sp.offload.c_str());
  if (jr.contains("lora_targets")) {
    const nlohmann::json& t = jr["lora_targets"];
    if (t.is_string()) {
      sp.lora_targets = t.get<std::string>();
    } else if (t.is_array() && !t.empty()) {
      sp.lora_targets.clear();
      for (const auto& x : t) {
        if (!x.is_string()) throw Error("compare: recipe.lora_targets must be strings");
        sp.lora_targets += (sp.lora_targets.empty() ? "" : ",") + x.get<std::string>();
      }
    } else {
      throw Error("compare: recipe.lora_targets must be a string or a list of module names");
    }
  }
  auto flag = [&](const char* k, bool d) {
    known.insert(k);
    if (!jr.contains(k)) return d;
    if (!jr[k].is_boolean()) throw Error(std::string("compare: recipe.") + k + " must be true or false");
    return jr[k].get<bool>();
  };
  sp.load_in_4bit = flag("load_in_4bit", false);
  sp.fsdp_reshard_after_forward = flag("fsdp_reshard_after_forward", true);
  sp.ddp_find_unused_parameters = flag("ddp_find_unused_parameters", false);
  sp.ddp_gradient_as_bucket_view = flag("ddp_gradient_as_bucket_view", false);
  sp.ddp_no_sync = flag("ddp_no_sync", false);
  sp.fp32_outputs = flag("fp32_outputs", false);
  sp.fsdp_no_sync = flag("fsdp_no_sync", false);
  sp.use_cache = flag("use_cache", false);
  sp.clip_grad_norm = flag("clip_grad_norm", false);
  sp.fsdp_replicate = count("fsdp_replicate", sp.fsdp_replicate);
  sp.fsdp_param_dtype = text("fsdp_param_dtype", sp.fsdp_param_dtype.c_str());
  sp.fsdp_reduce_dtype = text("fsdp_reduce_dtype", sp.fsdp_reduce_dtype.c_str());
  sp.bnb_4bit_quant_type = text("bnb_4bit_quant_type", sp.bnb_4bit_quant_type.c_str());
  sp.bnb_4bit_use_double_quant = flag("bnb_4bit_use_double_quant", false);
  sp.load_dtype = text("load_dtype", sp.load_dtype.c_str());
  sp.bnb_4bit_quant_storage = text("bnb_4bit_quant_storage", sp.bnb_4bit_quant_storage.c_str());
  sp.prepare_kbit_training = flag("prepare_kbit_training", true);
  sp.load_in_8bit = flag("load_in_8bit", false);
  sp.sequence_parallel = flag("sequence_parallel", false);
  sp.loss_parallel = flag("loss_parallel", false);
  if (jr.contains("lora_dropout")) {
    if (!jr["lora_dropout"].is_number()) throw Error("compare: recipe.lora_dropout must be a number");
    sp.lora_dropout = jr["lora_dropout"].get<double>();
  }
  for (const auto& [key, value] : jr.items()) {  // a typo would otherwise compare another recipe
    if (!known.contains(key)) throw Error("compare: recipe." + key + " is not a knob trainmem-measure writes");
  }
  const trainmem::Recipe r = trainmem::parse_recipe(sp);
  const trainmem::Model model = trainmem::load_model(measured_model_source(m["model"].get<std::string>(), path));
  // A data-parallel measurement is one rank's (trainmem-measure writes rank 0, and every rank's
  // peak and breakdown under diagnostics.parallel.ranks): the engine replays that rank.
  const nlohmann::json* parallel = nullptr;
  if (m.contains("diagnostics") && m["diagnostics"].is_object() && m["diagnostics"].contains("parallel") &&
      m["diagnostics"]["parallel"].is_object()) {
    parallel = &m["diagnostics"]["parallel"];
  }
  // A tensor-parallel run has gpus x tp processes; the ranks of a tensor-parallel group hold the
  // same memory (Note [Tensor parallelism] in graph/tensor_parallel.h), so a process is replayed as
  // its data-parallel rank, process / tp.
  // A pipeline run has pp processes, one per stage: a process is replayed as its stage; under PP x
  // DP, gpus x pp processes, process stage x gpus + dp rank, replayed as that rank.
  const std::uint64_t world = r.gpus * r.tp * r.pp;
  auto rank_options = [&](const nlohmann::json& v) {
    if (!v.is_number_unsigned() || v.get<std::uint64_t>() >= world) {
      throw Error("compare: diagnostics.parallel: a rank must be one of 0.." + std::to_string(world - 1));
    }
    trainmem::EstimateOptions o;
    o.rank = static_cast<std::int64_t>(v.get<std::uint64_t>() / r.tp);
    return o;
  };
  // Measurements that record their phases' peaks (`phases`, each rank's too) are compared phase
  // by phase: every (step, micro-batch, phase) the file lists, against the engine's.
  const bool phases = m.contains("phases");  // compare_phases checks that it is a list
  trainmem::EstimateOptions opt;
  opt.rank = 0;  // what trainmem-measure reports, unless the file names its rank
  if (parallel && parallel->contains("rank")) opt = rank_options((*parallel)["rank"]);
  opt.phases = phases;
  const trainmem::Estimate e = trainmem::estimate(model, r, opt);
  std::uint64_t phases_compared = 0, phases_differing = 0;
  auto compare_phases = [&](const nlohmann::json& measured, const trainmem::Estimate& est) {
    std::map<std::tuple<std::uint64_t, std::uint64_t, std::string>, std::uint64_t> predicted;
    for (const auto& p : est.phases) {
      predicted[{p.step, p.micro_batch, std::string(trainmem::phase_name(p.phase))}] = p.peak_allocated_bytes;
    }
    if (!measured.is_array()) throw Error("compare: 'phases' must be a list of phase peaks");
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    auto add_row = [&](std::uint64_t step, std::uint64_t micro, const std::string& phase, const nlohmann::json& mv,
                       const nlohmann::json& pv) {
      rows.push_back({{"step", step}, {"micro_batch", micro}, {"phase", phase}, {"measured", mv}, {"predicted", pv}});
      ++phases_compared;
      if (mv != pv) ++phases_differing;
    };
    for (const auto& mp : measured) {
      if (!mp.is_object() || !mp.contains("step") || !mp["step"].is_number_unsigned() || !mp.contains("phase") ||
          !mp["phase"].is_string() || !mp.contains("peak_allocated_bytes") ||
          !mp["peak_allocated_bytes"].is_number_unsigned() ||
          (mp.contains("micro_batch") && !mp["micro_batch"].is_number_unsigned())) {
        throw Error("compare: a 'phases' entry needs step, micro_batch, phase and peak_allocated_bytes "
                    "(non-negative integers and a phase name)");
      }
      const std::uint64_t step = mp["step"].get<std::uint64_t>();
      const std::uint64_t micro = mp.value("micro_batch", std::uint64_t{0});
      const std::string phase = mp["phase"].get<std::string>();
      auto it = predicted.find({step, micro, phase});
      add_row(step, micro, phase, mp["peak_allocated_bytes"],
              it == predicted.end() ? nlohmann::json() : nlohmann::json(it->second));
      if (it != predicted.end()) predicted.erase(it);
    }
    // What the engine has and the measurement lacks (the tracker starts after the model is loaded:
    // no setup phase, nothing before step 1).
    for (const auto& [key, bytes] : predicted) {
      const auto& [step, micro, phase] = key;
      if (step >= 1 && phase != "setup") add_row(step, micro, phase, nlohmann::json(), bytes);
    }
    return rows;
  };

  const double peak_m = m["peak_allocated_bytes"].get<double>();
  const double err = peak_m > 0 ? (static_cast<double>(e.peak_allocated_bytes) - peak_m) / peak_m * 100 : 0;
  nlohmann::ordered_json j;
  j["model"] = m["model"];
  j["source"] = source;
  j["recipe"] = nlohmann::json::parse(trainmem::report::recipe_json(r));
  j["measured_peak_allocated_bytes"] = m["peak_allocated_bytes"];
  j["predicted_peak_allocated_bytes"] = e.peak_allocated_bytes;
  j["peak_error_pct"] = err;
  j["measured_peak"] = m.value("peak", nlohmann::json::object());
  j["predicted_peak"] = {{"step", e.peak.step}, {"micro_batch", e.peak.micro_batch},
                         {"phase", trainmem::phase_name(e.peak.phase)}, {"op", e.peak.op}};
  nlohmann::ordered_json cats;
  std::string rows;
  char line[200];
  for (std::size_t c = 0; c < trainmem::kCategoryCount; ++c) {
    const std::string name(trainmem::category_name(static_cast<trainmem::Category>(c)));
    const std::uint64_t measured = m["breakdown_at_peak"].value(name, std::uint64_t{0});
    const double share = peak_m > 0 ? (static_cast<double>(e.breakdown_at_peak[c]) - static_cast<double>(measured)) /
                                          peak_m * 100
                                    : 0;
    cats[name] = {{"measured", measured}, {"predicted", e.breakdown_at_peak[c]}, {"diff_pct_of_peak", share}};
    std::snprintf(line, sizeof line, "  %-17s %14llu %14llu %+8.2f%%\n", name.c_str(),
                  static_cast<unsigned long long>(measured), static_cast<unsigned long long>(e.breakdown_at_peak[c]),
                  share);
    rows += line;
  }
  j["categories"] = cats;
  if (phases) j["phases"] = compare_phases(m["phases"], e);
  if (parallel && parallel->contains("ranks") && (*parallel)["ranks"].is_array()) {
    // Every measured rank against the engine's replay of that rank, each engine rank replayed once
    // (the processes of a tensor-parallel group share one).
    std::map<std::int64_t, trainmem::Estimate> replayed{{opt.rank, e}};
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (const auto& mr : (*parallel)["ranks"]) {
      if (!mr.is_object() || !mr.contains("rank") || !mr.contains("peak_allocated_bytes") ||
          !mr["peak_allocated_bytes"].is_number_unsigned()) {
        throw Error("compare: diagnostics.parallel.ranks entries need 'rank' and 'peak_allocated_bytes' (bytes)");
      }
      trainmem::EstimateOptions ro = rank_options(mr["rank"]);
      ro.phases = phases;
      auto it = replayed.find(ro.rank);
      if (it == replayed.end()) it = replayed.emplace(ro.rank, trainmem::estimate(model, r, ro)).first;
      const trainmem::Estimate& er = it->second;
      nlohmann::ordered_json x;
      x["rank"] = mr["rank"];
      x["measured_peak_allocated_bytes"] = mr["peak_allocated_bytes"];
      x["predicted_peak_allocated_bytes"] = er.peak_allocated_bytes;
      nlohmann::ordered_json b;
      for (std::size_t c = 0; c < trainmem::kCategoryCount; ++c) {
        b[std::string(trainmem::category_name(static_cast<trainmem::Category>(c)))] = er.breakdown_at_peak[c];
      }
      x["predicted_breakdown_at_peak"] = b;
      if (mr.contains("breakdown_at_peak")) x["measured_breakdown_at_peak"] = mr["breakdown_at_peak"];
      if (phases && mr.contains("phases")) x["phases"] = compare_phases(mr["phases"], er);
      ranks.push_back(x);
    }
    j["ranks"] = ranks;
  }
  if (as_json) return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::string out = m["model"].get<std::string>() + " (" + source + ")\n";
  std::snprintf(line, sizeof line, "  %-17s %14s %14s %9s\n", "", "measured", "predicted", "diff");
  out += line;
  std::snprintf(line, sizeof line, "  %-17s %14llu %14llu %+8.2f%%\n", "peak allocated",
                static_cast<unsigned long long>(m["peak_allocated_bytes"].get<std::uint64_t>()),
                static_cast<unsigned long long>(e.peak_allocated_bytes), err);
  out += line + rows;
  out += "  measured peak at:  " + j["measured_peak"].value("phase", std::string("?")) + ", " +
         j["measured_peak"].value("op", std::string("?")) + "\n";
  out += "  predicted peak at: " + std::string(trainmem::phase_name(e.peak.phase)) + ", " + e.peak.op + "\n";
  if (phases_compared > 0) {
    out += "  phase peaks:       " + std::to_string(phases_compared) + " compared, " +
           std::to_string(phases_differing) + " differ" + (phases_differing ? " (see --json)" : "") + "\n";
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainmem: GPU memory of a training step, simulated op by op.\n"
               "Peak allocated/reserved bytes per GPU, broken down into weights, optimizer states,\n"
               "gradients, activations, temporaries and other, with the op where the peak happens."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("trainmem 0.1.0"));

  auto* est = app.add_subcommand("estimate", "Peak memory of one training step for a model and a recipe");
  std::string model;
  RecipeFlags flags;
  bool as_json = false, timeline = false, phases = false;
  std::string trace_path, rank = "worst";
  est->add_option("model", model,
                  "Catalog name (qwen3-4b), Hugging Face id (Qwen/Qwen3-4B), config.json path or model directory")
      ->required();
  flags.add_to(est, false);
  est->add_flag("--json", as_json, "Print the JSON object of docs/schema.md");
  bool est_exit_code = false;
  est->add_flag("--exit-code", est_exit_code,
                "Exit with 1 when the estimate does not fit the GPU (peak reserved plus the CUDA context), 0 when it does");
  est->add_flag("--timeline", timeline, "Include an allocated/reserved timeline in --json");
  est->add_flag("--phases", phases, "Include the peaks of each phase of every micro-batch in --json");
  est->add_option("--trace", trace_path, "Write every simulated alloc/free event to FILE as JSON lines");
  est->add_option("--rank", rank,
                  "With --gpus N: the rank to report, 0..N-1 (with --pp P: 0..N x P - 1, stage x N + dp rank), or "
                  "'worst' (the rank that needs the most memory)")
      ->capture_default_str();

  auto* fitc = app.add_subcommand(
      "fit", "Recipes that fit a GPU, fastest first, and what single changes of your recipe save;\n"
             "when nothing fits, what it takes (a larger GPU, adapters instead of full fine-tuning)");
  std::string fit_model, fit_global, fit_top = "10", fit_host = std::to_string(trainmem::kDefaultHostMemoryBytes >> 30);
  RecipeFlags fit_flags;
  bool fit_json = false;
  fitc->add_option("model", fit_model, "Catalog name, Hugging Face id, config.json path or model directory")->required();
  fit_flags.add_to(fitc, true);
  // What the planner picks itself, or does not plan: parsed (so that fit says why it refuses them)
  // but left out of fit's help.
  for (const auto& [knob, option] : fit_flags.options) {
    if (knob == "pp" || knob == "cp" || knob == "pp_schedule" || knob == "pp_stages_per_rank" || knob == "mode" ||
        knob == "new_tokens" || knob == "beams" || knob == "load_in_8bit") {
      option->group("");
    }
  }
  fitc->add_option("--global-batch", fit_global,
                   "Sequences per optimizer step over all GPUs (default: batch x grad-accum x gpus)");
  fitc->add_option("--top", fit_top, "How many fitting recipes to list")->capture_default_str();
  fitc->add_option("--host-memory", fit_host,
                   "Host RAM in GiB each GPU's rank may use under CPU offload (a node's RAM over its GPUs)")
      ->capture_default_str();
  fitc->add_flag("--json", fit_json,
                 "Print capacity_bytes, plans, baseline, changes, closest_miss, fits_on and adapter_plans as JSON");
  bool fit_exit_code = false;
  fitc->add_flag("--exit-code", fit_exit_code, "Exit with 1 when no recipe fits, 0 when one does");
  fitc->footer(
      "Knobs the planner searches that you pass (--batch, --precision, --optimizer, --checkpointing,\n"
      "--attention, --loss, --allocator, --parallel, --offload, --tp) are held; the others are searched.\n"
      "Your recipe is also replayed as given, with each single change.");

  auto* cmp = app.add_subcommand("compare", "Compare a trainmem-measure JSON with the engine's prediction for it");
  std::string measured_path;
  bool cmp_json = false;
  cmp->add_option("measured", measured_path, "JSON written by trainmem-measure --json")->required();
  cmp->add_flag("--json", cmp_json, "Print the comparison as JSON");

  auto* models = app.add_subcommand("models", "List the built-in model catalog");
  bool models_json = false;
  models->add_flag("--json", models_json, "Print as JSON");
  auto* gpus = app.add_subcommand("gpus", "List the built-in GPU catalog");
  bool gpus_json = false;
  gpus->add_flag("--json", gpus_json, "Print as JSON");

  if (argc > 1 && argv[1][0] != '-') {
    std::string cmd = argv[1];
    if (cmd != "estimate" && cmd != "fit" && cmd != "compare" && cmd != "models" && cmd != "gpus") {
      return fail("unknown command '" + cmd + "'; expected estimate, fit, compare, models or gpus (see --help)");
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return fail(msg + " (see --help)");
  }

  try {
    std::string out;
    int rc = 0;  // 1: --exit-code and it does not fit
    if (*est) {
      trainmem::Recipe r = trainmem::parse_recipe(flags.spelling());
      trainmem::Model m = trainmem::load_model(model);
      if (!flags.was_given("seq")) r.seq = trainmem::default_seq(m, r);
      trainmem::EstimateOptions opt;
      if (timeline && !as_json) throw Error("timeline: the timeline is part of the JSON output; add --json");
      if (phases && !as_json) throw Error("phases: the phase peaks are part of the JSON output; add --json");
      opt.timeline = timeline;
      opt.phases = phases;
      if (est->count("--trace") > 0 && trace_path.empty()) throw Error("trace: needs a file name");
      opt.trace_path = trace_path;
      if (rank != "worst") {
        const std::uint64_t n = parse_count(rank, "rank (a rank number or 'worst')", /*zero_ok=*/true);
        const std::uint64_t ranks = r.gpus * r.pp;
        if (n >= ranks) {
          throw Error("rank: " + rank + " is not one of the " + std::to_string(ranks) + " ranks (0.." +
                      std::to_string(ranks - 1) + ") of " +
                      (r.pp > 1 && r.gpus > 1 ? "--pp " + std::to_string(r.pp) + " x --gpus " + std::to_string(r.gpus)
                       : r.pp > 1             ? "--pp " + std::to_string(r.pp)
                                              : "--gpus " + std::to_string(r.gpus)));
        }
        opt.rank = static_cast<std::int64_t>(n);
      }
      trainmem::Estimate e = trainmem::estimate(m, r, opt);
      out = as_json ? trainmem::report::to_json(e) + "\n" : trainmem::report::to_text(e);
      if (est_exit_code && !trainmem::report::fits_gpu(e)) rc = 1;
    } else if (*fitc) {
      trainmem::FitRequest q;
      trainmem::RecipeSpelling sp = fit_flags.spelling();
      q.gpus = sp.gpus;
      if (sp.parallel == "none") sp.gpus = 1;  // the planner decides how the GPUs are used
      q.base = trainmem::parse_fit_recipe(sp);
      if (fitc->get_option("--global-batch")->count() > 0) {  // unset: batch x grad-accum x gpus
        if (fit_flags.was_given("grad_accum")) {
          throw Error("grad_accum: with --global-batch the planner chooses the accumulation; give --global-batch or "
                      "--grad-accum (with --batch and --gpus), not both");
        }
        q.global_batch = parse_count(fit_global, "global_batch");
        if (q.global_batch == 0) throw Error("global_batch: must be at least 1 sequence per optimizer step, got 0");
      }
      q.top = parse_count(fit_top, "top");
      q.host_memory_bytes = host_memory_bytes(fit_host);
      for (const std::string& k : fit_flags.given()) {
        const auto& knobs = trainmem::fit_knobs();
        if (std::find(knobs.begin(), knobs.end(), k) != knobs.end()) q.fixed.push_back(k);
      }
      const trainmem::Model m = trainmem::load_model(fit_model);
      if (!fit_flags.was_given("seq")) q.base.seq = trainmem::default_seq(m, q.base);
      const trainmem::FitResult f = trainmem::fit(m, q);
      out = fit_json ? trainmem::report::fit_to_json(m.name, f) + "\n" : trainmem::report::fit_to_text(m.name, f);
      if (fit_exit_code && f.plans.empty()) rc = 1;
    } else if (*cmp) {
      out = compare(measured_path, cmp_json);
    } else if (*models) {
      auto cat = trainmem::catalog();
      if (models_json) {
        std::string j = "[\n";
        for (std::size_t i = 0; i < cat.size(); ++i) {
          j += "  {\"name\": \"" + cat[i].name + "\", \"hf_id\": \"" + cat[i].hf_id + "\", \"family\": \"" +
               cat[i].family + "\", \"parameters\": " + std::to_string(cat[i].parameter_count) + "}" +
               (i + 1 < cat.size() ? ",\n" : "\n");
        }
        out = j + "]\n";
      } else {
        char line[200];
        std::snprintf(line, sizeof line, "%-24s %-36s %-8s %16s\n", "name", "hugging face id", "family", "parameters");
        out += line;
        for (const auto& c : cat) {
          std::snprintf(line, sizeof line, "%-24s %-36s %-8s %16llu\n", c.name.c_str(), c.hf_id.c_str(),
                        c.family.c_str(), static_cast<unsigned long long>(c.parameter_count));
          out += line;
        }
      }
    } else if (*gpus) {
      auto list = trainmem::gpus();
      if (gpus_json) {
        nlohmann::ordered_json j = nlohmann::ordered_json::array();
        for (const auto& g : list) {
          j.push_back({{"name", g.name},
                       {"description", g.description},
                       {"capacity_bytes", g.capacity_bytes},
                       {"context_bytes", g.context_bytes},
                       {"usable_bytes", g.usable_bytes()},
                       {"cublas_workspace_bytes", g.cublas_workspace_bytes},
                       {"half_tflops", g.half_tflops},
                       {"bf16", g.bf16},
                       {"sm", g.sm},
                       {"fp32_tflops", g.fp32_tflops},
                       {"memory_gbps", g.memory_gbps},
                       {"interconnect", g.interconnect},
                       {"interconnect_gbps", g.interconnect_gbps},
                       {"host_gbps", g.host_gbps}});
        }
        out = j.dump(2) + "\n";
      } else {
        char line[300];
        std::snprintf(line, sizeof line, "%-11s %9s %9s %10s %8s %8s  %-9s %s\n", "name", "memory", "usable",
                      "half TF/s", "fp32", "mem GB/s", "link", "description");
        out += line;
        for (const auto& g : list) {
          if (g.capacity_bytes == 0) {
            std::snprintf(line, sizeof line, "%-11s %9s %9s %10s %8s %8s  %-9s %s\n", g.name.c_str(), "-", "-", "-", "-",
                          "-", "-", g.description.c_str());
          } else {
            std::snprintf(line, sizeof line, "%-11s %5.1f GiB %5.1f GiB %10.0f %8.1f %8.0f  %-9s %s\n", g.name.c_str(),
                          static_cast<double>(g.capacity_bytes) / (1ull << 30),
                          static_cast<double>(g.usable_bytes()) / (1ull << 30), g.half_tflops, g.fp32_tflops,
                          g.memory_gbps, g.interconnect.c_str(), g.description.c_str());
          }
          out += line;
        }
      }
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    return rc;
  } catch (const Error& e) {
    return fail(e.what());
  } catch (const std::overflow_error& e) {
    return fail(e.what());
  } catch (const std::bad_alloc&) {
    return fail("this machine ran out of memory while simulating the step; use smaller sizes");
  } catch (const std::exception& e) {
    // Not bad input and not a known limit: still one line and exit 2, never a crash dump.
    return fail(std::string("unexpected failure (please report it): ") + e.what());
  }
}
