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
//
// Note [Fewer replays]
// Two things cut replays without changing an answer (plan::fit_reference keeps the search
// without them; tests/cpp/test_plan.cpp compares every field of the two):
//  * a recipe is also ruled out by plan::loss_floor (Note [The loss floor]), a lower bound like
//    the persistent floor: weights, states and the fp32 logits the standard loss holds at once;
//  * when nothing fits, the closest miss is the recipe with the fewest reserved bytes (the first
//    of equals), so a replay may stop once it passes the closest one so far: a stopped replay
//    never wins and a complete one has the step's peaks. A recipe whose bound is above them is
//    not replayed. The recipes are the ones the persistent floor leaves, as before.
// Measured (bench/README.md), the replays they save are mostly cheap ones (probes that stop
// early): CPU time drops by less than the replay count. A window of probes (Note [Planner
// threads]) holds no more recipes than plans are still missing, so no probe lands past the last
// plan, and its expandable-segments probes are the ones of its recipes that did not fit with the
// default allocator: the walk probes exactly those next. (Running them in parallel with fixed
// windows of four had cost two more replays on 8 GPUs.)
// Only the counts (FitResult::simulated, pruned) change. ZeRO-1/2's ranks (Note [The worst rank]
// in estimate.cpp) are not deduplicated: their partitions are disjoint ranges of the flat group,
// so two ranks see alike parameters only when both lie inside one parameter (not done).
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <numeric>
#include <string>

#include "common/checked.h"
#include "estimate.h"
#include "graph/context_parallel.h"
#include "graph/parallel.h"
#include "graph/pipeline.h"
#include "graph/quant.h"
#include "graph/step.h"
#include "graph/tensor_parallel.h"
#include "plan/plan.h"

namespace trainmem {
namespace {

constexpr const char* kPpSearched =
    "pp: fit searches pipeline parallelism itself over --gpus (every degree that divides them, with data or "
    "tensor parallelism over the rest, where it is modelled); give the recipe without --pp";
constexpr const char* kCpSearched =
    "cp: fit searches context parallelism itself over --gpus (one ring over all of them, where it is modelled); "
    "give the recipe without --cp";

// Note [Planner threads]
// The planner's replays are independent and deterministic, so it runs them on a few threads that
// live as long as the search (Workers): a window's probes (Note [Search order]), the single
// changes, and the ranks of one recipe that estimate() would replay one after the other (Note [The
// worst rank] in estimate.cpp: a pipeline's stages, ZeRO-1/2's ranks). Each thread keeps the
// traces and replay states it pooled (Note [Pooled replay state] in sim/simulator.cpp); the
// search used to start a thread per probe (std::async), whose pools began empty every time, and
// paid for it in fresh pages (bench/README.md, "Planner threads"). A recipe's ranks are replayed as
// estimate() replays them and its worst rank picked by the same rule (detail::replayed_ranks,
// detail::worse_rank): a probe replays the first rank alone and the others only when it stayed
// under the limit (a stopped rank ends the probe: nothing after it can undo that; 1F1B's stage 0,
// which holds the most micro-batches in flight, is where the probes that stop stop), a full
// replay all of them at once. Ranks after a stopped one are never looked at, so nothing depends
// on the thread count or on the order threads finish in. plan::fit_reference keeps the plain
// estimate() of every recipe, one after the other, to compare against.
class Workers {
 public:
  // `threads` besides the caller, which runs jobs in wait() too.
  explicit Workers(std::size_t threads) {
    for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(m_);
      closing_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  // Queues a job (which may queue more); jobs must not throw.
  void add(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(m_);
      queue_.push_back(std::move(job));
      ++pending_;
    }
    cv_.notify_all();  // a worker, or the caller in wait()
  }

  // Runs queued jobs on the calling thread too, until every job queued so far and every job they
  // queued has finished.
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    while (true) {
      cv_.wait(lock, [this] { return pending_ == 0 || !queue_.empty(); });
      if (pending_ == 0) return;
      run_one(lock);
    }
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(m_);
    while (true) {
      cv_.wait(lock, [this] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closing, nothing left
      run_one(lock);
    }
  }

  void run_one(std::unique_lock<std::mutex>& lock) {
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    job();
    lock.lock();
    if (--pending_ == 0) cv_.notify_all();
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t pending_ = 0;
  bool closing_ = false;
  std::vector<std::thread> threads_;
};

// Threads for the planner besides the caller's: the machine's cores, at most 16 in all.
std::size_t worker_threads() {
  const std::size_t cores = std::thread::hardware_concurrency();
  return std::min<std::size_t>(cores, 16) - (cores > 0 ? 1 : 0);
}

// Replays for the planner, memoized by recipe. A probe may stop early (Note [Stopping early] in
// sim/simulator.cpp): it answers "does it fit under `limit`?" exactly, and its peaks are then only
// "more than the limit". A full replay always runs to the end. `reference`: every recipe is one
// estimate() on the caller's thread (plan::fit_reference).
class Planner {
 public:
  Planner(const Model& m, bool reference) : m_(m), reference_(reference) {
    if (!reference) workers_.emplace(worker_threads());
  }

  Plan replay(const Recipe& r) { return run(r, 0); }

  // Exact about peak_reserved_bytes <= limit; plan.complete says whether the peaks are the step's.
  Plan probe(const Recipe& r, std::uint64_t limit) { return run(r, limit); }

  // Probes (limit > 0) or replays (limit 0) the recipes not known yet, all at once on the
  // planner's threads (See Note [Planner threads]); probe() and replay() then find them. A recipe
  // the engine refuses throws when probe() or replay() asks for it.
  void prefetch(const std::vector<Recipe>& rs, std::uint64_t limit) {
    if (reference_) return;
    std::vector<std::unique_ptr<Pending>> todo;
    try {
      for (const Recipe& r : rs) {
        if (known(r, limit)) continue;
        if (std::any_of(todo.begin(), todo.end(), [&](const auto& t) { return key(t->r) == key(r); })) continue;
        todo.push_back(start(r, limit));
      }
    } catch (...) {
      workers_->wait();  // the queued jobs write into `todo`
      throw;
    }
    workers_->wait();
    for (const auto& t : todo) remember(*t);
  }

  // Distinct recipes replayed or probed (a probe later replayed to the end counts once; one
  // answered by its optimizer twin, Note [Optimizer twins], not at all).
  std::uint64_t recipes_replayed() const {
    return static_cast<std::uint64_t>(std::count_if(
        memo_.begin(), memo_.end(), [](const auto& kv) { return !kv.second.error && !kv.second.twin; }));
  }

 private:
  struct Known {
    Plan plan;
    std::uint64_t limit = 0;  // the stop limit it ran under (0: none)
    std::exception_ptr error;  // the engine refused the recipe
    bool twin = false;         // answered by an optimizer twin's probe, not replayed
  };
  // A probe that stopped before its optimizer step (Note [Optimizer twins]).
  struct TwinStop {
    std::uint64_t limit = 0;
    Plan plan;
  };

  // One recipe on the planner's threads: its ranks' estimates, filled in by the jobs.
  struct Pending {
    Recipe r;
    std::uint64_t limit = 0;
    bool requests_first = false;  // See Note [Requests that do not fit]
    std::vector<std::uint64_t> ranks;
    std::vector<std::optional<Estimate>> est;  // by position in `ranks`
    std::vector<std::exception_ptr> error;
  };

  // A complete replay answers everything; a stopped one says "peak > its limit", which answers a
  // probe with a limit no higher.
  // An optimizer twin's stop answers a probe too, and is remembered for `r` then.
  bool known(const Recipe& r, std::uint64_t limit) {
    const std::string k = key(r);
    const auto it = memo_.find(k);
    if (it != memo_.end() &&
        (it->second.error || it->second.plan.complete || (limit != 0 && limit <= it->second.limit))) {
      return true;
    }
    return from_twin(r, limit, k, it);
  }

  // See Note [Optimizer twins]: a twin of `r` stopped before its optimizer step under `limit` or
  // a higher limit, so `r` stops at the same event. `k` is key(r), `it` its memo entry or end.
  bool from_twin(const Recipe& r, std::uint64_t limit, const std::string& k,
                 std::map<std::string, Known>::iterator it) {
    if (limit == 0 || reference_ || !plan::optimizer_waits_for_its_step(r)) return false;
    const auto tw = twins_.find(twin_key(r));
    if (tw == twins_.end() || limit > tw->second.limit) return false;
    Known answer;
    answer.limit = tw->second.limit;
    answer.plan = tw->second.plan;
    answer.plan.recipe.optimizer = r.optimizer;
    answer.plan.time = step_time(m_, r);
    answer.twin = it == memo_.end() || it->second.twin;  // a replay of its own stays counted
    memo_[k] = std::move(answer);
    return true;
  }

  Plan run(const Recipe& r, std::uint64_t limit) {
    if (!known(r, limit)) {
      if (reference_) {
        EstimateOptions opt;
        opt.stop_above_reserved_bytes = limit;
        memo_[key(r)] = Known{plan_of(r, estimate(m_, r, opt)), limit, nullptr};  // a refusal throws, unremembered
      } else {
        const std::unique_ptr<Pending> t = start(r, limit);
        workers_->wait();
        remember(*t);
      }
    }
    const Known& k = memo_.at(key(r));
    if (k.error) std::rethrow_exception(k.error);
    return k.plan;
  }

  // Queues the estimates of `r`'s ranks (See Note [Planner threads]).
  std::unique_ptr<Pending> start(const Recipe& r, std::uint64_t limit) {
    auto t = std::make_unique<Pending>();
    t->r = r;
    t->limit = limit;
    t->ranks = detail::replayed_ranks(r);
    t->est.resize(t->ranks.size());
    t->error.resize(t->ranks.size());
    t->requests_first = requests_first(r, limit);
    Pending* p = t.get();
    auto job = [this, p](std::size_t i) {
      try {
        if (p->requests_first) {
          bool before_optimizer = false;
          const std::uint64_t requested =
              detail::peak_requested_bytes(m_, p->r, p->ranks[i], p->limit, &before_optimizer);
          if (requested > p->limit) {
            p->est[i] = stopped_by_requests(p->r, p->ranks[i], requested, before_optimizer);
            return;
          }
        }
        EstimateOptions opt;
        opt.stop_above_reserved_bytes = p->limit;
        if (p->ranks.size() > 1) opt.rank = static_cast<std::int64_t>(p->ranks[i]);
        p->est[i] = estimate(m_, p->r, opt);
      } catch (...) {
        p->error[i] = std::current_exception();
      }
    };
    if (limit == 0 || t->ranks.size() == 1) {
      for (std::size_t i = 0; i < t->ranks.size(); ++i) workers_->add([job, i] { job(i); });
    } else {
      workers_->add([this, job, p] {
        job(0);
        if (!p->est[0] || !p->est[0]->complete) return;  // refused or stopped: the answer is known
        for (std::size_t i = 1; i < p->ranks.size(); ++i) workers_->add([job, i] { job(i); });
      });
    }
    return t;
  }

  // Note [Requests that do not fit]
  // A probe under the expandable-segments allocator comes after the default allocator's probe of
  // the same recipe stopped above the same limit (Note [Search order]): the walk tries the
  // second allocator only where the first did not fit. Its replay costs more per event than the
  // default one's, and it almost always stops as well: the live tensors' requests themselves
  // pass the limit (llama-3.1-70b on 8 x h100-80gb: 212 of the 216 stopped pipeline probes). So
  // such a probe first sums the requests of each rank's trace as the graph stage builds it
  // (detail::peak_requested_bytes, a lower bound of the reserved bytes under any allocator: Note
  // [Requested bytes] in estimate.cpp) and stops once they pass the limit: the answer, "above the
  // limit", is the replay's, without the allocator. Where they stay under it the probe replays
  // as before. The stopped plan's peaks are the requests at the stop; the search reads a stopped
  // plan's "complete: false" only (the closest miss takes complete replays). One that stopped
  // before any optimizer event answers its optimizer twins as a replay's stop does (Note
  // [Optimizer twins]): they request the same until then. plan::fit_reference replays every
  // probe, and the Fit tests compare the answers.
  bool requests_first(const Recipe& r, std::uint64_t limit) const {
    if (limit == 0 || reference_ || r.pp == 1 || r.allocator != AllocatorMode::kExpandable) return false;
    Recipe first = r;
    first.allocator = AllocatorMode::kDefault;
    const auto it = memo_.find(key(first));
    return it != memo_.end() && !it->second.error && !it->second.plan.complete && it->second.limit >= limit;
  }

  // The Estimate of a probe the requests stopped. Its host bytes stay 0: the bound pass keeps no
  // trace, and pipelines offload nothing (recipe validation).
  Estimate stopped_by_requests(const Recipe& r, std::uint64_t rank, std::uint64_t requested,
                               bool before_optimizer) const {
    TRAINMEM_ASSERT(r.offload == Offload::kNone, "a probe stopped by its requests has no host memory");
    Estimate e;
    e.recipe = detail::resolved_for_model(m_, r);
    e.model = m_.name;
    e.parameters = m_.parameter_count;
    e.peak_allocated_bytes = requested;
    e.peak_reserved_bytes = requested;
    e.complete = false;
    e.stopped_before_optimizer = before_optimizer;
    e.rank = rank;
    return e;
  }

  // The estimate() of a finished Pending: the worst rank, as run_ranks picks it.
  void remember(const Pending& t) {
    Known k;
    k.limit = t.limit;
    const Estimate* best = nullptr;
    bool before_optimizer = false;  // the rank that stopped stopped before its optimizer step
    for (std::size_t i = 0; i < t.ranks.size(); ++i) {
      if (t.error[i]) {
        k.error = t.error[i];
        break;
      }
      const Estimate& e = *t.est[i];
      if (!best || detail::worse_rank(e, *best)) best = &e;
      if (!e.complete) {
        before_optimizer = e.stopped_before_optimizer;
        break;
      }
    }
    if (!k.error) k.plan = plan_of(t.r, *best);
    if (!k.error && !k.plan.complete && before_optimizer && plan::optimizer_waits_for_its_step(t.r)) {
      TwinStop& tw = twins_[twin_key(t.r)];  // See Note [Optimizer twins]
      if (t.limit > tw.limit) tw = TwinStop{t.limit, k.plan};
    }
    memo_[key(t.r)] = std::move(k);
  }

  Plan plan_of(const Recipe& r, const Estimate& e) const {
    Plan p;
    p.time = step_time(m_, r);
    p.recipe = e.recipe;  // LoRA targets resolved
    p.peak_allocated_bytes = e.peak_allocated_bytes;
    p.peak_reserved_bytes = e.peak_reserved_bytes;
    p.peak = e.peak;
    p.simulated = true;
    p.complete = e.complete;
    p.host_bytes = e.host.total_bytes();  // made at the wrap: known to a stopped probe too
    return p;
  }

  static std::string twin_key(Recipe r) {
    r.optimizer = Optimizer::kAdamW;
    return key(r);
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
    k += "/tp" + std::to_string(r.tp) + (r.sequence_parallel ? "sp" : "") + (r.loss_parallel ? "lp" : "");
    k += "/pp" + std::to_string(r.pp) + std::string(to_string(r.pp_schedule)) + "v" + std::to_string(r.pp_stages_per_rank);
    k += "/cp" + std::to_string(r.cp) + "/mask" + std::string(to_string(r.attention_mask));
    k += "/fsdp" + std::string(r.fsdp.reshard_after_forward ? "1" : "0") + std::to_string(r.fsdp.replicate) + "/" +
         std::string(to_string(r.fsdp.param_dtype)) + "/" + std::string(to_string(r.fsdp.reduce_dtype)) + "/" +
         std::string(to_string(r.offload)) + (r.fsdp.no_sync ? "/nosync" : "");
    for (const std::string& t : r.lora.targets) k += "/" + t;
    if (r.quant.enabled()) {
      k += "/4bit/" + std::string(to_string(r.quant.quant_type)) + (r.quant.double_quant ? "/dq" : "") + "/" +
           std::string(to_string(r.quant.storage)) + (r.quant.prepare_kbit_training ? "" : "/unprepared");
    }
    k += "/load" + std::string(to_string(r.load_dtype));
    k += std::string(r.ddp_find_unused_parameters ? "/unused" : "") + (r.ddp_gradient_as_bucket_view ? "/gradview" : "") +
         (r.ddp_no_sync ? "/nosync" : "") + (r.fp32_outputs ? "/fp32out" : "") + (r.use_cache ? "/cache" : "") +
         (r.clip_grad_norm ? "/clip" : "");
    return k;
  }

  const Model& m_;
  const bool reference_;
  std::optional<Workers> workers_;
  std::map<std::string, Known> memo_;
  std::map<std::string, TwinStop> twins_;  // by twin_key
};

// Whether a replayed plan fits `usable` bytes of the GPU (a stopped probe never does) and `host`
// bytes of host memory per rank (See Note [Host memory in the planner]).
Plan judged(Plan p, std::uint64_t usable, std::uint64_t host) {
  p.fits = p.complete && p.peak_reserved_bytes <= usable && p.host_bytes <= host;
  return p;
}

// The micro-batch "your recipe" runs `share` sequences in: `batch` when that takes at most kMaxAccum
// micro-batches, else the smallest larger one that divides `share` within the cap (a micro-batch
// the user did not give grows rather than the request failing); none when no micro-batch does.
std::optional<std::uint64_t> batch_within_accum(std::uint64_t share, std::uint64_t batch) {
  if (share % batch == 0 && share / batch <= kMaxAccum) return batch;
  const std::uint64_t hi = std::min(share, kMaxBatch);
  for (std::uint64_t b = std::max(batch + 1, share / kMaxAccum + (share % kMaxAccum != 0)); b <= hi; ++b) {
    if (share % b == 0) return b;
  }
  return std::nullopt;
}

bool fixed(const FitRequest& q, std::string_view knob) {
  return std::find(q.fixed.begin(), q.fixed.end(), knob) != q.fixed.end();
}

template <typename T>
std::vector<T> values(const FitRequest& q, std::string_view knob, T base, std::vector<T> all) {
  if (fixed(q, knob)) return {base};
  return all;
}

// Note [Pipeline schedule in the planner]
// A pipeline recipe of M micro-batches on N stages is searched with one schedule, never both:
//  * M >= N: Schedule1F1B. Its step time is GPipe's in the time model (both take M + N - 1
//    micro-batch slots, time.cpp), and it holds less: stage s keeps N - s micro-batches'
//    activations in flight where GPipe keeps all M (Note [Pipeline parallelism] in
//    graph/pipeline.cpp), so a GPipe plan would only repeat it, slower to fit.
//  * M < N: ScheduleGPipe, the only one torch runs there (Schedule1F1B refuses fewer micro-batches
//    than stages, recipe.cpp). That is where a small global batch over many GPUs lands.
// A 1F1B pipeline, on plain ranks or in DDP or FSDP2 replicas, is also searched as
// ScheduleInterleaved1F1B with two stages per GPU (Note [Interleaved pipeline schedules] and the
// Notes on it with DDP and FSDP2 in graph/pipeline.cpp), where its rounds rule and the layers allow: a bubble of (N - 1) / 2M instead of (N - 1) / M, for more memory (more warm-up
// forwards, every send kept to the end of the step). More stages per GPU shrink the bubble further
// and cost more still; ScheduleLoopedBFS has the same bubble in the model and holds more (every
// forward first). Neither is searched; the floor is the pipeline's (the rank's share of the
// persistent bytes, its stages together).

// Whether `check` goes through: the engine's refusals (trainmem::Error) as a yes / no.
template <typename F>
bool accepted(F&& check) {
  try {
    check();
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Whether a sequence that reaches the model's sliding window under SDPA lets `r`'s context
// parallelism through (graph/step.h).
bool window_modelled(const Model& m, const Recipe& r) {
  return accepted([&] { graph::check_sliding_window(m, r); });
}

// The model-dependent part of what the engine splits into stages (graph/pipeline.h).
bool pipeline_modelled(const Model& m, const Recipe& r) {
  return accepted([&] { graph::check_pipeline_model(m.arch, r); });
}

bool valid(const Recipe& r) {
  return !plan::plainly_refused(r) && accepted([&] { r.validate(); });
}

// Whether the engine models `r`'s context parallelism for this model (graph/context_parallel.h).
bool cp_modelled(const Model& m, const Recipe& r) {
  return accepted([&] { graph::check_context_parallel(m, r); }) && window_modelled(m, r);
}

// Whether the engine models `tp`-way tensor parallelism of this model (the family and the
// divisibility of heads, key/value heads and the MLP's width: Note [Tensor parallelism]).
bool tp_modelled(const Model& m, std::uint64_t tp) {
  return accepted([&] { (void)graph::tensor_parallel_model(m, tp); });
}

// Whether it also models sequence parallelism there (not for Gemma-2: Note [Tensor parallelism]).
bool sp_modelled(const Model& m, std::uint64_t tp) {
  return accepted([&] { (void)graph::tensor_parallel_model(m, tp, /*loss_parallel=*/false, /*sequence_parallel=*/true); });
}

// Whether it also models loss parallelism there (untied embeddings, a vocabulary divisible by tp:
// Note [Loss parallel] in graph/tensor_parallel.h).
bool lp_modelled(const Model& m, std::uint64_t tp) {
  return accepted([&] { (void)graph::tensor_parallel_model(m, tp, /*loss_parallel=*/true); });
}

// The floor of a recipe, on the model one rank holds: its local shards, counted as local elements
// (tensor_parallel_model keeps the DTensors' global parameter_count).
std::uint64_t rank_floor(const Model& m, const Recipe& r) {
  if (r.tp <= 1) return plan::persistent_floor(m, r);
  Model local = graph::tensor_parallel_model(m, r.tp, r.loss_parallel);
  local.parameter_count = 0;
  for (const ParameterGroup& g : local.parameters) local.parameter_count += g.numel * g.count;
  return plan::persistent_floor(local, r);
}

// The knobs of one wrapper dropped where the candidate runs another: FSDP2's outside fsdp, DDP's
// find_unused_parameters, gradient_as_bucket_view and no_sync outside a plain DDP, Accelerate's fp32
// outputs outside its native mixed precision (recipe validation refuses them there).
void keep_own_wrapper_knobs(Recipe& r) {
  // Accelerate's no_sync accumulation is the training loop's: it goes with whichever of DDP and
  // FSDP2 the candidate runs (the Trainer calls it for both).
  const bool no_sync = r.ddp_no_sync || r.fsdp.no_sync;
  if (r.parallel != Parallel::kFsdp) r.fsdp = Fsdp{};
  if (r.parallel != Parallel::kDdp || r.pp > 1) {
    r.ddp_find_unused_parameters = false;
    r.ddp_gradient_as_bucket_view = false;
    r.ddp_no_sync = false;
  }
  const bool plain = r.pp == 1 && r.cp == 1;  // no_sync is modelled outside pipelines and rings
  r.ddp_no_sync = no_sync && plain && r.parallel == Parallel::kDdp;
  r.fsdp.no_sync = no_sync && plain && r.tp == 1 && r.parallel == Parallel::kFsdp;
  // Accelerate's fp32 outputs go with its native mixed precision, on one GPU, DDP or FSDP2.
  r.fp32_outputs = r.fp32_outputs && fp32_outputs_modelled(r);
  // The Trainer's clip goes where it is modelled (DeepSpeed clips in its own step).
  r.clip_grad_norm = r.clip_grad_norm && clip_grad_norm_modelled(r);
  // A training forward's cache goes where transformers keeps it (not under checkpointing) and the
  // engine models it (Note [A cache in training]).
  r.use_cache = r.use_cache && r.checkpointing == Checkpointing::kNone && r.tp == 1 && r.pp == 1 && r.cp == 1;
  // A half load dtype goes with its autocast; any other precision loads the model in its own dtype
  // (bf16-true: bf16 again, without the autocast).
  if (r.load_dtype != LoadDtype::kAuto && r.precision != autocast_of(r.load_dtype)) r.load_dtype = LoadDtype::kAuto;
}

// `r` as a pipeline of `stages` stages, one per GPU (or per tensor-parallel group of r.tp: PP x TP,
// Note [Pipeline with tensor parallelism] in graph/pipeline.cpp), in `replicas` copies
// data-parallel under `wrapper` (DDP or FSDP2) when more than one (PP x DP, Notes [Pipeline with
// DDP] and [Pipeline with FSDP2]): every replica's stages run its share of the global batch in
// micro-batches of r.batch, with the schedule Note [Pipeline schedule in the planner] picks. The
// caller checks that replicas x r.batch divides the global batch. FSDP2 keeps its default knobs.
Recipe as_pipeline(Recipe r, std::uint64_t stages, std::uint64_t global_batch, std::uint64_t replicas = 1,
                   Parallel wrapper = Parallel::kDdp) {
  r.gpus = replicas;
  r.parallel = replicas > 1 ? wrapper : Parallel::kNone;
  r.fsdp = Fsdp{};
  r.offload = Offload::kNone;
  r.pp = stages;
  keep_own_wrapper_knobs(r);
  r.grad_accum = global_batch / replicas / r.batch;
  r.pp_schedule = r.grad_accum >= r.pp ? PipelineSchedule::k1F1B : PipelineSchedule::kGPipe;
  return r;
}

// `r` as `groups` tensor-parallel groups of `tp` GPUs (data-parallel under FSDP2 when more than
// one: TP x DP), each running its share of the global batch, in its own precision (what FSDP2 or
// a pipeline does not take is refused by the recipe's validation, and the change skipped).
Recipe as_tensor_parallel(Recipe r, std::uint64_t tp, std::uint64_t groups, std::uint64_t global_batch) {
  r.tp = tp;
  r.gpus = groups;
  r.parallel = groups > 1 ? Parallel::kFsdp : Parallel::kNone;
  r.fsdp = Fsdp{};
  r.offload = Offload::kNone;
  r.pp = 1;
  keep_own_wrapper_knobs(r);
  r.pp_schedule = Recipe{}.pp_schedule;
  r.grad_accum = global_batch / groups / r.batch;
  return r;
}

}  // namespace

namespace {

// The weights every rank holds for the whole run, before ZeRO-3 partitions them: the model in the
// precision's parameter dtype (a half-loaded LoRA model's: half), or a 4-bit base.
std::uint64_t weight_bytes(const Model& m, const Recipe& r) {
  const std::uint64_t pb = plan::parameter_bytes(r);
  std::uint64_t weights = 0;
  for (const ParameterGroup& g : m.parameters) {
    // A 4-bit base (Note [QLoRA]): the layers' linear weights packed, everything else fp32, or
    // bf16 again under DeepSpeed's bf16 mode (bf16-master: Note [QLoRA under ZeRO-1/2]), or half
    // without prepare_model_for_kbit_training (half_model()).
    const bool packed = r.quant.enabled() && g.matmul_weight && g.name.find(".N.") != std::string::npos;
    const std::uint64_t rest = r.quant.enabled() && r.precision != Precision::kBf16Master && !r.half_model() ? 4 : pb;
    const std::uint64_t one = packed ? graph::packed_4bit(g.numel, r.quant.double_quant, storage_dtype(r.quant.storage)).packed_bytes
                                     : detail::mul(g.numel, rest, "parameter bytes");
    weights = detail::add(weights, detail::mul(one, g.count, "parameter bytes"), "parameter bytes");
  }
  return weights;
}

// Optimizer states per trained element, in bytes (8-bit AdamW: two 1-byte states).
std::uint64_t state_bytes_per_element(const Recipe& r) {
  const std::uint64_t sb = plan::state_bytes(r);
  switch (r.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kAdamWFused: return 2 * sb;
    case Optimizer::kAdamW8bit: return 2;
    case Optimizer::kSgd: return sb;
    case Optimizer::kAdafactor: return 0;
  }
  return 0;
}

}  // namespace

// Note [Refusals the search skips]
// The search space is the product of every knob, and most of its ~20,000 combinations on several
// GPUs are recipes Recipe::validate refuses (CPU offload without ZeRO, ZeRO with a precision,
// optimizer or loss DeepSpeed's engine is not modelled with). Each refusal is an exception, ~5 us
// with its message: 0.1 s of a multi-GPU search (bench/README.md, "Planner threads"). These few
// refusals of recipe.cpp's validate_parallel and validate_offload are checked first, without one;
// every other combination still goes through validate(). Fit.PlainRefusalsAreRefusals checks
// that nothing validate() takes is refused here.
bool plan::plainly_refused(const Recipe& r) {
  const bool zero = is_zero(r.parallel);
  // validate_offload: FSDP2's CPUOffloadPolicy is all of it, without TP, PP or CP; otherwise offload
  // is DeepSpeed's, parameters only under ZeRO-3, the optimizer DeepSpeedCPUAdam.
  if (r.offload != Offload::kNone && r.parallel == Parallel::kFsdp) {
    if (r.offload != Offload::kBoth || r.tp > 1 || r.pp > 1 || r.cp > 1) return true;
  } else if (r.offload != Offload::kNone) {
    if (!zero) return true;
    if ((r.offload == Offload::kParams || r.offload == Offload::kBoth) && r.parallel != Parallel::kZero3) return true;
    if ((r.offload == Offload::kOptimizer || r.offload == Offload::kBoth) && r.optimizer != Optimizer::kAdamW) {
      return true;
    }
  }
  // validate_parallel, validate_tensor_parallel, validate_pipeline_parallel: ZeRO, tensor and
  // pipeline parallelism take a torch optimizer and the standard loss; ZeRO fp32 or bf16-master,
  // a pipeline no fp16-mixed.
  const bool torch_optimizer = r.optimizer == Optimizer::kAdamW || r.optimizer == Optimizer::kAdamWFused ||
                               r.optimizer == Optimizer::kSgd;
  if ((zero || r.tp > 1 || r.pp > 1) && (!torch_optimizer || r.loss != Loss::kStandard)) return true;
  if (zero && r.precision != Precision::kFp32 && r.precision != Precision::kBf16Master) return true;
  if (r.pp > 1 && r.precision == Precision::kFp16Mixed) return true;
  return false;
}

// Note [Optimizer twins]
// Recipes that differ only in their optimizer make the same events up to their first optimizer
// step: torch's optimizers (AdamW foreach and fused, SGD, Adafactor) and bitsandbytes' 8-bit
// AdamW on a CUDA device create their states lazily, at the first step(), and nothing before it
// asks which optimizer will run (Replay.StepsBeforeTheOptimizerDoNotDependOnIt compares the
// events of every wrapper the planner searches). Not so for 8-bit AdamW on the CPU, whose
// quantization maps exist from the optimizer's construction, nor for DeepSpeed ZeRO and its
// offload (not compared; left out). So when a probe stops before any optimizer event (the
// replay passed its limit in step 1's forward or backward: Estimate::stopped_before_optimizer),
// every twin of it would stop at the same event under that limit or a lower one: the planner
// answers them "too big" unreplayed. Most probes that stop do so there, on activations.
bool plan::optimizer_waits_for_its_step(const Recipe& r) {
  if (is_zero(r.parallel) || r.offload != Offload::kNone) return false;
  return r.optimizer != Optimizer::kAdamW8bit || find_gpu(r.gpu).name != "cpu";  // step.cpp's cuda_
}

std::uint64_t plan::persistent_floor(const Model& m, const Recipe& r) {
  const std::uint64_t pb = parameter_bytes(r);  // a half model trained whole: half gradients and buckets
  const std::uint64_t weights = weight_bytes(m, r);
  // FSDP2's CPUOffloadPolicy keeps nothing on the GPU between its all-gathers (Note [FSDP2 CPU
  // offload] in graph/parallel.cpp).
  if (r.parallel == Parallel::kFsdp && r.offload == Offload::kBoth) return 0;
  // Adapters and their states only add. FSDP2 and ZeRO-3 partition the frozen base too: each rank
  // holds at least 1/shards of it (Notes [LoRA under FSDP2] in graph/parallel.cpp and [LoRA under
  // ZeRO-3] in graph/zero3.cpp).
  if (r.lora.enabled()) {
    if (r.parallel == Parallel::kFsdp) return weights / (r.gpus / r.fsdp.replicate * r.cp);
    if (r.parallel == Parallel::kZero3) return weights / r.gpus;
    return weights;
  }
  const std::uint64_t n = m.parameter_count;
  const std::uint64_t states_per_element = state_bytes_per_element(r);
  if (r.parallel == Parallel::kZero3) {
    // ZeRO-3 (See Note [DeepSpeed ZeRO-3] in graph/zero3.cpp): from deepspeed.initialize on, every
    // rank holds its 16-bit (or fp32) partition, the fp32 master partition, the flat gradient
    // partitions in the model dtype and the ipg bucket, and from step 1 on the states of the
    // master partition; each partition is at least 1/gpus of the parameters (ceil per
    // parameter). Gathered parameters come and go: none are counted.
    // CPU offload moves the partitions (offload_param) or the masters, states and gradient
    // partitions (offload_optimizer) to the host (See Note [ZeRO-3 offload] in graph/zero3_offload.cpp).
    const std::uint64_t partition = n / r.gpus;
    const bool params_off = r.offload == Offload::kParams || r.offload == Offload::kBoth;
    const bool optimizer_off = r.offload == Offload::kOptimizer || r.offload == Offload::kBoth;
    const std::uint64_t per_element = (params_off ? 0 : pb) + (optimizer_off ? 0 : 4 + states_per_element + pb);
    const std::uint64_t held = detail::mul(partition, per_element, "ZeRO-3 partition bytes");
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
  // graph/parallel.cpp), the only one with gradient_as_bucket_view (the .grads are views of them:
  // Note [DDP gradient_as_bucket_view]). FSDP2: every rank holds at least 1/gpus of the parameters, gradients and
  // states (padded shards are never smaller); HSDP shards over its shard group only. A param_dtype
  // policy keeps fp32 shards, gradients and states (an fp32-loaded model's: fp32 or bf16-mixed).
  const std::uint64_t buckets =
      r.parallel == Parallel::kDdp && !r.ddp_gradient_as_bucket_view ? detail::mul(n, pb, "bucket bytes") : 0;
  // A pipeline's worst stage holds at least the average stage's share (Note [Pipeline split]),
  // its DDP buckets included: they hold the stage's own gradients (Note [Pipeline with DDP]).
  // Under context parallelism FSDP2 shards over gpus x cp ranks (Note [Context parallelism under FSDP2]).
  const std::uint64_t shards = r.parallel == Parallel::kFsdp ? r.gpus / r.fsdp.replicate * r.cp : r.pp;
  // Every parameter's .grad (in the parameter's dtype) exists when the optimizer step starts.
  std::uint64_t extra = detail::mul(n, pb, "gradient bytes");
  if (r.precision == Precision::kBf16Master) extra = detail::add(extra, detail::mul(n, 4, "master bytes"), "master bytes");
  extra = detail::add(extra, detail::mul(n, states_per_element, "state bytes"), "state bytes");
  if (r.pp > 1 && r.parallel == Parallel::kFsdp) {
    // PP x FSDP2 (Note [Pipeline with FSDP2] in graph/pipeline.cpp): the stage's shards, masters
    // and states are 1/shards of it, but its gradients stay whole (unsharded, in the compute
    // dtype) from the step's first backward to perform_reduce_grad, which runs after the states
    // exist. Whole gradients are counted at 2 bytes under a bf16 param_dtype policy (they may
    // become fp32 accumulations: the smaller of the two).
    const std::uint64_t whole_grad_bytes = r.fsdp.param_dtype == FsdpDtype::kBf16 ? 2 : pb;
    std::uint64_t sharded = detail::add(weights, extra, "persistent bytes");
    sharded -= detail::mul(n, pb, "gradient bytes");  // `extra` counted them once, in `pb`
    const std::uint64_t stage = detail::add(sharded / shards, detail::mul(n, whole_grad_bytes, "gradient bytes"),
                                            "persistent bytes");
    return stage / r.pp;
  }
  if (r.pp > 1) return detail::add(detail::add(weights, extra, "persistent bytes"), buckets, "persistent bytes") / r.pp;
  return detail::add(detail::add(weights, extra, "persistent bytes") / shards, buckets, "persistent bytes");
}

// Note [The loss floor]
// ForCausalLMLoss (StepBuilder::standard_loss, after transformers' loss_utils.py) upcasts the
// logits to fp32 (`up`; the logits themselves when they are fp32 already) and log_softmax writes
// its fp32 output while `up` is alive: 8 bytes per logit, micro-batch x seq x vocab of them, at
// one moment of every forward (the fused loss never makes full logits: nothing counted). In step
// 2's forward the weights (and bf16-master's fp32 masters) are alive, and so are the optimizer
// states made by step 1's step; the .grads are gone (optimizer.zero_grad sets them to None,
// graph/optimizer.cpp) except from the second micro-batch of a step on, which accumulates into
// the first one's. Only the single-GPU, full-parameter step is counted this way (the wrappers'
// shards, buckets and partitions come and go on their own schedule; LoRA counts its frozen
// weights only): every other recipe gets the persistent floor alone.
std::uint64_t plan::loss_floor(const Model& m, const Recipe& r) {
  // A pipeline stage may hold no loss, and a context-parallel rank only its own tokens' logits.
  if (r.loss != Loss::kStandard || r.mode != Mode::kTraining || r.gpus != 1 || r.parallel != Parallel::kNone ||
      r.tp != 1 || r.pp != 1 || r.cp != 1) {
    return 0;
  }
  const std::uint64_t logits = detail::mul({r.batch, r.seq, m.arch.vocab_size, 8}, "loss floor bytes");
  std::uint64_t held = weight_bytes(m, r);
  if (!r.lora.enabled()) {
    const std::uint64_t n = m.parameter_count;
    if (r.precision == Precision::kBf16Master) held = detail::add(held, detail::mul(n, 4, "master bytes"), "master bytes");
    held = detail::add(held, detail::mul(n, state_bytes_per_element(r), "state bytes"), "state bytes");
    if (r.grad_accum >= 2) {
      held = detail::add(held, detail::mul(n, parameter_bytes(r), "gradient bytes"), "gradient bytes");
    }
  }
  return detail::add(held, logits, "loss floor bytes");
}

const std::vector<std::string>& fit_knobs() {
  static const std::vector<std::string> kKnobs = {"batch", "precision", "optimizer", "checkpointing",
                                                  "attention", "loss", "allocator", "parallel",
                                                  "offload", "tp"};
  return kKnobs;
}

namespace {

// `r` training adapters (the QLoRA single change, Note [The adapter route]): LoRA rank 16 on
// peft's default targets unless it has adapters already, on an nf4 base with double quant when
// `qlora`. bf16-master stays only as DeepSpeed's bf16 mode, where an adapter recipe takes it
// (ZeRO-1/2 over a 4-bit base, any stage over LoRA); elsewhere it becomes the GPU's half precision.
Recipe with_adapters(Recipe r, bool qlora, const Gpu& gpu) {
  if (!r.lora.enabled()) {
    r.lora.rank = 16;
    r.lora.targets = {"default"};
  }
  if (qlora) {
    r.quant.load_in_4bit = true;
    r.quant.quant_type = QuantType::kNf4;
    r.quant.double_quant = true;
  }
  const bool deepspeed_bf16 = qlora ? r.parallel == Parallel::kZero1 || r.parallel == Parallel::kZero2
                                    : is_zero(r.parallel);
  if (r.precision == Precision::kBf16Master && !deepspeed_bf16) {
    r.precision = gpu.bf16 ? Precision::kBf16True : Precision::kFp16True;
  }
  return r;
}

// The data-parallel wrapper of the user's recipe on several GPUs when --parallel names none:
// FSDP2 over tensor-parallel groups (docs/parallelism.md "TP x DP"), DeepSpeed where the recipe
// offloads (ZeRO-3 for the parameters, ZeRO-2 for the optimizer alone: ZeRO-Offload as it is
// usually run), else DDP. The search itself tries every wrapper the recipe's knobs allow.
Parallel own_wrapper(const Recipe& r) {
  if (r.tp > 1) return Parallel::kFsdp;
  if (r.offload == Offload::kParams || r.offload == Offload::kBoth) return Parallel::kZero3;
  if (r.offload == Offload::kOptimizer) return Parallel::kZero2;
  return Parallel::kDdp;
}

// `reference`: the search as it was before Note [Fewer replays] (plan::fit_reference).
// `plans_only`: the walk alone, for the adapter route (Note [The adapter route]): no closest
// miss, no other GPUs, no single changes.
FitResult search(const Model& model, const FitRequest& q, bool reference, bool plans_only = false) {
  // Knobs the search chooses itself are refused before the recipe's own checks, which would
  // otherwise ask for what their values need (a pipeline's micro-batches, say).
  if (q.base.pp != 1) throw Error(kPpSearched);
  if (q.base.cp != 1) throw Error(kCpSearched);
  Recipe own = q.base;  // as given: on one GPU, where the wrapper is yet to be picked
  if (q.gpus > 1 && own.parallel == Parallel::kNone && own.offload != Offload::kNone) {
    if (fixed(q, "parallel")) {
      throw Error("offload: " + std::string(to_string(own.offload)) + " with --parallel none, which holds plain DDP on " +
                  std::to_string(q.gpus) + " GPUs: DDP offloads nothing; leave --parallel out and the planner "
                  "searches the wrappers that offload");
    }
    own.parallel = own_wrapper(own);  // offload is checked with its wrapper
  }
  own.validate();
  if (q.base.mode != Mode::kTraining) throw Error("mode: fit plans training recipes; estimate a generation with `estimate --inference`");
  if (q.gpus < 1 || q.gpus > kMaxGpus) {
    throw Error("gpus: must be between 1 and " + std::to_string(kMaxGpus) + ", got " + std::to_string(q.gpus));
  }
  if (q.base.tp > 1 && q.gpus % q.base.tp != 0) {
    throw Error("tp: " + std::to_string(q.base.tp) + " does not divide gpus " + std::to_string(q.gpus) +
                ": the planner splits the GPUs into tensor-parallel groups of tp, data-parallel over the groups");
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
  if (q.host_memory_bytes == 0) {
    throw Error("host_memory: must be more than 0 bytes of host memory per GPU (default " +
                std::to_string(kDefaultHostMemoryBytes >> 30) + " GiB)");
  }
  // Note [Host memory in the planner]
  // CPU offload moves model states into host RAM (Estimate::host: Note [ZeRO-Offload] in
  // graph/zero_offload.cpp, Note [ZeRO-3 offload] in graph/zero3_offload.cpp). The planner holds
  // every plan to a host budget per GPU's rank as it holds it to the GPU's usable memory: a plan
  // fits only if its rank's host bytes (pinned blocks as the CachingHostAllocator rounds them,
  // plus pageable) are within FitRequest::host_memory_bytes. Per rank and not per node: the
  // catalog knows no node layout, and every rank of a data-parallel step holds about the same.
  // Host memory that the framework needs without offload (the Python process, the dataloader,
  // the checkpoint loaded before the wrap) is not modelled and not counted.
  const std::uint64_t host = q.host_memory_bytes;
  out.host_capacity_bytes = host;
  // Note [A global batch that does not split over the GPUs]
  // Data parallelism gives every GPU global_batch / gpus sequences, so it needs the global batch
  // to divide. A pipeline over every GPU, a tensor-parallel group of every GPU and a
  // context-parallel ring over every GPU are one data-parallel rank that runs the whole global
  // batch, so they take any global batch (smaller groups, replicas and context-parallel rings
  // under FSDP2 where their count divides it). When it does not divide, the search keeps those and
  // leaves data parallelism out; a data-parallel
  // recipe of the user's becomes its pipeline counterpart as the baseline (pp = gpus, the user's
  // micro-batch, the schedule as the search would pick it), or its tensor-parallel one where the
  // engine does not model the pipeline, and the text output says so.
  const bool dp_splits = out.global_batch % q.gpus == 0;
  const std::uint64_t per_gpu = dp_splits ? out.global_batch / q.gpus : 0;

  Planner planner(model, reference);

  // The user's recipe as given, at the global batch asked for; on several GPUs data-parallel
  // (DDP unless the recipe names the wrapper).
  // A tensor-parallel recipe (tp = --gpus) is one data-parallel rank: it runs the global batch; with
  // tp below --gpus the gpus / tp groups are data-parallel under FSDP2 (docs/parallelism.md
  // "TP x DP"), each running its share.
  Recipe base = q.base;
  base.gpus = q.gpus / q.base.tp;
  if (base.gpus > 1 && base.parallel == Parallel::kNone) base.parallel = own_wrapper(q.base);
  base.validate();
  if (q.base.tp > 1 && base.gpus > 1 && out.global_batch % base.gpus != 0) {
    throw Error("global_batch: " + std::to_string(out.global_batch) + " sequences do not split over " +
                std::to_string(base.gpus) + " data-parallel groups of tp " + std::to_string(q.base.tp));
  }
  if (!dp_splits && q.base.tp == 1) {
    // See Note [A global batch that does not split over the GPUs].
    auto no_split = [&](const std::string& why) {
      return Error("global_batch: " + std::to_string(out.global_batch) + " sequences do not split over " +
                   std::to_string(q.gpus) + " data-parallel GPUs, and " + why);
    };
    if (fixed(q, "parallel")) throw no_split("the --parallel given keeps the data-parallel wrapper");
    if (!fixed(q, "batch")) {  // a pipeline or tensor-parallel group over them runs the whole global batch
      base.batch = batch_within_accum(out.global_batch, base.batch).value_or(base.batch);
    }
    if (out.global_batch % base.batch != 0) {
      throw no_split("a pipeline or tensor-parallel group over them runs it in micro-batches of " +
                     std::to_string(base.batch) + ", which do not divide it either");
    }
    const Recipe pr = as_pipeline(base, q.gpus, out.global_batch);
    const Recipe tr = as_tensor_parallel(base, q.gpus, 1, out.global_batch);
    if (pr.grad_accum > kMaxAccum) {
      throw no_split("a pipeline or tensor-parallel group over them needs grad_accum " +
                     std::to_string(pr.grad_accum) + " at batch " + std::to_string(base.batch) + "; more than " +
                     std::to_string(kMaxAccum));
    }
    if (valid(pr) && pipeline_modelled(model, pr)) {
      base = pr;
    } else if (q.gpus <= 64 && tp_modelled(model, q.gpus) && valid(tr)) {
      base = tr;
    } else {
      throw no_split("the engine models this recipe neither as a pipeline nor as tensor parallelism over " +
                     std::to_string(q.gpus) + " GPUs (docs/parallelism.md)");
    }
    out.baseline_moved = true;
  }
  const std::uint64_t base_per_rank = base.pp > 1 ? out.global_batch : out.global_batch / base.gpus;
  if (base.batch * base.grad_accum != base_per_rank) {
    if (base_per_rank % base.batch != 0) {
      throw Error("global_batch: " + std::to_string(out.global_batch) + " is not a multiple of batch " +
                  std::to_string(base.batch) +
                  (base.pp == 1 && base.gpus > 1
                       ? " times the " + std::to_string(base.gpus) + " data-parallel ranks (" +
                             std::to_string(base_per_rank) + " each)"
                       : std::string()));
    }
    if (!fixed(q, "batch")) base.batch = batch_within_accum(base_per_rank, base.batch).value_or(base.batch);
    base.grad_accum = base_per_rank / base.batch;
    if (base.grad_accum > kMaxAccum) {
      throw Error("global_batch: needs grad_accum " + std::to_string(base.grad_accum) + " at batch " +
                  std::to_string(base.batch) + "; more than " + std::to_string(kMaxAccum) +
                  (fixed(q, "batch") ? std::string()
                                     : ", and no micro-batch up to " + std::to_string(kMaxBatch) +
                                           " splits it into " + std::to_string(kMaxAccum) + " or fewer"));
    }
  }
  out.batch_grown = base.batch != q.base.batch;
  out.baseline = judged(planner.replay(base), out.capacity_bytes, host);

  // ---- the search space (Note [Search order])
  // Micro-batches reaching `per_rank` sequences per data-parallel rank.
  auto batches_for = [&](std::uint64_t per_rank) {
    std::vector<std::uint64_t> bs;
    if (fixed(q, "batch")) {
      if (per_rank % base.batch == 0 && per_rank / base.batch <= kMaxAccum) bs = {base.batch};
      return bs;
    }
    for (std::uint64_t b = 1; b <= per_rank; b *= 2) {
      if (per_rank % b == 0 && per_rank / b <= kMaxAccum) bs.push_back(b);
    }
    if (per_rank % base.batch == 0 && std::find(bs.begin(), bs.end(), base.batch) == bs.end()) {
      bs.push_back(base.batch);
    }
    return bs;
  };
  const std::vector<std::uint64_t> batches = dp_splits ? batches_for(per_gpu) : std::vector<std::uint64_t>{};
  // Tensor-parallel degrees: 1 (data parallelism over the GPUs, or one GPU) and, for a model the
  // engine models under tensor parallelism, every divisor t of the GPUs up to 64 that the model's
  // heads and widths divide: t = --gpus is one tensor-parallel group (with and without sequence
  // parallelism), t below it gpus / t groups data-parallel under FSDP2 (TP x DP, docs/parallelism.md).
  std::vector<std::uint64_t> tp_degrees;  // above 1: also the single changes' (below)
  for (std::uint64_t t = 2; t <= std::min<std::uint64_t>(q.gpus, 64); ++t) {
    if (q.gpus % t == 0 && tp_modelled(model, t)) tp_degrees.push_back(t);
  }
  // Pipeline degrees: every divisor P > 1 of the GPUs the model has layers for, P = --gpus one
  // pipeline over all of them, P below it --gpus / P replicas of it under DDP or FSDP2 (PP x DP),
  // or of a pipeline of tensor-parallel groups (PP x TP: P x T dividing them).
  std::vector<std::uint64_t> pp_degrees;
  for (std::uint64_t p = 2; p <= q.gpus; ++p) {
    if (q.gpus % p == 0 && p <= model.arch.num_layers) pp_degrees.push_back(p);
  }
  // `r` as a pipeline of `stages` stages (each over r.tp GPUs) in --gpus / (stages x r.tp)
  // replicas under `wrapper`, where its micro-batch splits every replica's share of the global
  // batch within kMaxAccum and the engine models it.
  auto pipeline_of = [&](const Recipe& r, std::uint64_t stages,
                         Parallel wrapper = Parallel::kDdp) -> std::optional<Recipe> {
    if (q.gpus % (stages * r.tp) != 0) return std::nullopt;
    const std::uint64_t replicas = q.gpus / stages / r.tp;
    if (out.global_batch % (replicas * r.batch) != 0 || out.global_batch / replicas / r.batch > kMaxAccum) {
      return std::nullopt;
    }
    Recipe pr = as_pipeline(r, stages, out.global_batch, replicas, wrapper);
    if (!valid(pr) || !pipeline_modelled(model, pr)) return std::nullopt;
    return pr;
  };
  // A 1F1B pipeline as ScheduleInterleaved1F1B over two stages per GPU, where the engine models it
  // (plain ranks, DDP or FSDP2 replicas, tensor-parallel stages; the rounds rule, two layers per
  // GPU at least).
  auto interleaved_of = [&](const Recipe& pr) -> std::optional<Recipe> {
    if (pr.pp_schedule != PipelineSchedule::k1F1B) return std::nullopt;
    Recipe ir = pr;
    ir.pp_schedule = PipelineSchedule::kInterleaved1F1B;
    ir.pp_stages_per_rank = 2;
    if (!valid(ir) || !pipeline_modelled(model, ir)) return std::nullopt;
    return ir;
  };
  // Note [Context parallelism in the planner]
  // One ring over every GPU (cp = --gpus: torch's context_parallel with no data-parallel mesh,
  // Note [Context parallelism] in graph/context_parallel.h): each GPU holds the whole model and
  // runs seq / cp tokens of every sequence, and the ring is one data-parallel rank that runs the
  // whole global batch, like a pipeline over every GPU. What it is for: sequences whose
  // activations outgrow a GPU when the model states do not. Searched where the engine models it
  // (Llama-family SDPA, fp32 or a -true precision, the standard loss, seq divisible by 2 cp),
  // beside the data-parallel wrappers, with the floor of one GPU's model states. It is mirrored
  // from the source, not measured (docs/parallelism.md), and the plans say so.
  // Smaller rings compose with FSDP2 (Note [Context parallelism under FSDP2] in
  // graph/context_parallel.h): for every power-of-two cp that divides the GPUs, gpus / cp
  // data-parallel groups of cp-GPU rings, sharded over all the GPUs, each group running its share
  // of the global batch (which must split over the groups); FSDP2's knobs as the recipe has them
  // (HSDP excepted), else the defaults. cp = --gpus is one ring sharded over its own ranks
  // (torchtitan's layout for context parallelism alone), beside the unsharded ring above.
  auto cp_fsdp_of = [&](const Recipe& r, std::uint64_t cp) -> std::optional<Recipe> {
    const std::uint64_t groups = q.gpus / cp;
    if (groups < 1 || q.gpus % cp != 0 || out.global_batch % groups != 0) return std::nullopt;
    const std::uint64_t per_group = out.global_batch / groups;
    if (per_group % r.batch != 0 || per_group / r.batch > kMaxAccum) return std::nullopt;
    Recipe cr = r;
    cr.cp = cp;
    cr.gpus = groups;
    if (cr.parallel != Parallel::kFsdp) cr.fsdp = Fsdp{};
    cr.parallel = Parallel::kFsdp;
    keep_own_wrapper_knobs(cr);
    cr.fsdp.replicate = 1;
    cr.offload = Offload::kNone;
    cr.grad_accum = per_group / r.batch;
    if (!valid(cr) || !cp_modelled(model, cr)) return std::nullopt;
    return cr;
  };
  std::vector<std::uint64_t> cp_degrees;  // the rings under FSDP2: 2, 4, ... up to --gpus
  for (std::uint64_t c = 2; c <= q.gpus && c <= 64; c *= 2) {
    if (q.gpus % c == 0) cp_degrees.push_back(c);
  }
  auto context_parallel_of = [&](const Recipe& r) -> std::optional<Recipe> {
    if (q.gpus < 2 || q.gpus > 64 || out.global_batch % r.batch != 0 || out.global_batch / r.batch > kMaxAccum) {
      return std::nullopt;
    }
    Recipe cr = r;
    cr.cp = q.gpus;
    cr.gpus = 1;
    cr.parallel = Parallel::kNone;
    keep_own_wrapper_knobs(cr);
    cr.offload = Offload::kNone;
    cr.grad_accum = out.global_batch / r.batch;
    if (!valid(cr) || !cp_modelled(model, cr)) return std::nullopt;
    return cr;
  };
  std::vector<std::uint64_t> tps = {1};
  if (fixed(q, "tp")) tps = {q.base.tp};
  else tps.insert(tps.end(), tp_degrees.begin(), tp_degrees.end());
  if (dp_splits && batches.empty() && std::find(tps.begin(), tps.end(), std::uint64_t{1}) != tps.end()) {
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
  // DeepSpeed's offload_optimizer where a ZeRO recipe takes it (AdamW: DeepSpeedCPUAdam), and
  // ZeRO-3's offload_param alone or with it; FSDP2's CPUOffloadPolicy (both); the recipe
  // validation skips the rest.
  const auto offloads =
      values(q, "offload", base.offload, {Offload::kNone, Offload::kOptimizer, Offload::kParams, Offload::kBoth});

  struct Candidate {
    Recipe r;
    StepTime t;
    std::uint64_t floor = 0;  // persistent_floor: also what the closest miss reports unreplayed
    std::uint64_t bound = 0;  // the best lower bound: rules the recipe out when above the memory
  };
  // The space on one GPU, fastest first there (precisions by what the GPU supports).
  auto space_on = [&](const Gpu& g) {
    const std::vector<Precision> precisions = values(
        q, "precision", base.precision,
        g.bf16 ? std::vector<Precision>{Precision::kBf16Mixed, Precision::kBf16True, Precision::kBf16Master, Precision::kFp32}
               : std::vector<Precision>{Precision::kFp16Mixed, Precision::kFp32});
    std::vector<Candidate> out_space;
    for (std::uint64_t tp : tps) {
      // A tensor-parallel group of all the GPUs is one data-parallel rank: no wrapper, the
      // global batch. Smaller groups are data-parallel under FSDP2 and run their share of it.
      // Either with and without sequence and loss parallelism (docs/parallelism.md "TP × DP").
      const std::uint64_t groups = q.gpus / tp;
      if (tp > 1 && out.global_batch % groups != 0) continue;
      // A held wrapper holds for tensor-parallel groups too: one group has none, several run under
      // FSDP2 (the user's wrapper: base turns a held none on several GPUs into ddp).
      const Parallel tp_wrapper = groups == 1 ? Parallel::kNone : Parallel::kFsdp;
      if (tp > 1 && fixed(q, "parallel") && q.base.parallel != tp_wrapper) continue;
      const std::uint64_t per_rank = tp > 1 ? out.global_batch / groups : per_gpu;
      std::vector<std::uint64_t> tp_batches = tp > 1 ? batches_for(per_rank) : batches;
      // A pipeline stage runs the whole global batch (below), so its micro-batches reach past the
      // data-parallel ones: those go last, and make pipeline recipes only.
      const std::size_t dp_batches = tp_batches.size();
      // Pipelines and context-parallel rings offload nothing: a held offload keeps them out.
      const bool held_offload = fixed(q, "offload") && q.base.offload != Offload::kNone;
      const bool pipelines = tp == 1 && q.gpus > 1 && !fixed(q, "parallel") && !held_offload;
      const bool tp_pipelines = tp > 1 && q.gpus >= 2 * tp && !fixed(q, "parallel") && !held_offload;
      if (pipelines) {
        for (std::uint64_t b : batches_for(out.global_batch)) {
          if (std::find(tp_batches.begin(), tp_batches.end(), b) == tp_batches.end()) tp_batches.push_back(b);
        }
      }
      const std::vector<Parallel> tp_parallels = tp == 1 ? parallels : std::vector<Parallel>{tp_wrapper};
      // Sequence parallelism likewise: searched where modelled, kept on when asked.
      std::vector<bool> sps{false};
      if (tp > 1 && base.sequence_parallel) sps = {true};
      else if (tp > 1 && sp_modelled(model, tp)) sps = {false, true};
      // Loss parallelism where the model takes it (See Note [Loss parallel]); kept on when asked.
      std::vector<bool> lps{false};
      if (tp > 1 && base.loss_parallel) lps = {true};
      else if (tp > 1 && lp_modelled(model, tp)) lps = {false, true};
      for (bool lp : lps)
      for (bool sp : sps) {
        for (std::size_t bi = 0; bi < tp_batches.size(); ++bi) {
          const std::uint64_t b = tp_batches[bi];
          for (Precision p : precisions) {
            for (Optimizer o : optimizers) {
              for (Checkpointing c : ckpts) {
                for (Loss l : losses) {
                  for (Parallel dp : tp_parallels) {
                    Recipe r = base;
                    r.gpu = g.name;
                    r.tp = tp;
                    r.sequence_parallel = sp;
                    r.loss_parallel = lp;
                    r.gpus = groups;  // a TP base at tp 1: its data-parallel counterpart
                    r.pp = 1;         // a moved baseline's pipeline (the pipeline rows are below)
                    r.pp_schedule = Recipe{}.pp_schedule;
                    r.pp_stages_per_rank = 1;
                    r.batch = b;
                    r.grad_accum = per_rank / b;
                    r.precision = p;
                    r.optimizer = o;
                    r.checkpointing = c;
                    r.loss = l;
                    r.parallel = dp;
                    if (tp == 1 && r.gpus > 1 && dp == Parallel::kNone) r.parallel = Parallel::kDdp;
                    keep_own_wrapper_knobs(r);  // FSDP2's knobs belong to fsdp alone, find_unused to ddp
                    r.allocator = allocators.front();
                    for (Offload off : offloads) {
                      r.offload = off;
                      if (bi >= dp_batches || !valid(r)) continue;
                      const std::uint64_t floor = rank_floor(model, r);
                      out_space.push_back({r, step_time(model, r), floor,
                                           reference ? floor : std::max(floor, plan::loss_floor(model, r))});
                    }
                    // Pipeline parallelism over every GPU (Note [Pipeline parallelism] in
                    // graph/pipeline.cpp): one stage per GPU, each stage sees the whole global batch
                    // as grad_accum micro-batches of b; searched with the other wrappers, where the
                    // recipe and the model take it. One schedule per recipe, Note [Pipeline schedule
                    // in the planner].
                    // Pipelines over fewer GPUs are replicated under DDP, each replica running its
                    // share of the global batch.
                    // Pipelines over fewer GPUs are replicated under DDP or FSDP2 (Note [Pipeline
                    // with FSDP2]: the stages' states sharded, their gradients whole).
                    // A tensor-parallel group is a pipeline stage too (PP x TP, Note [Pipeline with
                    // tensor parallelism]), with FSDP2 replicas only (DDP over a tensor-parallel
                    // model is not modelled), on the group's local model.
                    // One context-parallel ring over every GPU (Note [Context parallelism in the planner]).
                    if (pipelines && dp == parallels.front()) {
                      if (const auto cr = context_parallel_of(r)) {
                        const std::uint64_t cfloor = rank_floor(model, *cr);
                        out_space.push_back({*cr, step_time(model, *cr), cfloor, cfloor});
                      }
                      for (std::uint64_t cp : cp_degrees) {
                        if (const auto cr = cp_fsdp_of(r, cp)) {
                          const std::uint64_t cfloor = rank_floor(model, *cr);
                          out_space.push_back({*cr, step_time(model, *cr), cfloor, cfloor});
                        }
                      }
                    }
                    if ((pipelines && dp == parallels.front()) || (tp_pipelines && dp == tp_parallels.front())) {
                      for (std::uint64_t stages : pp_degrees) {
                        const std::uint64_t replicas = q.gpus / stages / tp;
                        for (Parallel wrapper : {Parallel::kDdp, Parallel::kFsdp}) {
                          if (wrapper == Parallel::kFsdp && replicas <= 1) continue;  // no replicas to shard over
                          if (wrapper == Parallel::kDdp && tp > 1 && replicas > 1) continue;
                          if (const auto pr = pipeline_of(r, stages, wrapper)) {
                            const std::uint64_t pfloor = rank_floor(model, *pr);
                            out_space.push_back({*pr, step_time(model, *pr), pfloor, pfloor});
                            // Two stages per GPU (Note [Pipeline schedule in the planner]).
                            if (const auto ir = interleaved_of(*pr)) {
                              out_space.push_back({*ir, step_time(model, *ir), pfloor, pfloor});
                            }
                          }
                        }
                      }
                    }
                  }
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
  // Probes run a window at a time, all at once (Note [Planner threads]); a window is a fixed
  // count of recipes, not of threads, which keeps every count the same on any machine.
  constexpr std::size_t window = 4;
  // Probes stop once reserved bytes pass the usable memory: exact about fitting, and most of the
  // fastest recipes do not fit. A window holds the next recipes the bounds leave, as many as plans
  // are still missing and at most `window`: each recipe adds one plan at most, so the walk reaches
  // every one of them and no probe lands past the last plan. Their first allocator's probes go
  // first, then the next allocator's of those that did not fit, which the walk probes next.
  std::size_t prefetched = 0;  // space[0, prefetched) is in a window already
  for (std::size_t i = 0; i < space.size() && out.plans.size() < q.top; ++i) {
    const Candidate& c = space[i];
    if (i == prefetched && !reference) {
      std::vector<Recipe> next;
      const std::size_t want = std::min(window, q.top - out.plans.size());
      for (; prefetched < space.size() && next.size() < want; ++prefetched) {
        if (space[prefetched].bound <= usable) next.push_back(space[prefetched].r);
      }
      for (AllocatorMode a : allocators) {
        for (Recipe& r : next) r.allocator = a;
        planner.prefetch(next, usable);
        std::erase_if(next, [&](const Recipe& r) { return judged(planner.probe(r, usable), usable, host).fits; });
      }
    }
    if (c.bound > usable) {
      out.pruned += allocators.size();
      continue;
    }
    for (AllocatorMode a : allocators) {
      Recipe r = c.r;
      r.allocator = a;
      const Plan p = judged(planner.probe(r, usable), usable, host);
      if (p.fits) {
        out.plans.push_back(p);
        break;
      }
    }
  }

  // Found fastest first; recipes the step-time model times alike (autocast or not, say) are
  // listed by the memory they reserve, the smaller first (among the plans found: the walk stops
  // at `top`, so an equally fast recipe just past it is not looked at).
  std::stable_sort(out.plans.begin(), out.plans.end(), [](const Plan& a, const Plan& b) {
    if (a.time.seconds != b.time.seconds) return a.time.seconds < b.time.seconds;
    return a.peak_reserved_bytes < b.peak_reserved_bytes;
  });
  if (plans_only) {
    out.simulated = planner.recipes_replayed();
    return out;
  }
  if (out.plans.empty()) {
    // The closest miss: every recipe the floor did not rule out, replayed to the end (the
    // probes only said "too big"); when the floor ruled out everything, the smallest floor.
    // The same recipes as the walk's persistent floor left (the loss floor would change which
    // recipe comes closest); see Note [Fewer replays] for the stop limit.
    std::vector<Recipe> all;
    std::vector<std::uint64_t> bounds;
    for (const Candidate& c : space) {
      if (c.floor > usable) continue;
      for (AllocatorMode a : allocators) {
        Recipe r = c.r;
        r.allocator = a;
        all.push_back(r);
        bounds.push_back(c.bound);
      }
    }
    // The closest so far: only a recipe under its reserved bytes can take its place (ties keep
    // the earlier one), so later replays may stop above them.
    auto limit = [&]() -> std::uint64_t {
      return reference || !out.has_closest_miss ? 0 : out.closest_miss.peak_reserved_bytes;
    };
    for (std::size_t i = 0; i < all.size(); i += window) {
      const std::size_t end = std::min(all.size(), i + window);
      std::vector<Recipe> next;
      for (std::size_t k = i; k < end; ++k) {
        if (reference || !out.has_closest_miss || bounds[k] <= limit()) next.push_back(all[k]);
      }
      planner.prefetch(next, limit());
      for (std::size_t k = i; k < end; ++k) {
        if (!reference && out.has_closest_miss && bounds[k] > limit()) continue;  // its peak is higher still
        const Plan p = judged(limit() ? planner.probe(all[k], limit()) : planner.replay(all[k]), usable, host);
        if (!p.complete) continue;  // stopped above the closest so far
        if (!out.has_closest_miss || p.peak_reserved_bytes < out.closest_miss.peak_reserved_bytes) {
          out.closest_miss = p;
          out.has_closest_miss = true;
        }
      }
    }
    // The recipes that hold the least: by floor, or by what the activations take (the smallest
    // micro-batch, checkpointing and the fused loss where they are searched), each with the other
    // order breaking ties. Neither order decides which is lower, so both are kept.
    auto floor_first = [](const Candidate& x) {
      return std::tuple(x.floor, x.r.batch, x.r.checkpointing == Checkpointing::kNone, x.r.loss != Loss::kFused);
    };
    auto activations_first = [](const Candidate& x) {
      return std::tuple(x.r.batch, x.r.checkpointing == Checkpointing::kNone, x.r.loss != Loss::kFused, x.floor);
    };
    auto least = [](const std::vector<Candidate>& cs, auto rank) {
      const Candidate* lo = nullptr;
      for (const Candidate& c : cs) {
        if (!lo || rank(c) < rank(*lo)) lo = &c;
      }
      return lo;
    };
    if (!out.has_closest_miss && !space.empty()) {
      const Candidate* lo = least(space, floor_first);
      Plan p;
      p.recipe = detail::resolved_for_model(model, lo->r);  // as a replayed plan lists them
      p.time = lo->t;
      p.peak_allocated_bytes = p.peak_reserved_bytes = lo->floor;
      out.closest_miss = p;  // simulated false: a floor, the real peak is higher
      out.has_closest_miss = true;
    }
    // What it takes: on each catalog GPU with more memory, the fastest recipe of the space (timed
    // and with the precisions of that GPU) that fits there. The GPU is tried only if one of its
    // two least-holding recipes fits (above; either allocator); then the walk, fastest first, ends
    // at that recipe at the latest. (With the activations-first one alone, a wrapper that alone
    // takes the fused loss, DDP, was the gate and hid GPUs where FSDP2 fits.)
    for (const Gpu& g : gpus()) {
      if (g.capacity_bytes == 0 || g.usable_bytes() <= usable) continue;
      const std::uint64_t room = g.usable_bytes();
      const std::vector<Candidate> there = space_on(g);
      const Candidate* by_activations = least(there, activations_first);
      const Candidate* by_floor = least(there, floor_first);
      if (!by_activations) continue;
      auto fits_there = [&](const Candidate& c) -> std::optional<Plan> {
        if (c.bound > room) return std::nullopt;
        for (AllocatorMode a : allocators) {
          Recipe r = c.r;
          r.allocator = a;
          const Plan p = judged(planner.probe(r, room), room, host);
          if (p.fits) return p;
        }
        return std::nullopt;
      };
      if (!fits_there(*by_activations) && (by_floor == by_activations || !fits_there(*by_floor))) continue;
      for (const Candidate& c : there) {
        if (auto p = fits_there(c)) {
          out.fits_on.push_back({g.name, *p});
          break;
        }
      }
    }
  }

  // ---- single changes of the user's recipe, gathered first and then replayed all at once
  std::vector<std::pair<std::string, Recipe>> changes;
  auto change = [&](std::string what, Recipe r) {
    // Pipelines, tensor-parallel groups and rings offload nothing: the label says what is dropped.
    if (base.offload != Offload::kNone && r.offload == Offload::kNone && what.find("offload") == std::string::npos) {
      what += ", offload none";
    }
    keep_own_wrapper_knobs(r);
    if (valid(r)) changes.emplace_back(std::move(what), std::move(r));
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
    Recipe r = base;
    r.attention = a;
    // Gemma-2 runs eager either way (Note [Gemma-2's attention] in estimate.cpp): no change; nor
    // where the model refuses the backend (GPT-2's reorder_and_upcast_attn in half precision).
    if (accepted([&] { (void)detail::resolved_for_model(model, r); }) &&
        detail::resolved_for_model(model, r).attention != detail::resolved_for_model(model, base).attention) {
      change("attention " + std::string(to_string(a)), r);
    }
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
  // A pipeline's schedule follows its micro-batches as as_pipeline picks it (1F1B needs pp of
  // them, and with as many GPipe is not searched: Note [Pipeline schedule in the planner]).
  auto batch_change = [&](Recipe r) {
    std::string what = "batch " + std::to_string(r.batch) + " x grad_accum " + std::to_string(r.grad_accum);
    if (r.pp > 1 && (r.pp_schedule == PipelineSchedule::k1F1B || r.pp_schedule == PipelineSchedule::kGPipe)) {
      const PipelineSchedule s = r.grad_accum >= r.pp ? PipelineSchedule::k1F1B : PipelineSchedule::kGPipe;
      if (s != r.pp_schedule) what += ", pp_schedule " + std::string(to_string(s));
      r.pp_schedule = s;
    }
    change(what, r);
  };
  if (base.batch % 2 == 0 && base.grad_accum * 2 <= kMaxAccum) {
    Recipe r = base; r.batch /= 2; r.grad_accum *= 2;
    batch_change(r);
  }
  if (base.grad_accum % 2 == 0) {
    Recipe r = base; r.batch *= 2; r.grad_accum /= 2;
    batch_change(r);
  }
  if (base.parallel == Parallel::kDdp && base.pp == 1 && !base.ddp_find_unused_parameters) {
    // DDP's .grads as views of its buckets: one copy of the gradients instead of two (Note [DDP
    // gradient_as_bucket_view] in graph/parallel.cpp); the same work.
    Recipe r = base;
    r.ddp_gradient_as_bucket_view = !base.ddp_gradient_as_bucket_view;
    change(std::string("ddp_gradient_as_bucket_view ") + (r.ddp_gradient_as_bucket_view ? "true" : "false"), r);
  }
  if (base.parallel == Parallel::kDdp && base.pp == 1 && base.grad_accum > 1) {
    // One all-reduce per step instead of one per micro-batch (Note [DDP no_sync] in
    // graph/parallel.cpp); with gradient_as_bucket_view the .grads are held twice until the last.
    Recipe r = base;
    r.ddp_no_sync = !base.ddp_no_sync;
    change(std::string("ddp_no_sync ") + (r.ddp_no_sync ? "true" : "false"), r);
  }
  if (base.parallel == Parallel::kFsdp && base.pp == 1 && base.tp == 1 && base.cp == 1 && base.grad_accum > 1) {
    // One reduce-scatter per step, for unsharded gradients held through the accumulation (Note
    // [FSDP2 no_sync] in graph/parallel.cpp).
    Recipe r = base;
    r.fsdp.no_sync = !base.fsdp.no_sync;
    change(std::string("fsdp_no_sync ") + (r.fsdp.no_sync ? "true" : "false"), r);
  }
  if (base.gpus > 1) {
    for (Parallel dp : {Parallel::kDdp, Parallel::kFsdp, Parallel::kZero1, Parallel::kZero2, Parallel::kZero3}) {
      if (dp == base.parallel) continue;
      Recipe r = base;
      r.parallel = dp;
      keep_own_wrapper_knobs(r);
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
  // Tensor parallelism (Note [Tensor parallelism] in graph/tensor_parallel.h): all the GPUs in one
  // tensor-parallel group instead of data parallelism, or groups of t data-parallel under FSDP2
  // (TP x DP), for each degree the search takes; and sequence parallelism on or off.
  if (base.tp == 1 && q.gpus > 1) {
    for (std::uint64_t t : tp_degrees) {
      const std::uint64_t groups = q.gpus / t;
      if (out.global_batch % (groups * base.batch) != 0) continue;
      const Recipe r = as_tensor_parallel(base, t, groups, out.global_batch);
      const std::string what = groups > 1 ? "tp " + std::to_string(t) + " x fsdp " + std::to_string(groups)
                                          : "tp " + std::to_string(t) + " (no data parallelism)";
      if (r.grad_accum <= kMaxAccum) change(what, r);
    }
  }
  // Pipeline parallelism for a data-parallel recipe (Note [Pipeline schedule in the planner] picks
  // the schedule), where the engine models the pipeline: over every GPU, or over fewer in replicas
  // under DDP (PP x DP).
  if (base.tp == 1 && base.pp == 1 && q.gpus > 1) {
    for (std::uint64_t stages : pp_degrees) {
      const std::uint64_t replicas = q.gpus / stages;
      for (Parallel wrapper : {Parallel::kDdp, Parallel::kFsdp}) {
        if (wrapper == Parallel::kFsdp && replicas == 1) continue;
        const auto r = pipeline_of(base, stages, wrapper);
        if (!r) continue;
        const std::string what = "pp " + std::to_string(stages) + " " + std::string(to_string(r->pp_schedule));
        change(replicas > 1 ? what + " x " + std::string(to_string(wrapper)) + " " + std::to_string(replicas)
                            : what + " (no data parallelism)",
               *r);
        if (const auto ir = interleaved_of(*r)) {
          const std::string two = "pp " + std::to_string(stages) + " interleaved-1f1b, 2 stages per GPU";
          change(replicas > 1 ? two + " x " + std::string(to_string(wrapper)) + " " + std::to_string(replicas)
                              : two + " (no data parallelism)",
                 *ir);
        }
      }
    }
    // PP x TP: stages of tensor-parallel groups, FSDP2 over the replicas of the pipeline if any.
    for (std::uint64_t t : tp_degrees) {
      for (std::uint64_t stages : pp_degrees) {
        if (q.gpus % (stages * t) != 0) continue;
        const std::uint64_t replicas = q.gpus / stages / t;
        const Recipe tr = as_tensor_parallel(base, t, q.gpus / t, out.global_batch);
        const auto r = pipeline_of(tr, stages, Parallel::kFsdp);
        if (!r) continue;
        change("pp " + std::to_string(stages) + " " + std::string(to_string(r->pp_schedule)) + " x tp " +
                   std::to_string(t) + (replicas > 1 ? " x fsdp " + std::to_string(replicas) : ""),
               *r);
      }
    }
  }
  // Context parallelism: one ring over every GPU instead of data parallelism, or smaller rings
  // under FSDP2.
  // The ring runs fp32 or one half dtype: an autocast or master-weight recipe moves to its -true twin.
  if (base.tp == 1 && base.pp == 1 && q.gpus > 1) {
    Recipe cb = base;
    const bool fp16 = base.precision == Precision::kFp16Mixed;
    const bool moved = base.precision != Precision::kFp32 && base.precision != Precision::kBf16True &&
                       base.precision != Precision::kFp16True;
    if (moved) cb.precision = fp16 ? Precision::kFp16True : Precision::kBf16True;
    if (const auto r = context_parallel_of(cb)) {
      change("cp " + std::to_string(q.gpus) + " (one ring over every GPU, no data parallelism; unmeasured)" +
                 (moved ? ", precision " + std::string(to_string(cb.precision)) : std::string()),
             *r);
    }
    for (std::uint64_t cp : cp_degrees) {  // smaller rings under FSDP2
      if (const auto r = cp_fsdp_of(cb, cp)) {
        const std::string rings = r->gpus == 1 ? "one ring of " + std::to_string(cp) + " GPUs, sharded over it"
                                               : "rings of " + std::to_string(cp) + " GPUs, sharded over all";
        change("cp " + std::to_string(cp) + " x fsdp " + std::to_string(r->gpus) + " (" + rings + "; unmeasured)" +
                   (moved ? ", precision " + std::string(to_string(cb.precision)) : std::string()),
               *r);
      }
    }
  }
  if (base.tp > 1) {
    if (base.sequence_parallel || sp_modelled(model, base.tp)) {
      Recipe r = base;
      r.sequence_parallel = !base.sequence_parallel;
      change(std::string("sequence_parallel ") + (r.sequence_parallel ? "on" : "off"), r);
    }
    if (base.loss_parallel || lp_modelled(model, base.tp)) {
      Recipe l = base;
      l.loss_parallel = !base.loss_parallel;
      change(std::string("loss_parallel ") + (l.loss_parallel ? "on" : "off"), l);
    }
  }
  if (base.parallel == Parallel::kFsdp) {
    // FSDP2's reshard_after_forward on the layers: false (SHARD_GRAD_OP) skips the backward's
    // all-gathers and keeps every layer gathered from its forward to its backward.
    Recipe r = base;
    r.fsdp.reshard_after_forward = !base.fsdp.reshard_after_forward;
    change(std::string("fsdp_reshard_after_forward ") + (r.fsdp.reshard_after_forward ? "true" : "false"), r);
  }
  // CPU offload (Note [ZeRO-Offload], Note [ZeRO-3 offload], Note [FSDP2 CPU offload]): each other
  // setting a ZeRO or FSDP2 recipe takes (change() skips the invalid ones).
  if (is_zero(base.parallel) || base.parallel == Parallel::kFsdp) {
    for (Offload off : {Offload::kNone, Offload::kOptimizer, Offload::kParams, Offload::kBoth}) {
      if (off == base.offload) continue;
      Recipe r = base;
      r.offload = off;
      change("offload " + std::string(to_string(off)), r);
    }
  }
  if (!base.lora.enabled()) {  // under any wrapper that takes adapters (change() skips the others)
    const Recipe r = with_adapters(base, false, gpu);
    change("lora 16 (default targets; trains adapters only)" +
               (r.precision != base.precision ? ", precision " + std::string(to_string(r.precision)) : std::string()),
           r);
  }
  if (!base.quant.enabled()) {
    // QLoRA: the same adapters (or LoRA 16) on a 4-bit nf4 base with double quant, in a
    // precision a 4-bit base runs with.
    const Recipe r = with_adapters(base, true, gpu);
    change(std::string(base.lora.enabled() ? "qlora" : "qlora 16 (default targets)") + ": nf4 base, double quant, " +
               std::string(to_string(r.precision)),
           r);
  }
  {
    std::vector<Recipe> rs;
    for (const auto& c : changes) rs.push_back(c.second);
    planner.prefetch(rs, 0);
  }
  for (auto& [what, r] : changes) {
    try {
      out.changes.push_back({std::move(what), judged(planner.replay(r), out.capacity_bytes, host)});
    } catch (const Error&) {
      // a change this model cannot take (e.g. LoRA defaults on Phi-3): not offered
    }
  }
  std::stable_sort(out.changes.begin(), out.changes.end(), [](const Change& a, const Change& b) {
    return a.plan.peak_reserved_bytes < b.plan.peak_reserved_bytes;
  });
  out.simulated = planner.recipes_replayed();
  return out;
}

// Note [The adapter route]
// When no recipe of a full fine-tuning search fits, the most useful change is usually not a knob
// of the search but what is trained: adapters instead of every weight. The planner then searches
// the same space (GPUs, global batch, fixed knobs, host budget) again with LoRA rank 16 on peft's
// default targets and, if nothing fits with those either, with QLoRA (the same adapters on an nf4
// base with double quant), and reports the fastest few plans of the first that fits. It is a
// separate answer, not part of the ranking: a LoRA run trains a different model than full
// fine-tuning, so its step time is not comparable as a cost of the same result. A model whose
// default targets peft cannot resolve gets no adapter route.
FitResult with_adapter_route(const Model& model, const FitRequest& q, bool reference) {
  FitResult out = search(model, q, reference);
  if (!out.plans.empty() || q.base.lora.enabled() || q.base.quant.any()) return out;
  for (bool qlora : {false, true}) {
    FitRequest a = q;
    a.top = std::min<std::size_t>(q.top, 3);
    a.base = with_adapters(q.base, qlora, out.gpu);
    try {
      a.base.validate();
      FitResult r = search(model, a, reference, true);
      out.simulated += r.simulated;
      if (!r.plans.empty()) {
        out.adapter_plans = std::move(r.plans);
        break;
      }
    } catch (const Error&) {
      return out;  // this model or recipe takes no adapters (e.g. targets peft cannot resolve)
    }
  }
  return out;
}

}  // namespace

FitResult fit(const Model& model, const FitRequest& q) { return with_adapter_route(model, q, false); }

Recipe parse_fit_recipe(const RecipeSpelling& spelling) {
  if (spelling.pp != 1) throw Error(kPpSearched);
  if (spelling.cp != 1) throw Error(kCpSearched);
  if (spelling.parallel != "none" || spelling.offload == "none") return parse_recipe(spelling);
  // Offload without a wrapper: on several GPUs the search picks one (own_wrapper), so the spelling
  // is checked under it and handed on without; search() refuses it on one GPU.
  if (spelling.tp > 1) {
    throw Error("offload: " + spelling.offload + " with tensor parallelism (--tp " + std::to_string(spelling.tp) +
                ") is not modelled; drop one of them");
  }
  RecipeSpelling wrapped = spelling;
  Recipe r;
  r.offload = parse_offload(spelling.offload);
  wrapped.parallel = to_string(own_wrapper(r));
  r = parse_recipe(wrapped);
  r.parallel = Parallel::kNone;
  return r;
}

FitResult plan::fit_reference(const Model& model, const FitRequest& q) { return with_adapter_route(model, q, true); }

}  // namespace trainmem
