// The planner: which recipes fit a GPU, fastest first, and what single changes of the user's
// recipe save. Every memory figure is an engine replay (estimate()); recipes are ruled out
// without a replay only by a lower bound that the replay could never go under.
//
// Note [Search order]
// The time model (time.cpp) needs no replay, so every recipe of the space is timed first and
// the space is walked fastest first; replays stop once `top` recipes fit. A recipe is skipped
// unreplayed when its floor (weights, fp32 masters, every gradient, optimizer states: all alive
// through step 2, so the peak cannot be lower) already exceed the usable memory. The
// allocator setting costs no time, so it is not a ranking dimension: a recipe is replayed with
// the default allocator first and with expandable segments only when it does not fit.
#include <algorithm>
#include <future>
#include <map>
#include <thread>
#include <numeric>
#include <string>

#include "common/checked.h"
#include "plan/plan.h"

namespace trainmem {
namespace {

constexpr std::uint64_t kMaxAccum = 1024;  // Recipe::validate's bound

bool is_half_param(Precision p) {
  return p == Precision::kBf16Master || p == Precision::kBf16True || p == Precision::kFp16True;
}

class Planner {
 public:
  Planner(const Model& m, const Gpu& gpu) : m_(m), usable_(gpu.usable_bytes()) {}

  Plan replay(const Recipe& r) {
    const std::string key = report_key(r);
    if (auto it = memo_.find(key); it != memo_.end()) return it->second;
    Plan p = compute(r);
    ++simulated_;
    memo_.emplace(key, p);
    return p;
  }

  // Replays the recipes not replayed yet on all cores; replay() then finds them. Results do not
  // depend on the thread count: each replay is independent and deterministic.
  void prefetch(const std::vector<Recipe>& rs) {
    std::vector<const Recipe*> todo;
    for (const Recipe& r : rs) {
      if (!memo_.count(report_key(r))) todo.push_back(&r);
    }
    if (todo.size() < 2) return;
    std::vector<std::future<Plan>> jobs;
    for (const Recipe* r : todo) jobs.push_back(std::async(std::launch::async, [this, r] { return compute(*r); }));
    for (std::size_t i = 0; i < todo.size(); ++i) {
      Plan p = jobs[i].get();  // rethrows an engine error here, on the planner's thread
      ++simulated_;
      memo_.emplace(report_key(*todo[i]), std::move(p));
    }
  }

  std::uint64_t usable() const { return usable_; }
  std::uint64_t simulated() const { return simulated_; }

 private:
  Plan compute(const Recipe& r) const {
    Plan p;
    p.recipe = r;
    p.time = step_time(m_, r);
    const Estimate e = estimate(m_, r);
    p.recipe = e.recipe;  // LoRA targets resolved
    p.peak_allocated_bytes = e.peak_allocated_bytes;
    p.peak_reserved_bytes = e.peak_reserved_bytes;
    p.peak = e.peak;
    p.simulated = true;
    p.fits = p.peak_reserved_bytes <= usable_;
    return p;
  }

  static std::string report_key(const Recipe& r) {
    std::string k = std::to_string(r.batch) + "/" + std::to_string(r.grad_accum) + "/" + std::to_string(r.seq);
    for (std::string_view s : {to_string(r.precision), to_string(r.optimizer), to_string(r.checkpointing),
                               to_string(r.attention), to_string(r.loss), to_string(r.allocator)}) {
      k += "/";
      k += s;
    }
    k += "/" + r.gpu + "/lora" + std::to_string(r.lora.rank) + "/" + std::to_string(r.lora.dropout);
    for (const std::string& t : r.lora.targets) k += "/" + t;
    return k;
  }

  const Model& m_;
  std::uint64_t usable_;
  std::uint64_t simulated_ = 0;
  std::map<std::string, Plan> memo_;
};

bool fixed(const FitRequest& q, std::string_view knob) {
  return std::find(q.fixed.begin(), q.fixed.end(), knob) != q.fixed.end();
}

template <typename T>
std::vector<T> values(const FitRequest& q, std::string_view knob, T base, std::vector<T> all) {
  if (fixed(q, knob)) return {base};
  return all;
}

bool valid(const Recipe& r) {
  try {
    r.validate();
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

std::uint64_t plan::persistent_floor(const Model& m, const Recipe& r) {
  const std::uint64_t pb = is_half_param(r.precision) ? 2 : 4;
  std::uint64_t weights = 0;
  for (const ParameterGroup& g : m.parameters) {
    weights = detail::add(weights, detail::mul({g.numel, g.count, pb}, "parameter bytes"), "parameter bytes");
  }
  if (r.lora.enabled()) return weights;  // adapters and their states only add
  const std::uint64_t n = m.parameter_count;
  // Every parameter's .grad (in the parameter's dtype) exists when the optimizer step starts.
  std::uint64_t extra = detail::mul(n, pb, "gradient bytes");
  if (r.precision == Precision::kBf16Master) extra = detail::add(extra, detail::mul(n, 4, "master bytes"), "master bytes");
  const std::uint64_t sb = r.precision == Precision::kBf16True || r.precision == Precision::kFp16True ? 2 : 4;
  switch (r.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kAdamWFused: extra = detail::add(extra, detail::mul({n, 2, sb}, "state bytes"), "state bytes"); break;
    case Optimizer::kAdamW8bit: extra = detail::add(extra, detail::mul(n, 2, "state bytes"), "state bytes"); break;
    case Optimizer::kSgd: extra = detail::add(extra, detail::mul(n, sb, "state bytes"), "state bytes"); break;
    case Optimizer::kAdafactor: break;
  }
  return detail::add(weights, extra, "persistent bytes");
}

FitResult fit(const Model& model, const FitRequest& q) {
  q.base.validate();
  if (q.base.mode != Mode::kTraining) throw Error("mode: fit plans training recipes; estimate a generation with `estimate --inference`");
  const Gpu& gpu = find_gpu(q.base.gpu);
  if (gpu.capacity_bytes == 0) throw Error("gpu: 'cpu' has no memory to plan for; name a GPU (trainmem gpus)");
  if (q.gpus != 1) {
    throw Error("gpus: only one GPU is modelled so far (data parallelism, ZeRO and FSDP are not in the engine yet)");
  }
  if (q.top < 1 || q.top > 1000) throw Error("top: must be between 1 and 1000, got " + std::to_string(q.top));
  for (const std::string& k : q.fixed) {
    static constexpr std::string_view kKnobs[] = {"batch", "precision", "optimizer", "checkpointing",
                                                   "attention", "loss", "allocator"};
    if (std::find(std::begin(kKnobs), std::end(kKnobs), k) == std::end(kKnobs)) {
      throw Error("fixed: '" + k + "' is not a knob the planner searches");
    }
  }
  FitResult out;
  out.gpu = gpu;
  out.gpus = q.gpus;
  out.global_batch = q.global_batch ? q.global_batch
                                    : detail::mul({q.base.batch, q.base.grad_accum, q.gpus}, "global batch");
  out.capacity_bytes = gpu.usable_bytes();
  if (out.global_batch % q.gpus != 0) {
    throw Error("global_batch: " + std::to_string(out.global_batch) + " sequences do not split over " +
                std::to_string(q.gpus) + " GPUs");
  }
  const std::uint64_t per_gpu = out.global_batch / q.gpus;

  Planner planner(model, gpu);

  // The user's recipe as given, at the global batch asked for.
  Recipe base = q.base;
  if (base.batch * base.grad_accum != per_gpu) {
    if (per_gpu % base.batch != 0) {
      throw Error("global_batch: " + std::to_string(out.global_batch) + " is not a multiple of batch " +
                  std::to_string(base.batch) + (q.gpus > 1 ? " times the GPUs" : ""));
    }
    base.grad_accum = per_gpu / base.batch;
    if (base.grad_accum > kMaxAccum) {
      throw Error("global_batch: needs grad_accum " + std::to_string(base.grad_accum) + " at batch " +
                  std::to_string(base.batch) + "; more than " + std::to_string(kMaxAccum));
    }
  }
  out.baseline = planner.replay(base);

  // ---- the search space (Note [Search order])
  std::vector<std::uint64_t> batches;
  if (fixed(q, "batch")) {
    batches = {base.batch};
  } else {
    for (std::uint64_t b = 1; b <= per_gpu; b *= 2) {
      if (per_gpu % b == 0 && per_gpu / b <= kMaxAccum) batches.push_back(b);
    }
    if (per_gpu % base.batch == 0 && std::find(batches.begin(), batches.end(), base.batch) == batches.end()) {
      batches.push_back(base.batch);
    }
  }
  if (batches.empty()) {
    throw Error("global_batch: " + std::to_string(out.global_batch) + " needs more than " +
                std::to_string(kMaxAccum) + " micro-batches per GPU at any power-of-two micro-batch");
  }
  const std::vector<Precision> precisions = values(
      q, "precision", base.precision,
      gpu.bf16 ? std::vector<Precision>{Precision::kBf16Mixed, Precision::kBf16True, Precision::kBf16Master, Precision::kFp32}
               : std::vector<Precision>{Precision::kFp16Mixed, Precision::kFp32});
  const auto optimizers = values(q, "optimizer", base.optimizer,
                                 {Optimizer::kAdamWFused, Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kAdafactor});
  const auto ckpts = values(q, "checkpointing", base.checkpointing, {Checkpointing::kNone, Checkpointing::kFull});
  const auto losses = values(q, "loss", base.loss, {Loss::kStandard, Loss::kFused});
  const auto allocators = values(q, "allocator", base.allocator, {AllocatorMode::kDefault, AllocatorMode::kExpandable});

  struct Candidate {
    Recipe r;
    StepTime t;
    std::uint64_t floor = 0;
  };
  std::vector<Candidate> space;
  for (std::uint64_t b : batches) {
    for (Precision p : precisions) {
      for (Optimizer o : optimizers) {
        for (Checkpointing c : ckpts) {
          for (Loss l : losses) {
            Recipe r = base;
            r.batch = b;
            r.grad_accum = per_gpu / b;
            r.precision = p;
            r.optimizer = o;
            r.checkpointing = c;
            r.loss = l;
            r.allocator = allocators.front();
            if (!valid(r)) continue;
            out.searched += allocators.size();
            space.push_back({r, step_time(model, r), plan::persistent_floor(model, r)});
          }
        }
      }
    }
  }
  std::stable_sort(space.begin(), space.end(),
                   [](const Candidate& a, const Candidate& b) { return a.t.seconds < b.t.seconds; });

  Plan best_miss;
  bool have_miss = false;
  auto consider_miss = [&](const Plan& p) {
    if (!have_miss || p.peak_reserved_bytes < best_miss.peak_reserved_bytes ||
        (p.simulated && !best_miss.simulated)) {
      if (have_miss && best_miss.simulated && !p.simulated) return;
      best_miss = p;
      have_miss = true;
    }
  };
  const std::size_t window = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 8);
  for (std::size_t i = 0; i < space.size(); ++i) {
    const Candidate& c = space[i];
    if (out.plans.size() >= q.top) break;
    if (i % window == 0) {  // the next window's first replays, in parallel
      std::vector<Recipe> next;
      for (std::size_t k = i; k < std::min(space.size(), i + window); ++k) {
        if (space[k].floor <= planner.usable()) next.push_back(space[k].r);
      }
      planner.prefetch(next);
    }
    if (c.floor > planner.usable()) {
      out.pruned += allocators.size();
      Plan p;
      p.recipe = c.r;
      p.time = c.t;
      p.peak_allocated_bytes = p.peak_reserved_bytes = c.floor;
      consider_miss(p);
      continue;
    }
    for (AllocatorMode a : allocators) {
      Recipe r = c.r;
      r.allocator = a;
      Plan p = planner.replay(r);
      if (p.fits) {
        out.plans.push_back(p);
        break;
      }
      consider_miss(p);
    }
  }
  if (out.plans.empty() && have_miss) {
    out.has_closest_miss = true;
    out.closest_miss = best_miss;
    // What it takes: on each catalog GPU with more memory, the fastest recipe of the same space
    // that fits there (replayed on that GPU: the cuBLAS workspace differs by architecture). At
    // most kOtherGpuReplays replays per GPU; a GPU where none of those fits is not listed.
    constexpr int kOtherGpuReplays = 12;
    for (const Gpu& g : gpus()) {
      if (g.capacity_bytes == 0 || g.usable_bytes() <= out.capacity_bytes) continue;
      int replays = 0;
      for (const Candidate& c : space) {
        if (replays >= kOtherGpuReplays) break;
        Recipe r = c.r;
        r.gpu = g.name;
        const bool bf16 = r.precision == Precision::kBf16Mixed || r.precision == Precision::kBf16True ||
                          r.precision == Precision::kBf16Master;
        if ((bf16 && !g.bf16) || c.floor > g.usable_bytes()) continue;
        Plan p = planner.replay(r);
        ++replays;
        if (p.peak_reserved_bytes <= g.usable_bytes()) {
          p.fits = true;
          out.fits_on.push_back({g.name, p});
          break;
        }
      }
    }
  }

  // ---- single changes of the user's recipe
  auto change = [&](std::string what, Recipe r) {
    if (!valid(r)) return;
    try {
      out.changes.push_back({std::move(what), planner.replay(r)});
    } catch (const Error&) {
      // a change this model cannot take (e.g. LoRA defaults on Phi-3): not offered
    }
  };
  for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
    if (c != base.checkpointing) { Recipe r = base; r.checkpointing = c; change("checkpointing " + std::string(to_string(c)), r); }
  }
  for (Precision p : {Precision::kBf16Mixed, Precision::kBf16True, Precision::kBf16Master, Precision::kFp16Mixed, Precision::kFp32}) {
    const bool bf16 = p == Precision::kBf16Mixed || p == Precision::kBf16True || p == Precision::kBf16Master;
    if (p == base.precision || (bf16 && !gpu.bf16) || (!bf16 && p != Precision::kFp32 && gpu.bf16)) continue;
    Recipe r = base; r.precision = p; change("precision " + std::string(to_string(p)), r);
  }
  for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamWFused, Optimizer::kAdamW8bit, Optimizer::kAdafactor, Optimizer::kSgd}) {
    if (o != base.optimizer) { Recipe r = base; r.optimizer = o; change("optimizer " + std::string(to_string(o)), r); }
  }
  for (Attention a : {Attention::kSdpa, Attention::kEager}) {
    if (a != base.attention) { Recipe r = base; r.attention = a; change("attention " + std::string(to_string(a)), r); }
  }
  {
    Recipe r = base;
    r.loss = base.loss == Loss::kStandard ? Loss::kFused : Loss::kStandard;
    change("loss " + std::string(to_string(r.loss)), r);
  }
  {
    Recipe r = base;
    r.allocator = base.allocator == AllocatorMode::kDefault ? AllocatorMode::kExpandable : AllocatorMode::kDefault;
    change("allocator " + std::string(to_string(r.allocator)), r);
  }
  if (base.batch % 2 == 0 && base.grad_accum * 2 <= kMaxAccum) {
    Recipe r = base; r.batch /= 2; r.grad_accum *= 2;
    change("batch " + std::to_string(r.batch) + " x grad_accum " + std::to_string(r.grad_accum), r);
  }
  if (base.grad_accum % 2 == 0) {
    Recipe r = base; r.batch *= 2; r.grad_accum /= 2;
    change("batch " + std::to_string(r.batch) + " x grad_accum " + std::to_string(r.grad_accum), r);
  }
  if (!base.lora.enabled()) {
    Recipe r = base;
    r.lora.rank = 16;
    r.lora.targets = {"default"};
    if (r.precision == Precision::kBf16Master) r.precision = Precision::kBf16True;
    change("lora 16 (default targets; trains adapters only)", r);
  }
  std::stable_sort(out.changes.begin(), out.changes.end(), [](const Change& a, const Change& b) {
    return a.plan.peak_reserved_bytes < b.plan.peak_reserved_bytes;
  });
  out.simulated = planner.simulated();
  return out;
}

}  // namespace trainmem
