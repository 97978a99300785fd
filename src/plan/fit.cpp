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
#include <optional>
#include <thread>
#include <tuple>
#include <numeric>
#include <string>

#include "common/checked.h"
#include "graph/parallel.h"
#include "graph/quant.h"
#include "plan/plan.h"

namespace trainmem {
namespace {

constexpr std::uint64_t kMaxAccum = 1024;  // Recipe::validate's bound

// Replays for the planner, memoized by recipe. A probe may stop early (Note [Stopping early] in
// sim/simulator.cpp): it answers "does it fit under `limit`?" exactly, and its peaks are then only
// "more than the limit". A full replay always runs to the end.
class Planner {
 public:
  explicit Planner(const Model& m) : m_(m) {}

  Plan replay(const Recipe& r) { return run(r, 0); }

  // Exact about peak_reserved_bytes <= limit; plan.complete says whether the peaks are the step's.
  Plan probe(const Recipe& r, std::uint64_t limit) { return run(r, limit); }

  // Probes (limit > 0) or replays (limit 0) the recipes not known yet on all cores; probe() and
  // replay() then find them. Results do not depend on the thread count: each replay is
  // independent and deterministic.
  void prefetch(const std::vector<Recipe>& rs, std::uint64_t limit) {
    std::vector<const Recipe*> todo;
    for (const Recipe& r : rs) {
      if (!known(r, limit)) todo.push_back(&r);
    }
    if (todo.size() < 2) return;
    std::vector<std::future<Plan>> jobs;
    for (const Recipe* r : todo) {
      jobs.push_back(std::async(std::launch::async, [this, r, limit] { return compute(*r, limit); }));
    }
    for (std::size_t i = 0; i < todo.size(); ++i) remember(*todo[i], jobs[i].get(), limit);  // rethrows here
  }

  // Distinct recipes replayed or probed (a probe later replayed to the end counts once).
  std::uint64_t recipes_replayed() const { return memo_.size(); }

 private:
  struct Known {
    Plan plan;
    std::uint64_t limit = 0;  // the stop limit it ran under (0: none)
  };

  // A complete replay answers everything; a stopped one says "peak > its limit", which answers a
  // probe with a limit no higher.
  bool known(const Recipe& r, std::uint64_t limit) const {
    auto it = memo_.find(key(r));
    if (it == memo_.end()) return false;
    return it->second.plan.complete || (limit != 0 && limit <= it->second.limit);
  }

  Plan run(const Recipe& r, std::uint64_t limit) {
    if (known(r, limit)) return memo_.at(key(r)).plan;
    Plan p = compute(r, limit);
    remember(r, p, limit);
    return p;
  }

  void remember(const Recipe& r, const Plan& p, std::uint64_t limit) { memo_[key(r)] = Known{p, limit}; }

  Plan compute(const Recipe& r, std::uint64_t limit) const {
    Plan p;
    p.recipe = r;
    p.time = step_time(m_, r);
    EstimateOptions opt;
    opt.stop_above_reserved_bytes = limit;
    const Estimate e = estimate(m_, r, opt);
    p.recipe = e.recipe;  // LoRA targets resolved
    p.peak_allocated_bytes = e.peak_allocated_bytes;
    p.peak_reserved_bytes = e.peak_reserved_bytes;
    p.peak = e.peak;
    p.simulated = true;
    p.complete = e.complete;
    return p;
  }

  static std::string key(const Recipe& r) {
    std::string k = std::to_string(r.batch) + "/" + std::to_string(r.grad_accum) + "/" + std::to_string(r.seq);
    for (std::string_view s : {to_string(r.precision), to_string(r.optimizer), to_string(r.checkpointing),
                               to_string(r.attention), to_string(r.loss), to_string(r.allocator)}) {
      k += "/";
      k += s;
    }
    k += "/" + r.gpu + "/lora" + std::to_string(r.lora.rank) + "/" + std::to_string(r.lora.dropout);
    k += "/" + std::string(to_string(r.parallel)) + std::to_string(r.gpus);
    k += "/fsdp" + std::string(r.fsdp.reshard_after_forward ? "1" : "0") + std::to_string(r.fsdp.replicate) + "/" +
         std::string(to_string(r.fsdp.param_dtype)) + "/" + std::string(to_string(r.fsdp.reduce_dtype)) + "/" +
         std::string(to_string(r.offload));
    for (const std::string& t : r.lora.targets) k += "/" + t;
    if (r.quant.enabled()) {
      k += "/4bit/" + std::string(to_string(r.quant.quant_type)) + (r.quant.double_quant ? "/dq" : "");
    }
    return k;
  }

  const Model& m_;
  std::map<std::string, Known> memo_;
};

// Whether a replayed plan fits `usable` bytes (a stopped probe never does).
Plan judged(Plan p, std::uint64_t usable) {
  p.fits = p.complete && p.peak_reserved_bytes <= usable;
  return p;
}

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
  const std::uint64_t pb = parameter_bytes(r.precision);
  std::uint64_t weights = 0;
  for (const ParameterGroup& g : m.parameters) {
    // A 4-bit base (Note [QLoRA]): the layers' linear weights packed, everything else fp32.
    const bool packed = r.quant.enabled() && g.matmul_weight && g.name.find(".N.") != std::string::npos;
    const std::uint64_t one = packed ? graph::packed_4bit(g.numel, r.quant.double_quant).packed_bytes
                                     : detail::mul(g.numel, r.quant.enabled() ? 4 : pb, "parameter bytes");
    weights = detail::add(weights, detail::mul(one, g.count, "parameter bytes"), "parameter bytes");
  }
  if (r.lora.enabled()) return weights;  // adapters and their states only add
  const std::uint64_t n = m.parameter_count;
  const std::uint64_t sb = state_bytes(r.precision);
  // Optimizer states per trained element, in bytes (8-bit AdamW: two 1-byte states).
  std::uint64_t states_per_element = 0;
  switch (r.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kAdamWFused: states_per_element = 2 * sb; break;
    case Optimizer::kAdamW8bit: states_per_element = 2; break;
    case Optimizer::kSgd: states_per_element = sb; break;
    case Optimizer::kAdafactor: break;
  }
  if (r.parallel == Parallel::kZero3) {
    // ZeRO-3 (See Note [DeepSpeed ZeRO-3] in graph/zero3.cpp): from deepspeed.initialize on, every
    // rank holds its 16-bit (or fp32) partition, the fp32 master partition, the flat gradient
    // partitions in the model dtype and the ipg bucket, and from step 1 on the states of the
    // master partition; each partition is at least 1/gpus of the parameters (ceil per
    // parameter). Gathered parameters come and go: none are counted.
    const std::uint64_t partition = n / r.gpus;
    const std::uint64_t held = detail::mul(partition, pb + 4 + states_per_element + pb, "ZeRO-3 partition bytes");
    return detail::add(held, graph::DataParallel::zero_bucket_bytes(pb), "persistent bytes");
  }
  if (is_zero(r.parallel)) {
    // ZeRO-1/2 (See Note [DeepSpeed ZeRO-1/2] in graph/zero.cpp): the flat 16-bit (or fp32) group
    // is whole on every rank, and from step 1 on so are this rank's fp32 master partition and
    // the states the torch optimizer keeps for it, each at least 1/gpus of the parameters (the
    // padded partition is never smaller). On top of them step 2 holds, at different moments, the
    // ipg bucket (its backward, a fixed reduce_bucket_size) and the partition's fp32 gradient
    // (its optimizer step, single_grad_partition; the model's .grads were cleared by then): the
    // larger of the two.
    const std::uint64_t partition = n / r.gpus;
    const std::uint64_t bucket = graph::DataParallel::zero_bucket_bytes(pb);
    // ZeRO-Offload keeps only the flat group and the bucket on the GPU (See Note [ZeRO-Offload]).
    if (r.offload == Offload::kOptimizer) return detail::add(weights, bucket, "persistent bytes");
    const std::uint64_t held = detail::add(weights, detail::mul(partition, 4 + states_per_element, "ZeRO partition bytes"),
                                           "persistent bytes");
    return detail::add(held, std::max(bucket, detail::mul(partition, 4, "ZeRO gradient bytes")), "persistent bytes");
  }
  // DDP: the Reducer's buckets, a second copy of the gradients (Note [DDP buckets] in
  // graph/parallel.cpp). FSDP2: every rank holds at least 1/gpus of the parameters, gradients and
  // states (padded shards are never smaller); HSDP shards over its shard group only. A param_dtype
  // policy keeps fp32 shards, gradients and states (the precision is fp32).
  const std::uint64_t buckets = r.parallel == Parallel::kDdp ? detail::mul(n, pb, "bucket bytes") : 0;
  const std::uint64_t shards = r.parallel == Parallel::kFsdp ? r.gpus / r.fsdp.replicate : 1;
  // Every parameter's .grad (in the parameter's dtype) exists when the optimizer step starts.
  std::uint64_t extra = detail::mul(n, pb, "gradient bytes");
  if (r.precision == Precision::kBf16Master) extra = detail::add(extra, detail::mul(n, 4, "master bytes"), "master bytes");
  extra = detail::add(extra, detail::mul(n, states_per_element, "state bytes"), "state bytes");
  return detail::add(detail::add(weights, extra, "persistent bytes") / shards, buckets, "persistent bytes");
}

const std::vector<std::string>& fit_knobs() {
  static const std::vector<std::string> kKnobs = {"batch", "precision", "optimizer", "checkpointing",
                                                  "attention", "loss", "allocator", "parallel",
                                                  "offload"};
  return kKnobs;
}

FitResult fit(const Model& model, const FitRequest& q) {
  q.base.validate();
  if (q.base.mode != Mode::kTraining) throw Error("mode: fit plans training recipes; estimate a generation with `estimate --inference`");
  if (q.base.tp != 1) {
    throw Error("tp: fit does not search tensor parallelism yet; estimate a tensor-parallel recipe with "
                "`estimate --tp N`");
  }
  const Gpu& gpu = find_gpu(q.base.gpu);
  if (gpu.capacity_bytes == 0) throw Error("gpu: 'cpu' has no memory to plan for; name a GPU (trainmem gpus)");
  if (q.top < 1 || q.top > 1000) throw Error("top: must be between 1 and 1000, got " + std::to_string(q.top));
  for (const std::string& k : q.fixed) {
    if (std::find(fit_knobs().begin(), fit_knobs().end(), k) == fit_knobs().end()) {
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

  Planner planner(model);

  // The user's recipe as given, at the global batch asked for; on several GPUs data-parallel
  // (DDP unless the recipe names the wrapper).
  Recipe base = q.base;
  base.gpus = q.gpus;
  if (q.gpus > 1 && base.parallel == Parallel::kNone) base.parallel = Parallel::kDdp;
  base.validate();
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
  out.baseline = judged(planner.replay(base), out.capacity_bytes);

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
  const auto optimizers = values(q, "optimizer", base.optimizer,
                                 {Optimizer::kAdamWFused, Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kAdafactor});
  const auto ckpts = values(q, "checkpointing", base.checkpointing, {Checkpointing::kNone, Checkpointing::kFull});
  const auto losses = values(q, "loss", base.loss, {Loss::kStandard, Loss::kFused});
  const auto allocators = values(q, "allocator", base.allocator, {AllocatorMode::kDefault, AllocatorMode::kExpandable});
  // ZeRO-1/2/3 only where the recipe validation takes them (fp32 or bf16-master, a torch AdamW or
  // SGD, the standard loss): other combinations are skipped below, like every invalid recipe.
  const auto parallels =
      q.gpus > 1 ? values(q, "parallel", base.parallel,
                          {Parallel::kFsdp, Parallel::kDdp, Parallel::kZero1, Parallel::kZero2, Parallel::kZero3})
                 : std::vector<Parallel>{base.parallel};
  // DeepSpeed's offload_optimizer where a ZeRO recipe takes it (AdamW: DeepSpeedCPUAdam).
  const auto offloads = values(q, "offload", base.offload, {Offload::kNone, Offload::kOptimizer});

  struct Candidate {
    Recipe r;
    StepTime t;
    std::uint64_t floor = 0;
  };
  // The space on one GPU, fastest first there (precisions by what the GPU supports).
  auto space_on = [&](const Gpu& g) {
    const std::vector<Precision> precisions = values(
        q, "precision", base.precision,
        g.bf16 ? std::vector<Precision>{Precision::kBf16Mixed, Precision::kBf16True, Precision::kBf16Master, Precision::kFp32}
               : std::vector<Precision>{Precision::kFp16Mixed, Precision::kFp32});
    std::vector<Candidate> out_space;
    for (std::uint64_t b : batches) {
      for (Precision p : precisions) {
        for (Optimizer o : optimizers) {
          for (Checkpointing c : ckpts) {
            for (Loss l : losses) {
              for (Parallel dp : parallels) {
                Recipe r = base;
                r.gpu = g.name;
                r.batch = b;
                r.grad_accum = per_gpu / b;
                r.precision = p;
                r.optimizer = o;
                r.checkpointing = c;
                r.loss = l;
                r.parallel = dp;
                if (dp != Parallel::kFsdp) r.fsdp = Fsdp{};  // FSDP2's knobs belong to fsdp alone
                r.allocator = allocators.front();
                for (Offload off : offloads) {
                  r.offload = off;
                  if (!valid(r)) continue;
                  out_space.push_back({r, step_time(model, r), plan::persistent_floor(model, r)});
                }
              }
            }
          }
        }
      }
    }
    std::stable_sort(out_space.begin(), out_space.end(),
                     [](const Candidate& a, const Candidate& b) { return a.t.seconds < b.t.seconds; });
    return out_space;
  };
  const std::vector<Candidate> space = space_on(gpu);
  out.searched = space.size() * allocators.size();

  const std::uint64_t usable = out.capacity_bytes;
  // Probes run kWindow at a time, in parallel; a fixed window keeps every count the same on any
  // machine (a window can probe a few recipes past the last plan).
  constexpr std::size_t window = 4;
  // Probes stop once reserved bytes pass the usable memory: exact about fitting, and most of the
  // fastest recipes do not fit.
  for (std::size_t i = 0; i < space.size() && out.plans.size() < q.top; ++i) {
    const Candidate& c = space[i];
    if (i % window == 0) {  // the next window's first probes, in parallel
      std::vector<Recipe> next;
      for (std::size_t k = i; k < std::min(space.size(), i + window); ++k) {
        if (space[k].floor <= usable) next.push_back(space[k].r);
      }
      planner.prefetch(next, usable);
    }
    if (c.floor > usable) {
      out.pruned += allocators.size();
      continue;
    }
    for (AllocatorMode a : allocators) {
      Recipe r = c.r;
      r.allocator = a;
      const Plan p = judged(planner.probe(r, usable), usable);
      if (p.fits) {
        out.plans.push_back(p);
        break;
      }
    }
  }

  if (out.plans.empty()) {
    // The closest miss: every recipe the floor did not rule out, replayed to the end (the
    // probes only said "too big"); when the floor ruled out everything, the smallest floor.
    std::vector<Recipe> all;
    for (const Candidate& c : space) {
      if (c.floor > usable) continue;
      for (AllocatorMode a : allocators) {
        Recipe r = c.r;
        r.allocator = a;
        all.push_back(r);
      }
    }
    for (std::size_t i = 0; i < all.size(); i += window) {
      planner.prefetch({all.begin() + static_cast<std::ptrdiff_t>(i),
                        all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), i + window))}, 0);
    }
    for (const Recipe& r : all) {
      const Plan p = judged(planner.replay(r), usable);
      if (!out.has_closest_miss || p.peak_reserved_bytes < out.closest_miss.peak_reserved_bytes) {
        out.closest_miss = p;
        out.has_closest_miss = true;
      }
    }
    if (!out.has_closest_miss && !space.empty()) {
      const Candidate* lo = &space.front();
      for (const Candidate& c : space) {
        if (c.floor < lo->floor) lo = &c;
      }
      Plan p;
      p.recipe = lo->r;
      p.time = lo->t;
      p.peak_allocated_bytes = p.peak_reserved_bytes = lo->floor;
      out.closest_miss = p;  // simulated false: a floor, the real peak is higher
      out.has_closest_miss = true;
    }
    // What it takes: on each catalog GPU with more memory, the fastest recipe of the space (timed
    // and with the precisions of that GPU) that fits there. The GPU is tried only if its
    // lowest-memory recipe fits (the smallest micro-batch, checkpointing and the fused loss when
    // they are searched, the smallest floor, either allocator); then the walk, fastest first,
    // ends at that recipe at the latest.
    for (const Gpu& g : gpus()) {
      if (g.capacity_bytes == 0 || g.usable_bytes() <= usable) continue;
      const std::uint64_t room = g.usable_bytes();
      const std::vector<Candidate> there = space_on(g);
      const Candidate* lowest = nullptr;
      for (const Candidate& c : there) {
        auto rank = [](const Candidate& x) {
          return std::tuple(x.r.batch, x.r.checkpointing != Checkpointing::kFull, x.r.loss != Loss::kFused, x.floor);
        };
        if (!lowest || rank(c) < rank(*lowest)) lowest = &c;
      }
      if (!lowest || lowest->floor > room) continue;
      auto fits_there = [&](const Candidate& c) -> std::optional<Plan> {
        if (c.floor > room) return std::nullopt;
        for (AllocatorMode a : allocators) {
          Recipe r = c.r;
          r.allocator = a;
          const Plan p = judged(planner.probe(r, room), room);
          if (p.fits) return p;
        }
        return std::nullopt;
      };
      if (!fits_there(*lowest)) continue;
      for (const Candidate& c : there) {
        if (auto p = fits_there(c)) {
          out.fits_on.push_back({g.name, *p});
          break;
        }
      }
    }
  }

  // ---- single changes of the user's recipe
  auto change = [&](std::string what, Recipe r) {
    if (!valid(r)) return;
    try {
      out.changes.push_back({std::move(what), judged(planner.replay(r), out.capacity_bytes)});
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
  if (base.gpus > 1) {
    for (Parallel dp : {Parallel::kDdp, Parallel::kFsdp, Parallel::kZero1, Parallel::kZero2, Parallel::kZero3}) {
      if (dp == base.parallel) continue;
      Recipe r = base;
      r.parallel = dp;
      if (dp != Parallel::kFsdp) r.fsdp = Fsdp{};
      std::string what = "parallel " + std::string(to_string(dp));
      // DeepSpeed's bf16 mode is bf16 weights over fp32 master partitions: a bf16 recipe moves to
      // it (recipe validation refuses the other bf16 policies under ZeRO).
      if (is_zero(dp) && (r.precision == Precision::kBf16Mixed || r.precision == Precision::kBf16True)) {
        r.precision = Precision::kBf16Master;
        what += ", precision bf16-master";
      }
      change(what, r);
    }
  }
  if (base.parallel == Parallel::kFsdp) {
    // FSDP2's reshard_after_forward on the layers: false (SHARD_GRAD_OP) skips the backward's
    // all-gathers and keeps every layer gathered from its forward to its backward.
    Recipe r = base;
    r.fsdp.reshard_after_forward = !base.fsdp.reshard_after_forward;
    change(std::string("fsdp_reshard_after_forward ") + (r.fsdp.reshard_after_forward ? "true" : "false"), r);
  }
  // CPU offload of the optimizer (Note [ZeRO-Offload]): on or off for a ZeRO recipe with AdamW.
  if (is_zero(base.parallel) && base.parallel != Parallel::kZero3 && base.optimizer == Optimizer::kAdamW) {
    Recipe r = base;
    r.offload = base.offload == Offload::kNone ? Offload::kOptimizer : Offload::kNone;
    change("offload " + std::string(to_string(r.offload)), r);
  }
  if (!base.lora.enabled() && base.parallel == Parallel::kNone) {
    Recipe r = base;
    r.lora.rank = 16;
    r.lora.targets = {"default"};
    if (r.precision == Precision::kBf16Master) r.precision = Precision::kBf16True;
    change("lora 16 (default targets; trains adapters only)", r);
  }
  if (!base.quant.enabled()) {
    // QLoRA: the same adapters (or LoRA 16) on a 4-bit nf4 base with double quant, in a
    // precision a 4-bit base runs with.
    Recipe r = base;
    if (!r.lora.enabled()) {
      r.lora.rank = 16;
      r.lora.targets = {"default"};
    }
    r.quant.load_in_4bit = true;
    r.quant.quant_type = QuantType::kNf4;
    r.quant.double_quant = true;
    if (r.precision == Precision::kBf16Master) {  // the one precision a 4-bit base has no counterpart of
      r.precision = gpu.bf16 ? Precision::kBf16True : Precision::kFp16True;
    }
    change(std::string(base.lora.enabled() ? "qlora" : "qlora 16 (default targets)") + ": nf4 base, double quant, " +
               std::string(to_string(r.precision)),
           r);
  }
  std::stable_sort(out.changes.begin(), out.changes.end(), [](const Change& a, const Change& b) {
    return a.plan.peak_reserved_bytes < b.plan.peak_reserved_bytes;
  });
  out.simulated = planner.recipes_replayed();
  return out;
}

}  // namespace trainmem
