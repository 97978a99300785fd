#include "report/report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/checked.h"

namespace trainmem::report {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

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
  j["gpu"] = r.gpu;
  j["allocator"] = to_string(r.allocator);
  if (r.lora.enabled()) {
    j["lora_rank"] = r.lora.rank;
    j["lora_targets"] = r.lora.targets;
    j["lora_dropout"] = r.lora.dropout;
  } else {
    j["lora_rank"] = 0;
  }
  j["steps"] = r.steps;
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

}  // namespace

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
  j["recipe"] = recipe_object(e.recipe);
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
  char line[256];
  auto add = [&](const char* fmt, auto... args) {
    std::snprintf(line, sizeof line, fmt, args...);
    out += line;
  };
  add("%s — %.3g B parameters\n", e.model.c_str(), static_cast<double>(e.parameters) / 1e9);
  const Recipe& r = e.recipe;
  add("recipe: batch %llu × seq %llu, grad_accum %llu, %s, %s, checkpointing %s, attention %s, loss %s\n",
      static_cast<unsigned long long>(r.batch), static_cast<unsigned long long>(r.seq),
      static_cast<unsigned long long>(r.grad_accum), std::string(to_string(r.precision)).c_str(),
      std::string(to_string(r.optimizer)).c_str(), std::string(to_string(r.checkpointing)).c_str(),
      std::string(to_string(r.attention)).c_str(), std::string(to_string(r.loss)).c_str());
  if (r.lora.enabled()) {
    std::string targets;
    for (const auto& t : r.lora.targets) targets += (targets.empty() ? "" : ", ") + t;
    add("lora: rank %llu on %s (dropout %g), %s trainable parameters\n",
        static_cast<unsigned long long>(r.lora.rank), targets.c_str(), r.lora.dropout,
        detail::format_count(e.trainable_parameters).c_str());
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
    std::uint64_t need = e.peak_reserved_bytes + e.gpu.context_bytes;
    if (need <= e.gpu.capacity_bytes) {
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
