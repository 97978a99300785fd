#include "report/report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/checked.h"

namespace trainmem::report {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// The batch's attention_mask, where it has one (", attention_mask padded").
std::string mask_words(const Recipe& r) {
  if (r.attention_mask == AttentionMask::kNone) return "";
  return ", attention_mask " + std::string(to_string(r.attention_mask));
}

// printf into the end of `out`, however long the line (a model's path, a pipeline's header).
template <typename... A>
void appendf(std::string& out, const char* fmt, A... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  if (n <= 0) return;
  const std::size_t at = out.size();
  out.resize(at + static_cast<std::size_t>(n) + 1);
  std::snprintf(out.data() + at, static_cast<std::size_t>(n) + 1, fmt, args...);
  out.resize(at + static_cast<std::size_t>(n));
}

ordered_json recipe_object(const Recipe& r) {
  ordered_json j;
  j["batch"] = r.batch;
  j["seq"] = r.seq;
  j["grad_accum"] = r.grad_accum;
  j["precision"] = to_string(r.precision);
  j["optimizer"] = to_string(r.optimizer);
  j["checkpointing"] = to_string(r.checkpointing);
  j["attention"] = to_string(r.attention);
  j["loss"] = to_string(r.loss);
  // Only when the batch has one, as trainmem-measure writes it.
  if (r.attention_mask != AttentionMask::kNone) j["attention_mask"] = to_string(r.attention_mask);
  j["gpu"] = r.gpu;
  j["allocator"] = to_string(r.allocator);
  if (r.lora.enabled()) {
    j["lora_rank"] = r.lora.rank;
    j["lora_targets"] = r.lora.targets;
    j["lora_dropout"] = r.lora.dropout;
  } else {
    j["lora_rank"] = 0;
  }
  if (r.quant.enabled()) {  // only for a 4-bit base, as trainmem-measure writes them
    j["load_in_4bit"] = true;
    j["bnb_4bit_quant_type"] = to_string(r.quant.quant_type);
    j["bnb_4bit_use_double_quant"] = r.quant.double_quant;
    if (r.quant.storage != QuantStorage::kUint8) j["bnb_4bit_quant_storage"] = to_string(r.quant.storage);
    if (!r.quant.prepare_kbit_training) j["prepare_kbit_training"] = false;
  }
  // Only when not the precision's, as trainmem-measure writes it (a 4-bit base's or a LoRA model's).
  if (r.load_dtype != LoadDtype::kAuto) j["load_dtype"] = to_string(r.load_dtype);
  if (r.quant.load_in_8bit) j["load_in_8bit"] = true;  // only for 8-bit weights, as trainmem-measure writes it
  j["mode"] = to_string(r.mode);
  if (r.parallel != Parallel::kNone) {  // as trainmem-measure writes them: only when data-parallel
    j["gpus"] = r.gpus;
    j["parallel"] = to_string(r.parallel);
  }
  if (r.tp > 1) j["tp"] = r.tp;  // as trainmem-measure writes it: only with tensor parallelism
  if (r.sequence_parallel) j["sequence_parallel"] = true;  // and sequence parallelism only when on
  if (r.loss_parallel) j["loss_parallel"] = true;          // and loss parallelism only when on
  if (r.cp > 1) j["cp"] = r.cp;  // and context parallelism only with it
  if (r.pp > 1) {                 // and the pipeline's degree and schedule only with a pipeline
    j["pp"] = r.pp;
    j["pp_schedule"] = to_string(r.pp_schedule);
    if (r.pp_stages_per_rank > 1) j["pp_stages_per_rank"] = r.pp_stages_per_rank;  // multi-stage only
  }
  if (r.parallel == Parallel::kFsdp) {  // FSDP2's knobs, with parallel fsdp only (as trainmem-measure)
    j["fsdp_reshard_after_forward"] = r.fsdp.reshard_after_forward;
    j["fsdp_replicate"] = r.fsdp.replicate;
    j["fsdp_param_dtype"] = to_string(r.fsdp.param_dtype);
    j["fsdp_reduce_dtype"] = to_string(r.fsdp.reduce_dtype);
    if (r.fsdp.no_sync) j["fsdp_no_sync"] = true;  // only when on, as trainmem-measure writes it
  }
  if (r.ddp_find_unused_parameters) j["ddp_find_unused_parameters"] = true;  // only when on (as trainmem-measure)
  if (r.ddp_gradient_as_bucket_view) j["ddp_gradient_as_bucket_view"] = true;
  if (r.ddp_no_sync) j["ddp_no_sync"] = true;
  if (r.fp32_outputs) j["fp32_outputs"] = true;
  if (r.use_cache) j["use_cache"] = true;
  if (r.clip_grad_norm) j["clip_grad_norm"] = true;
  if (r.offload != Offload::kNone) j["offload"] = to_string(r.offload);  // only when offloading
  if (r.mode == Mode::kInference) {
    j["new_tokens"] = r.new_tokens;
    j["beams"] = r.beams;
  } else {
    j["steps"] = r.steps;
  }
  return j;
}

ordered_json moment_object(const Moment& m) {
  ordered_json j;
  j["step"] = m.step;
  j["micro_batch"] = m.micro_batch;
  j["phase"] = phase_name(m.phase);
  j["op"] = m.op;
  return j;
}

ordered_json time_object(const StepTime& t) {
  ordered_json j;
  j["compute_s"] = t.compute_s;
  j["memory_s"] = t.memory_s;
  j["overhead_s"] = t.overhead_s;
  j["comm_s"] = t.comm_s;
  j["host_s"] = t.host_s;
  j["flops"] = t.flops;
  return j;
}

ordered_json plan_object(const Plan& p) {
  ordered_json j;
  j["recipe"] = recipe_object(p.recipe);
  j["peak_allocated_bytes"] = p.peak_allocated_bytes;
  j["peak_reserved_bytes"] = p.peak_reserved_bytes;
  j["step_time_s"] = p.time.seconds;
  j["time"] = time_object(p.time);
  if (p.recipe.offload != Offload::kNone) j["host_bytes"] = p.host_bytes;  // See Note [Host memory in the planner]
  j["fits"] = p.fits;
  if (p.simulated) j["peak"] = moment_object(p.peak);
  else j["lower_bound"] = true;  // peak_* are the floor (weights, gradients, states), not a replay
  return j;
}

// Column "parallel" of a table row: the data-parallel wrapper (with its CPU offload), or the
// tensor-, pipeline- or context-parallel degree; empty for one plain GPU.
std::string parallel_label(const Recipe& r) {
  if (r.parallel == Parallel::kNone && r.tp == 1 && r.pp == 1 && r.cp == 1) return "";
  std::string dp(to_string(r.parallel));
  if (r.offload != Offload::kNone) dp += "+offload";
  if (r.tp > 1) {
    dp = (r.parallel != Parallel::kNone ? dp + "+" : std::string()) + "tp" + std::to_string(r.tp) +
         (r.sequence_parallel ? "+sp" : "") + (r.loss_parallel ? "+lp" : "");
  }
  if (r.pp > 1) {
    dp = "pp" + std::to_string(r.pp) + (r.pp_stages_per_rank > 1 ? "v" + std::to_string(r.pp_stages_per_rank) : "") +
         (r.pp_schedule == PipelineSchedule::kGPipe             ? "+gpipe"
          : r.pp_schedule == PipelineSchedule::kInterleaved1F1B ? "+int"
          : r.pp_schedule == PipelineSchedule::kLoopedBFS       ? "+bfs"
                                                                : "") +
         (r.parallel != Parallel::kNone || r.tp > 1 ? "+" + dp : std::string());  // PP x DP: pp2+ddp; PP x TP: pp2+tp2
  }
  if (r.cp > 1) dp = "cp" + std::to_string(r.cp) + (r.parallel == Parallel::kFsdp ? "+fsdp" : "");  // CP x FSDP2
  return dp;
}

// The parallel column's width for these recipes: its header or the longest label, 0 when no
// recipe has one (no column).
template <typename Range, typename RecipeOf>
std::size_t parallel_width(const Range& rows, RecipeOf recipe_of) {
  std::size_t longest = 0;
  for (const auto& row : rows) longest = std::max(longest, parallel_label(recipe_of(row)).size());
  return longest ? std::max(longest, std::string_view("parallel").size()) : 0;
}

// "bf16-true adamw-fused ckpt=none loss=fused" and the micro-batch shape, for one table row;
// the parallel column `width` wide (0: a lone recipe's label, unpadded, where it has one).
std::string recipe_words(const Recipe& r, std::size_t width = 0) {
  char buf[200];
  // A precision marked '*': the model loaded half under that autocast (load_dtype; the table's legend).
  const std::string precision = std::string(to_string(r.precision)) + (r.load_dtype != LoadDtype::kAuto ? "*" : "");
  std::snprintf(buf, sizeof buf, "%4llu x %-4llu %-11s %-11s %-4s %-8s %-10s", static_cast<unsigned long long>(r.batch),
                static_cast<unsigned long long>(r.grad_accum), precision.c_str(),
                std::string(to_string(r.optimizer)).c_str(), std::string(to_string(r.checkpointing)).c_str(),
                std::string(to_string(r.loss)).c_str(), std::string(to_string(r.allocator)).c_str());
  std::string words = buf;
  const std::string dp = parallel_label(r);
  if (!dp.empty() || width > 0) words += " " + dp + std::string(width > dp.size() ? width - dp.size() : 0, ' ');
  return words;
}

// Why the estimate shows this rank (Note [The worst rank] in src/estimate.cpp).
std::string rank_words(const Estimate& e) {
  if (e.ranks.size() <= 1) {
    if (is_zero(e.recipe.parallel) && e.recipe.parallel != Parallel::kZero3) return " (as asked; ranks differ under ZeRO)";
    if (e.recipe.pp > 1) return " (as asked; pipeline stages differ)";
    return " (every rank runs the same ops on tensors of the same sizes)";
  }
  std::uint64_t least = e.ranks.front().peak_reserved_bytes;
  for (const RankPeak& p : e.ranks) least = std::min(least, p.peak_reserved_bytes);
  return " (the worst of " + std::to_string(e.ranks.size()) + " ranks replayed; the least needs " +
         detail::format_bytes(least) + " reserved)";
}

// How a tensor-parallel group splits the step: " with sequence and loss parallel" and the like.
std::string tp_style_words(const Recipe& r) {
  if (!r.sequence_parallel && !r.loss_parallel) return "";
  if (r.sequence_parallel && r.loss_parallel) return " with sequence and loss parallel";
  return r.sequence_parallel ? " with sequence parallel" : " with loss parallel";
}

// "rank N (why that one)" after "the figures below are one GPU's, ". Under context parallelism
// the engine builds the ring's last rank, taken as the worst (Note [Context parallelism] in
// graph/context_parallel.h); the others are not replayed.
std::string whose_figures(const Estimate& e) {
  const Recipe& r = e.recipe;
  if (r.cp > 1) {
    const std::string dp = r.parallel != Parallel::kNone ? " of data-parallel rank " + std::to_string(e.rank) : "";
    return "the last rank of the ring" + dp + " (taken as the worst: its merges hold the most; the other ranks "
           "are not replayed)";
  }
  return "rank " + std::to_string(e.rank) + rank_words(e);
}

std::string signed_bytes(std::int64_t d) {
  const std::string mag = detail::format_bytes(static_cast<std::uint64_t>(d < 0 ? -d : d));
  return (d < 0 ? "-" : "+") + mag;
}

}  // namespace

std::string fit_to_json(const std::string& model, const FitResult& f, bool pretty) {
  ordered_json j;
  j["model"] = model;
  j["device"] = {{"name", f.gpu.name},
                 {"capacity_bytes", f.gpu.capacity_bytes},
                 {"context_bytes", f.gpu.context_bytes}};
  j["gpus"] = f.gpus;
  j["global_batch"] = f.global_batch;
  j["capacity_bytes"] = f.capacity_bytes;
  j["host_capacity_bytes"] = f.host_capacity_bytes;
  j["searched"] = f.searched;
  j["simulated"] = f.simulated;
  j["pruned"] = f.pruned;
  ordered_json plans = ordered_json::array();
  for (const Plan& p : f.plans) plans.push_back(plan_object(p));
  j["plans"] = plans;
  j["baseline"] = plan_object(f.baseline);
  j["baseline_moved"] = f.baseline_moved;
  j["batch_grown"] = f.batch_grown;
  ordered_json changes = ordered_json::array();
  for (const Change& c : f.changes) {
    ordered_json x = plan_object(c.plan);
    x["change"] = c.what;
    x["saves_bytes"] = static_cast<std::int64_t>(f.baseline.peak_reserved_bytes) -
                       static_cast<std::int64_t>(c.plan.peak_reserved_bytes);
    changes.push_back(x);
  }
  j["changes"] = changes;
  if (f.has_closest_miss) {
    ordered_json m = plan_object(f.closest_miss);
    m["lacks_bytes"] = f.closest_miss.peak_reserved_bytes > f.capacity_bytes
                           ? f.closest_miss.peak_reserved_bytes - f.capacity_bytes : 0;
    if (f.closest_miss.host_bytes > f.host_capacity_bytes) {
      m["lacks_host_bytes"] = f.closest_miss.host_bytes - f.host_capacity_bytes;
    }
    j["closest_miss"] = m;
  } else {
    j["closest_miss"] = nullptr;
  }
  ordered_json on = ordered_json::array();
  for (const auto& o : f.fits_on) {
    ordered_json x = plan_object(o.plan);
    x["gpu"] = o.gpu;
    on.push_back(x);
  }
  j["fits_on"] = on;
  ordered_json adapters = ordered_json::array();
  for (const Plan& p : f.adapter_plans) adapters.push_back(plan_object(p));
  j["adapter_plans"] = adapters;
  j["source"] = "engine";
  return pretty ? j.dump(2, ' ', false, ordered_json::error_handler_t::replace)
                : j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

std::string fit_to_text(const std::string& model, const FitResult& f) {
  std::string out;
  auto add = [&](const char* fmt, auto... args) { appendf(out, fmt, args...); };
  const Recipe& b = f.baseline.recipe;
  add("%s on %llu x %s: %s usable per GPU (%s less the CUDA context)\n", model.c_str(),
      static_cast<unsigned long long>(f.gpus), f.gpu.name.c_str(), detail::format_bytes(f.capacity_bytes).c_str(),
      detail::format_bytes(f.gpu.capacity_bytes).c_str());
  add("seq %llu, global batch %llu sequences per optimizer step%s\n", static_cast<unsigned long long>(b.seq),
      static_cast<unsigned long long>(f.global_batch), mask_words(b).c_str());
  add("searched %llu recipes fastest first, %llu of them ruled out by their floor (weights, gradients, states);\n"
      "%llu recipes replayed or probed in all (your recipe, its single changes and other GPUs included)\n\n",
      static_cast<unsigned long long>(f.searched), static_cast<unsigned long long>(f.pruned),
      static_cast<unsigned long long>(f.simulated));
  if (!f.plans.empty()) {
    // A host column where a plan offloads (See Note [Host memory in the planner]).
    const bool host = std::any_of(f.plans.begin(), f.plans.end(),
                                  [](const Plan& p) { return p.recipe.offload != Offload::kNone; });
    // recipe_words adds the parallel column wherever a plan has one (one GPU under ZeRO too).
    const std::size_t width = parallel_width(f.plans, [](const Plan& p) -> const Recipe& { return p.recipe; });
    const std::string parallel_header = width ? " parallel" + std::string(width - 8, ' ') : "";
    add("%3s %-11s %-11s %-11s %-4s %-8s %-10s%s %12s %12s %10s%s\n", "#", "batch x acc", "precision", "optimizer",
        "ckpt", "loss", "allocator", parallel_header.c_str(), "reserved", "allocated", "step time",
        host ? "         host" : "");
    for (std::size_t i = 0; i < f.plans.size(); ++i) {
      const Plan& p = f.plans[i];
      char h[32] = "";
      if (host) {
        std::snprintf(h, sizeof h, " %12s",
                      p.recipe.offload == Offload::kNone ? "-" : detail::format_bytes(p.host_bytes).c_str());
      }
      add("%3zu %s %12s %12s %9.3gs%s\n", i + 1, recipe_words(p.recipe, width).c_str(),
          detail::format_bytes(p.peak_reserved_bytes).c_str(), detail::format_bytes(p.peak_allocated_bytes).c_str(),
          p.time.seconds, h);
    }
    if (host) {
      add("host: host memory of one rank under CPU offload, within the %s allowed per GPU (--host-memory)\n",
          detail::format_bytes(f.host_capacity_bytes).c_str());
    }
    if (std::any_of(f.plans.begin(), f.plans.end(), [](const Plan& p) { return p.recipe.load_dtype != LoadDtype::kAuto; })) {
      add("*: the model loaded in the autocast's half dtype (load_dtype), not fp32\n");
    }
    if (std::any_of(f.plans.begin(), f.plans.end(), [](const Plan& p) { return p.recipe.cp > 1; })) {
      add("cp: context parallelism (ring attention) is mirrored from torch's source, not measured "
          "(docs/parallelism.md)\n");
    }
  } else {
    add("nothing fits.\n");
    if (f.has_closest_miss) {
      const Plan& m = f.closest_miss;
      if (m.peak_reserved_bytes > f.capacity_bytes || !m.complete) {
        add("closest: %s\n  %s%s reserved, %s more than the GPU offers\n", recipe_words(m.recipe).c_str(),
            m.simulated ? "" : "at least ", detail::format_bytes(m.peak_reserved_bytes).c_str(),
            detail::format_bytes(m.peak_reserved_bytes - std::min(m.peak_reserved_bytes, f.capacity_bytes)).c_str());
      } else {
        add("closest: %s\n  %s reserved, within the GPU\n", recipe_words(m.recipe).c_str(),
            detail::format_bytes(m.peak_reserved_bytes).c_str());
      }
      if (m.host_bytes > f.host_capacity_bytes) {  // See Note [Host memory in the planner]
        add("  host memory %s per rank, more than the %s allowed (--host-memory)\n",
            detail::format_bytes(m.host_bytes).c_str(), detail::format_bytes(f.host_capacity_bytes).c_str());
      }
    }
    if (!f.fits_on.empty()) {
      add("\nwhat it takes: a GPU with more memory (the fastest recipe that fits there):\n");
      const std::size_t width = parallel_width(f.fits_on, [](const auto& o) -> const Recipe& { return o.plan.recipe; });
      for (const auto& o : f.fits_on) {
        add("  %-11s %s %12s %9.3gs\n", o.gpu.c_str(), recipe_words(o.plan.recipe, width).c_str(),
            detail::format_bytes(o.plan.peak_reserved_bytes).c_str(), o.plan.time.seconds);
      }
    } else if (f.has_closest_miss && f.closest_miss.host_bytes > f.host_capacity_bytes &&
               f.closest_miss.peak_reserved_bytes <= f.capacity_bytes) {
      add("\nwhat it takes: more host memory per GPU (--host-memory), or more GPUs to share the offloaded\n"
          "states (--gpus N: each rank holds its partition's).\n");
    } else {
      add("no larger GPU of the catalog fits even the search's lowest-memory recipes (smallest micro-batch,\n"
          "checkpointing, fused loss; or smallest floor); more GPUs that share the model (--gpus N: FSDP2,\n"
          "ZeRO-3, tensor or pipeline parallelism) may.\n");
    }
    if (!f.adapter_plans.empty()) {  // See Note [The adapter route] in plan/fit.cpp
      const Recipe& a = f.adapter_plans.front().recipe;
      add("\nor train adapters instead of every weight (a different training run; --lora %llu%s plans it):\n"
          "%s rank %llu on peft's default targets fits (reserved, allocated, step time%s):\n",
          static_cast<unsigned long long>(a.lora.rank), a.quant.enabled() ? " --qlora" : "",
          a.quant.enabled() ? "QLoRA (an nf4 base with double quant)" : "LoRA", static_cast<unsigned long long>(a.lora.rank),
          std::any_of(f.adapter_plans.begin(), f.adapter_plans.end(),
                      [](const Plan& p) { return p.recipe.offload != Offload::kNone; })
              ? ", host memory per rank"
              : "");
      const std::size_t width = parallel_width(f.adapter_plans, [](const Plan& p) -> const Recipe& { return p.recipe; });
      for (const Plan& p : f.adapter_plans) {
        add("    %s %12s %12s %9.3gs%s\n", recipe_words(p.recipe, width).c_str(),
            detail::format_bytes(p.peak_reserved_bytes).c_str(), detail::format_bytes(p.peak_allocated_bytes).c_str(),
            p.time.seconds,
            p.recipe.offload == Offload::kNone ? "" : ("  " + detail::format_bytes(p.host_bytes)).c_str());
      }
    }
  }
  add("\nyour recipe: %s\n", recipe_words(b).c_str());
  if (f.batch_grown) {
    add("  (micro-batch %llu: the smallest that reaches the global batch in at most %llu micro-batches; --batch "
        "holds one)\n",
        static_cast<unsigned long long>(b.batch), static_cast<unsigned long long>(kMaxAccum));
  }
  if (f.baseline_moved) {
    add("  (%llu sequences do not split over %llu data-parallel GPUs: your recipe as %s over all of them)\n",
        static_cast<unsigned long long>(f.global_batch), static_cast<unsigned long long>(f.gpus),
        b.pp > 1 ? "a pipeline" : "one tensor-parallel group");
  }
  if (f.baseline.fits) {
    add("  fits: %s reserved, %s to spare; step time %.3gs\n", detail::format_bytes(f.baseline.peak_reserved_bytes).c_str(),
        detail::format_bytes(f.capacity_bytes - f.baseline.peak_reserved_bytes).c_str(), f.baseline.time.seconds);
  } else if (f.baseline.peak_reserved_bytes <= f.capacity_bytes && f.baseline.complete) {  // the host is short
    add("  does not fit: %s reserved on the GPU, but %s of host memory per rank, more than the %s allowed "
        "(--host-memory); step time %.3gs\n",
        detail::format_bytes(f.baseline.peak_reserved_bytes).c_str(), detail::format_bytes(f.baseline.host_bytes).c_str(),
        detail::format_bytes(f.host_capacity_bytes).c_str(), f.baseline.time.seconds);
  } else {
    add("  does not fit: %s reserved, %s too much; step time %.3gs\n",
        detail::format_bytes(f.baseline.peak_reserved_bytes).c_str(),
        detail::format_bytes(f.baseline.peak_reserved_bytes - f.capacity_bytes).c_str(), f.baseline.time.seconds);
  }
  if (f.baseline.recipe.offload != Offload::kNone && f.baseline.fits) {
    add("  host memory of one rank %s (of the %s allowed per GPU)\n", detail::format_bytes(f.baseline.host_bytes).c_str(),
        detail::format_bytes(f.host_capacity_bytes).c_str());
  }
  if (!f.changes.empty()) {
    add("\nsingle changes of your recipe (peak reserved, change, step time):\n");
    for (const Change& c : f.changes) {
      const std::int64_t d = static_cast<std::int64_t>(c.plan.peak_reserved_bytes) -
                             static_cast<std::int64_t>(f.baseline.peak_reserved_bytes);
      const double dt = f.baseline.time.seconds > 0 ? (c.plan.time.seconds / f.baseline.time.seconds - 1) * 100 : 0;
      add("  %-48s %12s %13s %9.3gs (%+.0f%%)%s\n", c.what.c_str(), detail::format_bytes(c.plan.peak_reserved_bytes).c_str(),
          signed_bytes(d).c_str(), c.plan.time.seconds, dt, c.plan.fits ? "" : "  does not fit");
    }
  }
  add("\nstep times come from the model of docs/planner.md (FLOPs at %s's data-sheet peak, an assumed efficiency);\n"
      "memory figures are engine replays, held to peak reserved <= usable memory (and, under CPU offload,\n"
      "host bytes <= --host-memory).\n", f.gpu.name.c_str());
  return out;
}

bool fits_gpu(const Estimate& e) { return e.gpu.capacity_bytes == 0 || e.peak_reserved_bytes <= e.gpu.usable_bytes(); }

std::string recipe_json(const Recipe& r) {
  return recipe_object(r).dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

std::string to_json(const Estimate& e, bool pretty) {
  ordered_json j;
  j["model"] = e.model;
  j["parameters"] = e.parameters;
  j["trainable_parameters"] = e.trainable_parameters;
  j["peak_allocated_bytes"] = e.peak_allocated_bytes;
  j["peak_reserved_bytes"] = e.peak_reserved_bytes;
  ordered_json b;
  for (std::size_t c = 0; c < kCategoryCount; ++c) {
    b[std::string(category_name(static_cast<Category>(c)))] = e.breakdown_at_peak[c];
  }
  j["breakdown_at_peak"] = b;
  j["peak"] = moment_object(e.peak);
  ordered_json steps = ordered_json::array();
  for (const auto& s : e.steps) {
    steps.push_back({{"step", s.step},
                     {"peak_allocated_bytes", s.peak_allocated_bytes},
                     {"peak_reserved_bytes", s.peak_reserved_bytes}});
  }
  j["steps"] = steps;
  j["device"] = {{"name", e.gpu.name},
                 {"capacity_bytes", e.gpu.capacity_bytes},
                 {"context_bytes", e.gpu.context_bytes}};
  if (e.gpu.capacity_bytes) j["fits"] = fits_gpu(e);
  j["recipe"] = recipe_object(e.recipe);
  if (e.recipe.gpus > 1 || e.recipe.pp > 1) {  // a pipeline's ranks are its stages
    j["rank"] = e.rank;
    ordered_json ranks = ordered_json::array();
    for (const RankPeak& p : e.ranks) {
      ranks.push_back({{"rank", p.rank},
                       {"peak_allocated_bytes", p.peak_allocated_bytes},
                       {"peak_reserved_bytes", p.peak_reserved_bytes}});
    }
    j["ranks"] = ranks;
  }
  if (e.recipe.offload != Offload::kNone) {  // the reported rank's host memory (Note [ZeRO-Offload])
    j["host_bytes"] = {{"total_bytes", e.host.total_bytes()},
                       {"pinned_bytes", e.host.pinned_bytes},
                       {"pinned_requested_bytes", e.host.pinned_requested_bytes},
                       {"pageable_bytes", e.host.pageable_bytes},
                       {"weights", e.host.weights_bytes},
                       {"optimizer_states", e.host.optimizer_states_bytes},
                       {"gradients", e.host.gradients_bytes},
                       {"measured", false}};
  }
  if (!e.phases.empty()) {
    ordered_json ph = ordered_json::array();
    for (const auto& p : e.phases) {
      ph.push_back({{"step", p.step},
                    {"micro_batch", p.micro_batch},
                    {"phase", phase_name(p.phase)},
                    {"peak_allocated_bytes", p.peak_allocated_bytes},
                    {"peak_reserved_bytes", p.peak_reserved_bytes}});
    }
    j["phases"] = ph;
  }
  if (!e.timeline.empty()) {
    ordered_json t = ordered_json::array();
    for (const auto& p : e.timeline) {
      t.push_back({{"event", p.event},
                   {"allocated_bytes", p.allocated_bytes},
                   {"reserved_bytes", p.reserved_bytes},
                   {"moment", moment_object(p.moment)}});
    }
    j["timeline"] = t;
  }
  j["source"] = "engine";
  // Model names are paths the user gave; bytes that are not UTF-8 are replaced, not fatal.
  return pretty ? j.dump(2, ' ', false, ordered_json::error_handler_t::replace)
                : j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

std::string to_text(const Estimate& e) {
  std::string out;
  auto add = [&](const char* fmt, auto... args) { appendf(out, fmt, args...); };
  add("%s — %s parameters\n", e.model.c_str(), detail::format_count(e.parameters).c_str());
  const Recipe& r = e.recipe;
  if (r.mode == Mode::kInference) {
    // One generate() call: the prompt, then new_tokens tokens, greedy or beam search.
    const std::string search = r.beams > 1 ? "beam search, " + std::to_string(r.beams) + " beams" : "greedy";
    add("recipe: generate, prompt batch %llu × seq %llu, %llu new tokens, %s, %s, attention %s\n",
        static_cast<unsigned long long>(r.batch), static_cast<unsigned long long>(r.seq),
        static_cast<unsigned long long>(r.new_tokens), search.c_str(), std::string(to_string(r.precision)).c_str(),
        std::string(to_string(r.attention)).c_str());
  } else {
    add("recipe: batch %llu × seq %llu, grad_accum %llu, %s%s, %s%s, checkpointing %s, attention %s, loss %s%s%s\n",
        static_cast<unsigned long long>(r.batch), static_cast<unsigned long long>(r.seq),
        static_cast<unsigned long long>(r.grad_accum), std::string(to_string(r.precision)).c_str(),
        r.fp32_outputs ? " (outputs to fp32)" : "", std::string(to_string(r.optimizer)).c_str(),
        r.clip_grad_norm ? " after clip_grad_norm_" : "", std::string(to_string(r.checkpointing)).c_str(),
        std::string(to_string(r.attention)).c_str(), std::string(to_string(r.loss)).c_str(),
        mask_words(r).c_str(), r.allocator == AllocatorMode::kExpandable ? ", expandable segments" : "");
  }
  // The wrapper's own settings where they are not its defaults (the JSON recipe has them all).
  std::string wrapper;
  if (r.parallel == Parallel::kFsdp && !r.fsdp.is_default()) {
    if (r.fsdp.replicate > 1) {
      appendf(wrapper, ", HSDP over %llu replica groups of %llu", static_cast<unsigned long long>(r.fsdp.replicate),
              static_cast<unsigned long long>(r.gpus / r.fsdp.replicate));
    }
    if (!r.fsdp.reshard_after_forward) wrapper += ", reshard_after_forward=False";
    if (r.fsdp.no_sync) wrapper += ", no gradient sync until the last micro-batch";
    if (r.fsdp.param_dtype != FsdpDtype::kNone) {
      wrapper += ", MixedPrecisionPolicy(param_dtype=" + std::string(to_string(r.fsdp.param_dtype)) +
                 (r.fsdp.reduce_dtype != FsdpDtype::kNone ? ", reduce_dtype=" + std::string(to_string(r.fsdp.reduce_dtype)) : "") +
                 ")";
    }
  }
  if (r.parallel == Parallel::kDdp && r.ddp_find_unused_parameters) wrapper += ", find_unused_parameters=True";
  if (r.parallel == Parallel::kDdp && r.ddp_gradient_as_bucket_view) wrapper += ", gradient_as_bucket_view=True";
  if (r.parallel == Parallel::kDdp && r.ddp_no_sync) wrapper += ", no_sync until the last micro-batch";
  if (!wrapper.empty()) add("%s:%s\n", std::string(to_string(r.parallel)).c_str(), wrapper.c_str() + 1);
  if (r.lora.enabled()) {
    std::string targets;
    for (const auto& t : r.lora.targets) targets += (targets.empty() ? "" : ", ") + t;
    add("lora: rank %llu on %s (dropout %g), %s trainable parameters\n",
        static_cast<unsigned long long>(r.lora.rank), targets.c_str(), r.lora.dropout,
        detail::format_count(e.trainable_parameters).c_str());
    if (r.half_model() && !r.quant.enabled()) {
      const std::string d(to_string(r.load_dtype));
      add("model loaded in %s: the frozen weights %s, the adapters fp32 under %s autocast\n", d.c_str(), d.c_str(),
          d.c_str());
    }
  } else if (r.half_model()) {
    const std::string d(to_string(r.load_dtype));
    add("model loaded in %s and trained whole under %s autocast: %s weights, gradients and optimizer states\n",
        d.c_str(), d.c_str(), d.c_str());
  }
  const std::string stored =
      r.quant.storage != QuantStorage::kUint8 ? ", stored as " + std::string(to_string(r.quant.storage)) : "";
  if (r.quant.enabled() && r.mode == Mode::kTraining) {
    const std::string rest = r.half_model() ? std::string(to_string(r.load_dtype)) + " (prepare_model_for_kbit_training skipped)"
                                            : "fp32 (prepare_model_for_kbit_training)";
    add("4-bit base: %s%s%s (bitsandbytes), the rest %s\n", std::string(to_string(r.quant.quant_type)).c_str(),
        r.quant.double_quant ? ", double quant" : "", stored.c_str(), rest.c_str());
  } else if (r.quant.enabled()) {
    add("4-bit weights: %s%s%s (bitsandbytes), the rest %s\n", std::string(to_string(r.quant.quant_type)).c_str(),
        r.quant.double_quant ? ", double quant" : "", stored.c_str(), std::string(to_string(r.precision)).c_str());
  }
  if (r.quant.load_in_8bit) {
    add("8-bit weights: LLM.int8, threshold 6.0 (bitsandbytes), the rest %s\n",
        std::string(to_string(r.precision)).c_str());
  }
  if (r.parallel != Parallel::kNone && r.pp == 1) {  // PP x DP: the pipeline line below says it
    // TP x DP: `gpus` is the data-parallel degree, each rank a tensor-parallel group of `tp` GPUs.
    // CP x FSDP2: each data-parallel rank a context-parallel ring of `cp` GPUs (Note [Context
    // parallelism under FSDP2]).
    const std::string tp = r.tp > 1   ? " x tensor parallel " + std::to_string(r.tp) + tp_style_words(r) + " (" +
                                          std::to_string(r.gpus * r.tp) + " GPUs)"
                           : r.cp > 1 ? " x context parallel " + std::to_string(r.cp) + " (" +
                                          std::to_string(r.gpus * r.cp) + " GPUs, sharded over all; unmeasured)"
                                      : "";
    add("data parallel: %s over %llu GPUs%s; the figures below are one GPU's, %s\n",
        std::string(to_string(r.parallel)).c_str(), static_cast<unsigned long long>(r.gpus), tp.c_str(),
        whose_figures(e).c_str());
  }
  if (r.parallel == Parallel::kNone && r.pp == 1 && r.tp > 1) {
    add("tensor parallel: one group of %llu GPUs%s; the figures below are one GPU's, %s\n",
        static_cast<unsigned long long>(r.tp), tp_style_words(r).c_str(), whose_figures(e).c_str());
  } else if (r.parallel == Parallel::kNone && r.pp == 1 && r.cp > 1) {
    add("context parallel: a ring of %llu GPUs, the sequence sharded over them; the figures below are one GPU's, "
        "%s\n",
        static_cast<unsigned long long>(r.cp), whose_figures(e).c_str());
  }
  if (r.pp > 1 && r.pp_stages_per_rank > 1) {  // Note [Interleaved pipeline schedules]
    // Under PP x DP the rank is pipeline rank x gpus + dp rank, each local stage with its own
    // replicas' wrapper (Notes [Interleaved pipeline schedules with DDP] / [... with FSDP2]).
    const std::uint64_t pipeline_rank = e.rank / r.gpus;
    std::string stages;
    for (std::uint64_t v = 0; v < r.pp_stages_per_rank; ++v) {
      stages += (v ? (v + 1 == r.pp_stages_per_rank ? " and " : ", ") : "") + std::to_string(pipeline_rank + v * r.pp);
    }
    std::string dp;
    if (r.tp > 1) {  // each stage a tensor-parallel group (Note [Pipeline with tensor parallelism])
      dp.append(" x tensor parallel ").append(std::to_string(r.tp)).append(tp_style_words(r));
      if (r.parallel == Parallel::kNone) dp.append(" (").append(std::to_string(r.pp * r.tp)).append(" GPUs)");
    }
    if (r.parallel != Parallel::kNone) {
      dp.append(" x data parallel ").append(to_string(r.parallel)).append(" over ").append(std::to_string(r.gpus));
      dp.append(" replicas (").append(std::to_string(r.pp * r.gpus * r.tp)).append(" GPUs)");
    }
    // Under PP x TP a pipeline rank is a tensor-parallel group of GPUs.
    const char* unit = r.tp > 1 ? "pipeline rank" : "GPU";
    add("pipeline parallel: %s over %llu stages (%llu per %s on %llu %ss)%s, %llu micro-batches; the figures "
        "below are one GPU's, rank %llu (stages %s)%s\n",
        std::string(to_string(r.pp_schedule)).c_str(), static_cast<unsigned long long>(r.pp * r.pp_stages_per_rank),
        static_cast<unsigned long long>(r.pp_stages_per_rank), unit, static_cast<unsigned long long>(r.pp), unit,
        dp.c_str(),
        static_cast<unsigned long long>(r.grad_accum), static_cast<unsigned long long>(e.rank), stages.c_str(),
        rank_words(e).c_str());
  } else if (r.pp > 1 && r.tp > 1) {  // PP x TP (x FSDP2): a stage's tp ranks hold the same (Note [Pipeline with tensor parallelism])
    const std::string dp = r.parallel != Parallel::kNone ? " x data parallel " + std::string(to_string(r.parallel)) +
                                                               " over " + std::to_string(r.gpus) + " replicas"
                                                         : "";
    add("pipeline parallel: %s over %llu stages%s x tensor parallel %llu%s (%llu GPUs), %llu micro-batches; the "
        "figures below are one GPU's, rank %llu (stage %llu)%s\n",
        std::string(to_string(r.pp_schedule)).c_str(), static_cast<unsigned long long>(r.pp), dp.c_str(),
        static_cast<unsigned long long>(r.tp), tp_style_words(r).c_str(),
        static_cast<unsigned long long>(r.pp * r.gpus * r.tp),
        static_cast<unsigned long long>(r.grad_accum), static_cast<unsigned long long>(e.rank),
        static_cast<unsigned long long>(e.rank / r.gpus), rank_words(e).c_str());
  } else if (r.pp > 1 && r.parallel == Parallel::kNone) {
    add("pipeline parallel: %s over %llu stages (one per GPU), %llu micro-batches; the figures below are one GPU's, "
        "stage %llu%s\n",
        std::string(to_string(r.pp_schedule)).c_str(), static_cast<unsigned long long>(r.pp),
        static_cast<unsigned long long>(r.grad_accum), static_cast<unsigned long long>(e.rank), rank_words(e).c_str());
  } else if (r.pp > 1) {  // PP x DP: rank = stage x gpus + data-parallel rank (Note [Pipeline with DDP])
    add("pipeline parallel: %s over %llu stages x data parallel %s over %llu replicas (%llu GPUs), %llu "
        "micro-batches; the figures below are one GPU's, rank %llu (stage %llu)%s\n",
        std::string(to_string(r.pp_schedule)).c_str(), static_cast<unsigned long long>(r.pp),
        std::string(to_string(r.parallel)).c_str(), static_cast<unsigned long long>(r.gpus),
        static_cast<unsigned long long>(r.pp * r.gpus), static_cast<unsigned long long>(r.grad_accum),
        static_cast<unsigned long long>(e.rank), static_cast<unsigned long long>(e.rank / r.gpus),
        rank_words(e).c_str());
  }
  if (r.offload != Offload::kNone) {
    // FSDP2's CPUOffloadPolicy or DeepSpeed's offload (Note [FSDP2 CPU offload], Note [ZeRO-Offload]).
    const char* what = r.parallel == Parallel::kFsdp        ? "FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer step"
                       : r.offload == Offload::kOptimizer ? "DeepSpeed offload_optimizer"
                       : r.offload == Offload::kParams    ? "DeepSpeed offload_param"
                                                          : "DeepSpeed offload_optimizer and offload_param";
    add("cpu offload: %s (%s, pinned); host memory of this rank %s: %s pinned (%s "
        "requested), %s pageable; mirrored from the source, unmeasured\n",
        std::string(to_string(r.offload)).c_str(), what, detail::format_bytes(e.host.total_bytes()).c_str(),
        detail::format_bytes(e.host.pinned_bytes).c_str(), detail::format_bytes(e.host.pinned_requested_bytes).c_str(),
        detail::format_bytes(e.host.pageable_bytes).c_str());
  }
  add("gpu: %s (%s)\n\n", e.gpu.name.c_str(), e.gpu.description.c_str());
  add("peak allocated  %12s   (torch.cuda.max_memory_allocated)\n", detail::format_bytes(e.peak_allocated_bytes).c_str());
  add("peak reserved   %12s   (torch.cuda.max_memory_reserved)\n", detail::format_bytes(e.peak_reserved_bytes).c_str());
  if (e.gpu.context_bytes) {
    add("cuda context    %12s   (outside the allocator, not in the figures above)\n",
        detail::format_bytes(e.gpu.context_bytes).c_str());
  }
  add("peak at         step %llu, micro-batch %llu, %s, %s\n\n", static_cast<unsigned long long>(e.peak.step),
      static_cast<unsigned long long>(e.peak.micro_batch), std::string(phase_name(e.peak.phase)).c_str(),
      e.peak.op.c_str());
  add("breakdown at the peak:\n");
  constexpr int kBar = 40;
  for (std::size_t c = 0; c < kCategoryCount; ++c) {
    std::uint64_t b = e.breakdown_at_peak[c];
    double share = e.peak_allocated_bytes ? static_cast<double>(b) / static_cast<double>(e.peak_allocated_bytes) : 0;
    int n = static_cast<int>(share * kBar + 0.5);
    std::string bar(static_cast<std::size_t>(n), '#');
    bar.resize(kBar, '.');
    add("  %-17s %12s %5.1f%%  %s\n", std::string(category_name(static_cast<Category>(c))).c_str(),
        detail::format_bytes(b).c_str(), share * 100, bar.c_str());
  }
  if (e.gpu.capacity_bytes) {
    const std::uint64_t need = e.peak_reserved_bytes + e.gpu.context_bytes;
    if (fits_gpu(e)) {
      add("\nfits: %s of %s used with the context; %s headroom\n", detail::format_bytes(need).c_str(),
          detail::format_bytes(e.gpu.capacity_bytes).c_str(),
          detail::format_bytes(e.gpu.capacity_bytes - need).c_str());
    } else {
      add("\ndoes not fit: needs %s with the context, the GPU has %s (%s short)\n",
          detail::format_bytes(need).c_str(), detail::format_bytes(e.gpu.capacity_bytes).c_str(),
          detail::format_bytes(need - e.gpu.capacity_bytes).c_str());
    }
  }
  return out;
}

}  // namespace trainmem::report
