// Helpers shared by the C++ test files.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include "graph/step.h"
#include "trainmem/trainmem.h"

namespace trainmem::testing {

// Runs fn, expects it to throw exactly trainmem::Error, and returns what() ("" if it did not).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected trainmem::Error, got " << typeid(e).name() << ": " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

// Indices into Breakdown (Estimate::breakdown_at_peak).
inline constexpr std::size_t kWeights = static_cast<std::size_t>(Category::kWeights);
inline constexpr std::size_t kStates = static_cast<std::size_t>(Category::kOptimizerStates);
inline constexpr std::size_t kGrads = static_cast<std::size_t>(Category::kGradients);
inline constexpr std::size_t kActs = static_cast<std::size_t>(Category::kActivations);
inline constexpr std::size_t kTemps = static_cast<std::size_t>(Category::kTemporaries);

// A cut or narrowed model the measurements ran (data/ground_truth/configs/NAME.json).
inline Model measured_config(const std::string& name) {
  return load_model(std::string(TRAINMEM_DATA_DIR) + "/ground_truth/configs/" + name + ".json");
}
// The 2-layer GPT-2 cut of the data-parallel measurements and its parameter count.
inline constexpr std::uint64_t kGpt2L2Params = 53'561'088;
inline Model gpt2_l2() { return measured_config("gpt2-l2"); }
// The narrow 4-layer Llama of the tensor-, pipeline- and context-parallel measurements (hidden 512,
// 8 heads, 4 KV heads).
inline Model llama_w512() { return measured_config("llama-3.2-1b-w512-l4"); }

// The data-parallel measurements' recipe shape: batch 2 x 32 tokens on the CPU, expandable
// segments, under `parallel` over `gpus` ranks.
inline Recipe dp_recipe(Parallel parallel, std::uint64_t gpus, Precision precision) {
  Recipe r;
  r.batch = 2;
  r.seq = 32;
  r.precision = precision;
  r.gpu = "cpu";
  r.allocator = AllocatorMode::kExpandable;
  r.parallel = parallel;
  r.gpus = gpus;
  r.validate();
  return r;
}

// dp_recipe with rank-8 LoRA adapters on the model's default targets, on `gpu`.
inline Recipe dp_lora_recipe(const Model& m, Parallel parallel, Precision precision, const char* gpu = "cpu") {
  Recipe r = dp_recipe(parallel, 2, precision);
  r.gpu = gpu;
  r.lora.rank = 8;
  r.lora.targets = resolve_lora_targets(m.arch, {"default"});
  r.validate();
  return r;
}

// Live bytes per category after the trace's first `events` events.
inline std::array<std::uint64_t, 6> live_after_events(const graph::Trace& t, std::size_t events) {
  std::array<std::uint64_t, 6> live{};
  for (std::size_t i = 0; i < events; ++i) {
    const graph::Event& e = t.events[i];
    const std::size_t c = static_cast<std::size_t>(t.storages[e.tensor].category);
    live[c] = e.alloc ? live[c] + t.storages[e.tensor].bytes : live[c] - t.storages[e.tensor].bytes;
  }
  return live;
}

// The most bytes of each category live at any moment of the trace (each category's own peak).
inline std::array<std::uint64_t, 6> most_live(const graph::Trace& t) {
  std::array<std::uint64_t, 6> live{}, most{};
  for (const graph::Event& e : t.events) {
    const std::size_t c = static_cast<std::size_t>(t.storages[e.tensor].category);
    live[c] = e.alloc ? live[c] + t.storages[e.tensor].bytes : live[c] - t.storages[e.tensor].bytes;
    most[c] = std::max(most[c], live[c]);
  }
  return most;
}

// Bytes of the storages first allocated under the op `op`, in order.
inline std::vector<std::uint64_t> allocs_at(const graph::Trace& t, std::string_view op) {
  std::vector<std::uint64_t> out;
  std::vector<bool> seen(t.storages.size(), false);
  for (const graph::Event& e : t.events) {
    if (!e.alloc || seen[e.tensor] || t.moments[e.moment].op != op) continue;
    seen[e.tensor] = true;
    out.push_back(t.storages[e.tensor].bytes);
  }
  return out;
}

}  // namespace trainmem::testing
