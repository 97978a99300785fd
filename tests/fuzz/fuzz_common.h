// What every fuzz target shares: the outcomes that count as fine, the engine invariants each
// successful estimate is held to, and the caps that keep one input fast.
//
// Note [Fuzzing outcomes]
// For any input the engine may (a) succeed, (b) throw trainmem::Error (bad input) or (c) throw
// std::overflow_error (a size that does not fit 64-bit byte arithmetic). Anything else is a
// finding and stops the run: a sanitizer report, an abort from TRAINMEM_ASSERT ("a bug"), any
// other exception (nlohmann::json's type_error, std::bad_alloc, std::length_error, ...), or an
// estimate that breaks an invariant below.
//
// Note [Fuzzing caps]
// The time of one estimate grows with the number of ops simulated, i.e. with num_layers ×
// grad_accum × steps, not with byte sizes (a 10^12-byte tensor is one allocator event like a
// 512-byte one). So the caps are on layers and micro-batches; batch, seq and the widths are
// left free, which is what lets the fuzzer reach the overflow checks. One exception: the fused
// loss's chunk loop, whose length grows with tokens / chunk (see cheap()).
#pragma once

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>

#include <nlohmann/json.hpp>

#include "graph/step.h"
#include "report/report.h"
#include "trainmem/trainmem.h"

namespace fuzz {

inline constexpr std::uint64_t kMaxLayers = 64;
inline constexpr std::uint64_t kMaxGradAccum = 4;
inline constexpr std::uint64_t kMaxFusedChunks = 4096;
inline constexpr std::uint64_t kMaxNewTokens = 64;    // generation: one forward per new token
inline constexpr std::uint64_t kMaxReplayedRanks = 8; // ZeRO: one replay per rank

[[noreturn]] inline void finding(const char* what, const char* detail = "") {
  std::fprintf(stderr, "FUZZ FINDING: %s %s\n", what, detail);
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_CHECK(cond)                                         \
  do {                                                           \
    if (!(cond)) ::fuzz::finding("invariant broken:", #cond);    \
  } while (0)

// Runs f; returns true when it completed, false on an expected bad-input outcome. Any other
// exception is a finding (see Note [Fuzzing outcomes]).
template <typename F>
bool expected_outcome(F&& f) {
  try {
    f();
    return true;
  } catch (const trainmem::Error&) {
    return false;
  } catch (const std::overflow_error&) {
    return false;
  } catch (const std::exception& e) {
    std::string msg = std::string(typeid(e).name()) + ": " + e.what();
    finding("unexpected exception", msg.c_str());
  } catch (...) {
    finding("unexpected non-std exception");
  }
}

// Note [Known findings]
// Findings not fixed yet, each with a reproducer in regressions/. By default they stop the run
// like any finding; TRAINMEM_FUZZ_SKIP_KNOWN steps around them so a long campaign can look for
// others: "1" or "all" skips every one, or a comma-separated list of their names. Add an entry
// (a name, what breaks, and a skip_known("name") guard where it breaks) when a finding stays
// open; remove it when its fix lands. None is open now; fixed so far (regressions/ keeps them):
//   one-layer   (fuzz_config/one-layer-segv.json): 1-layer models crashed the graph builder;
//   utf8-name   (fuzz_recipe/non-utf8-model-name): a non-UTF-8 model name made to_json throw.
inline bool skip_known(std::string_view name) {
  static const std::string skip = [] {
    const char* v = std::getenv("TRAINMEM_FUZZ_SKIP_KNOWN");
    return std::string(v ? v : "");
  }();
  if (skip.empty()) return false;
  if (skip == "1" || skip == "all") return true;
  std::string_view rest = skip;
  while (!rest.empty()) {
    std::size_t comma = rest.find(',');
    if (rest.substr(0, comma) == name) return true;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return false;
}

// Whether to build a step for this model and recipe at all: within the caps, and not a known
// finding that the run was told to step around.
inline bool cheap(const trainmem::Model& m, const trainmem::Recipe& r) {
  if (m.arch.num_layers > kMaxLayers || r.grad_accum > kMaxGradAccum || r.steps > 2) return false;
  if (r.mode == trainmem::Mode::kInference && (r.new_tokens > kMaxNewTokens || r.beams > kMaxNewTokens)) return false;
  if (trainmem::is_zero(r.parallel) && r.gpus > kMaxReplayedRanks) return false;
  // A pipeline replays every stage (and its schedule grows with them), a context-parallel ring
  // runs one attention step per rank of the ring.
  if (r.pp > kMaxReplayedRanks || r.pp_stages_per_rank > kMaxReplayedRanks / std::max<std::uint64_t>(r.pp, 1) ||
      r.cp > kMaxReplayedRanks) {
    return false;
  }
  // The fused loss walks the tokens in chunks of about hidden / vocab × tokens rows, so a huge
  // vocabulary over a tiny width times many tokens means ~vocab / hidden chunk iterations.
  std::uint64_t tokens = 0;
  const bool many_tokens = __builtin_mul_overflow(r.batch, r.seq, &tokens) || tokens > kMaxFusedChunks;
  if (r.loss == trainmem::Loss::kFused && m.arch.vocab_size / m.arch.hidden_size > kMaxFusedChunks && many_tokens)
    return false;
  return true;
}

// Live bytes of one category just before the first backward event of step 1, micro-batch 1,
// straight from the graph stage's trace (storage bytes, before allocator rounding). The public
// Estimate does not expose this moment; see README.md.
inline std::uint64_t live_at_backward_start(const trainmem::Model& m, const trainmem::Recipe& r,
                                            trainmem::Category category) {
  const trainmem::Gpu& gpu = trainmem::find_gpu(r.gpu);
  trainmem::graph::Trace t = trainmem::graph::build_training_trace(m, r, gpu);
  std::uint64_t live = 0;
  for (const auto& e : t.events) {
    const auto& mo = t.moments[e.moment];
    if (mo.phase == trainmem::Phase::kBackward) break;
    const auto& s = t.storages[e.tensor];
    if (s.category != category) continue;
    if (e.alloc) live += s.bytes;
    else live -= s.bytes;
  }
  return live;
}

// Estimates (when cheap enough) and holds the result to the engine's documented invariants
// (docs/schema.md): categories sum to the peak, reserved ≥ allocated, the step peaks are the
// peak, the renderings work and the JSON reads back.
inline void check_estimate(const trainmem::Model& m, const trainmem::Recipe& r, bool timeline = false,
                           std::int64_t rank = -1) {
  if (!cheap(m, r)) return;
  trainmem::EstimateOptions opt;
  opt.timeline = timeline;
  opt.rank = rank;
  trainmem::Estimate e = trainmem::estimate(m, r, opt);
  // The rank shown is one of the recipe's, and without one asked for it is the worst replayed
  // (Note [The worst rank] in src/estimate.cpp).
  // A pipeline's ranks are its stages (stage x gpus + data-parallel rank); a tensor-parallel group
  // or a context-parallel ring is one rank shown, without a list.
  const std::uint64_t ranks = r.gpus * r.pp;  // both bounded by validate()
  FUZZ_CHECK(e.rank < ranks);
  FUZZ_CHECK(ranks == 1 ? e.ranks.empty() : !e.ranks.empty());
  for (const auto& x : e.ranks) {
    FUZZ_CHECK(x.rank < ranks);
    FUZZ_CHECK(x.peak_reserved_bytes <= e.peak_reserved_bytes);
  }
  if (rank >= 0) FUZZ_CHECK(e.rank == static_cast<std::uint64_t>(rank));
  std::uint64_t sum = 0;
  for (auto b : e.breakdown_at_peak) sum += b;
  FUZZ_CHECK(sum == e.peak_allocated_bytes);
  FUZZ_CHECK(e.peak_reserved_bytes >= e.peak_allocated_bytes);
  FUZZ_CHECK(e.steps.size() == (r.mode == trainmem::Mode::kInference ? 1 : r.steps));
  std::uint64_t max_alloc = 0, max_reserved = 0;
  for (const auto& s : e.steps) {
    FUZZ_CHECK(s.peak_reserved_bytes >= s.peak_allocated_bytes);
    max_alloc = std::max(max_alloc, s.peak_allocated_bytes);
    max_reserved = std::max(max_reserved, s.peak_reserved_bytes);
  }
  FUZZ_CHECK(max_alloc == e.peak_allocated_bytes);
  FUZZ_CHECK(max_reserved == e.peak_reserved_bytes);
  FUZZ_CHECK(e.peak.phase != trainmem::Phase::kSetup);
  FUZZ_CHECK(e.parameters == m.parameter_count);
  for (const auto& p : e.timeline) FUZZ_CHECK(p.reserved_bytes >= p.allocated_bytes);
  std::string json = trainmem::report::to_json(e);
  std::string text = trainmem::report::to_text(e);
  FUZZ_CHECK(!text.empty());
  FUZZ_CHECK(!nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false).is_discarded());
}

// FNV-1a: a stable way to derive recipe knobs from an input that is all config text.
inline std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// A small recipe picked by `h`: every knob's values appear, batch × seq stays small.
inline trainmem::Recipe recipe_from_hash(std::uint64_t h) {
  auto take = [&h](std::uint64_t n) {
    std::uint64_t v = h % n;
    h /= n;
    return v;
  };
  static constexpr std::uint64_t kSeqs[] = {1, 2, 7, 64, 128, 511};
  static constexpr const char* kGpus[] = {"h100-80gb", "cpu", "a100-40gb", "t4-16gb"};
  trainmem::Recipe r;
  r.batch = 1 + take(3);
  r.seq = kSeqs[take(6)];
  r.grad_accum = 1 + take(2);
  r.precision = static_cast<trainmem::Precision>(take(6));
  r.optimizer = static_cast<trainmem::Optimizer>(take(5));
  r.checkpointing = static_cast<trainmem::Checkpointing>(take(2));
  r.attention = static_cast<trainmem::Attention>(take(3));
  r.loss = static_cast<trainmem::Loss>(take(2));
  r.allocator = static_cast<trainmem::AllocatorMode>(take(2));
  r.gpu = kGpus[take(4)];
  return r;
}

}  // namespace fuzz
