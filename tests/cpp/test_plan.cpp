// The planner (src/plan): plans are engine replays that fit, fastest first; the floor that rules
// recipes out unreplayed is never above a replayed peak; the step-time model moves the way its
// note says it does.

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "graph/tensor_parallel.h"
#include "model/model.h"
#include "plan/plan.h"
#include "report/report.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::error_of;

Recipe base_recipe(const char* gpu, std::uint64_t seq) {
  Recipe r;
  r.gpu = gpu;
  r.seq = seq;
  return r;
}

TEST(Fit, PlansAreReplaysThatFitFastestFirst) {
  const Model m = load_model("qwen3-0.6b");
  FitRequest q;
  q.base = base_recipe("t4-16gb", 1024);
  q.base.precision = Precision::kFp16Mixed;
  q.global_batch = 16;
  q.top = 5;
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  EXPECT_LE(f.plans.size(), 5u);
  EXPECT_EQ(f.capacity_bytes, find_gpu("t4-16gb").capacity_bytes - find_gpu("t4-16gb").context_bytes);
  for (std::size_t i = 0; i < f.plans.size(); ++i) {
    const Plan& p = f.plans[i];
    EXPECT_TRUE(p.simulated && p.fits);
    EXPECT_LE(p.peak_reserved_bytes, f.capacity_bytes);
    EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 16u);
    // The plan's figures are exactly what estimate() says for its recipe.
    const Estimate e = estimate(m, p.recipe);
    EXPECT_EQ(e.peak_reserved_bytes, p.peak_reserved_bytes);
    EXPECT_EQ(e.peak_allocated_bytes, p.peak_allocated_bytes);
    if (i > 0) EXPECT_LE(f.plans[i - 1].time.seconds, p.time.seconds);
  }
  // The precision was given, so it was held; V100/T4 plans never use bf16.
  for (const Plan& p : f.plans) EXPECT_EQ(p.recipe.precision, Precision::kFp16Mixed);
  EXPECT_GT(f.searched, 100u);
  EXPECT_EQ(f.baseline.peak_reserved_bytes, estimate(m, [&] {
              Recipe r = q.base;
              r.grad_accum = 16;
              return r;
            }()).peak_reserved_bytes);
}

TEST(Fit, NothingFitsGivesTheClosestMiss) {
  const Model m = load_model("llama-3.1-70b");
  FitRequest q;
  q.base = base_recipe("rtx-4090", 4096);
  const FitResult f = fit(m, q);
  EXPECT_TRUE(f.plans.empty());
  ASSERT_TRUE(f.has_closest_miss);
  EXPECT_GT(f.closest_miss.peak_reserved_bytes, f.capacity_bytes);
  // 70B parameters in bf16 alone are 141 GB: every recipe is ruled out by its floor.
  EXPECT_EQ(f.pruned, f.searched);
  EXPECT_FALSE(f.closest_miss.simulated);
}

TEST(Fit, TheFloorIsNeverAboveTheReplayedPeak) {
  for (const char* name : {"gpt2", "qwen3-0.6b", "gemma-2-2b"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16Master, Precision::kBf16True}) {
      for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamWFused, Optimizer::kAdamW8bit, Optimizer::kSgd,
                          Optimizer::kAdafactor}) {
        Recipe r = base_recipe("h100-80gb", 64);
        r.precision = p;
        r.optimizer = o;
        for (LoadDtype d : {LoadDtype::kAuto, LoadDtype::kBf16}) {  // bf16: a half model trained whole
          if (d == LoadDtype::kBf16 && p != Precision::kBf16Mixed) continue;
          r.load_dtype = d;
          const std::uint64_t floor = plan::persistent_floor(m, r);
          const Estimate e = estimate(m, r);
          const std::string what = std::string(name) + " " + std::string(to_string(p)) + " " +
                                   std::string(to_string(o)) + (d == LoadDtype::kBf16 ? " loaded bf16" : "");
          EXPECT_LE(floor, e.peak_allocated_bytes) << what;
          EXPECT_LE(plan::loss_floor(m, r), e.peak_allocated_bytes) << what;
          // A floor far below the peak would rule nothing out: weights and states dominate here.
          EXPECT_GT(floor, e.breakdown_at_peak[0] / 2) << what;
        }
      }
    }
  }
}

// A half-loaded LoRA model under autocast (Note [A half model under autocast]): its frozen weights
// are half, so its floors count them at 2 bytes. Counted at the precision's 4, they were above
// the peak, and fit found nothing for Llama-3.1-8B on an RTX 4090 where checkpointing fits.
TEST(Fit, AHalfLoadedLoraModelsFloorsAreItsHalfWeights) {
  for (const char* name : {"gpt2", "qwen3-0.6b"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (LoadDtype d : {LoadDtype::kBf16, LoadDtype::kFp16}) {
      Recipe r = base_recipe("h100-80gb", 256);
      r.precision = d == LoadDtype::kBf16 ? Precision::kBf16Mixed : Precision::kFp16Mixed;
      r.load_dtype = d;
      r.lora.rank = 8;
      r.lora.targets = {"default"};
      const Estimate e = estimate(m, r);
      EXPECT_LE(plan::persistent_floor(m, r), e.peak_allocated_bytes) << name;
      EXPECT_LE(plan::loss_floor(m, r), e.peak_allocated_bytes) << name;
      EXPECT_GE(plan::persistent_floor(m, r), m.parameter_count * 2) << name;
    }
  }
  const Model m = load_model("llama-3.1-8b");
  FitRequest q;
  q.base = base_recipe("rtx-4090", 2048);
  q.base.precision = Precision::kBf16Mixed;
  q.base.load_dtype = LoadDtype::kBf16;
  q.base.lora.rank = 16;
  q.base.lora.targets = {"default"};
  q.global_batch = 8;
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  // The load dtype goes with its autocast: a bf16-true plan loads bf16 by its own precision.
  std::size_t half_autocast = 0;
  for (const Plan& p : f.plans) {
    EXPECT_EQ(p.recipe.load_dtype, p.recipe.precision == Precision::kBf16Mixed ? LoadDtype::kBf16 : LoadDtype::kAuto);
    half_autocast += p.recipe.precision == Precision::kBf16Mixed;
  }
  EXPECT_GT(half_autocast, 0u);
}

// A pipeline's floor (the average stage's share, DDP's buckets included under PP x DP; under PP x
// FSDP2 the shards plus the whole gradients) is a lower bound of its worst stage; a floor that
// counted every stage's buckets on one, or sharded FSDP2's gradients, would not be.
TEST(Fit, APipelinesFloorIsNeverAboveItsWorstStage) {
  std::uint64_t fsdp = 0;
  for (const char* name : {"llama-3.1-8b", "qwen2.5-7b"}) {
    const Model m = model::with_layers(load_model(name), 6);
    for (std::uint64_t pp : {2, 3}) {
      for (std::uint64_t replicas : {1, 2, 4}) {
        for (Parallel wrapper : {Parallel::kDdp, Parallel::kFsdp}) {
          for (bool reshard : {true, false}) {
            if ((replicas == 1 && wrapper == Parallel::kFsdp) || (wrapper == Parallel::kDdp && !reshard)) continue;
            for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16Master, Precision::kBf16True}) {
              for (Optimizer o : {Optimizer::kAdamW, Optimizer::kSgd}) {
                Recipe r = base_recipe("h100-80gb", 64);
                r.pp = pp;
                r.grad_accum = pp;
                r.gpus = replicas;
                r.parallel = replicas > 1 ? wrapper : Parallel::kNone;
                r.fsdp.reshard_after_forward = reshard;
                r.precision = p;
                r.optimizer = o;
                const std::string what = std::string(name) + " pp" + std::to_string(pp) + " x " +
                                         std::string(to_string(r.parallel)) + " " + std::to_string(replicas) +
                                         (reshard ? "" : " no-reshard") + " " + std::string(to_string(p)) + " " +
                                         std::string(to_string(o));
                try {
                  r.validate();
                } catch (const Error&) {
                  continue;  // a combination the engine does not model
                }
                const std::uint64_t floor = plan::persistent_floor(m, r);
                const Estimate e = estimate(m, r);
                EXPECT_LE(floor, e.peak_allocated_bytes) << what;
                EXPECT_GT(floor, e.peak_allocated_bytes / 4) << what;  // and not so low it rules nothing out
                fsdp += r.parallel == Parallel::kFsdp;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GE(fsdp, 40u);  // PP x FSDP2 is among them, in every precision
  // PP x TP (x FSDP2): the floor of the local model, as rank_floor takes it, is below the worst stage.
  const Model m = model::with_layers(load_model("llama-3.1-8b"), 6);
  std::uint64_t tp = 0;
  for (std::uint64_t pp : {2, 3}) {
    for (std::uint64_t replicas : {1, 2}) {
      for (Precision p : {Precision::kFp32, Precision::kBf16True}) {
        for (bool sp : {false, true}) {
          Recipe r = base_recipe("h100-80gb", 64);
          r.pp = pp;
          r.grad_accum = pp;
          r.tp = 2;
          r.sequence_parallel = sp;
          r.gpus = replicas;
          r.parallel = replicas > 1 ? Parallel::kFsdp : Parallel::kNone;
          r.precision = p;
          r.validate();
          Model local = graph::tensor_parallel_model(m, 2);
          local.parameter_count = 0;
          for (const ParameterGroup& g : local.parameters) local.parameter_count += g.numel * g.count;
          const std::uint64_t floor = plan::persistent_floor(local, r);
          const Estimate e = estimate(m, r);
          EXPECT_LE(floor, e.peak_allocated_bytes) << pp << " x tp 2 x " << replicas << " " << to_string(p);
          EXPECT_GT(floor, e.peak_allocated_bytes / 4) << pp << " x tp 2 x " << replicas << " " << to_string(p);
          ++tp;
        }
      }
    }
  }
  EXPECT_EQ(tp, 16u);
}

// The loss floor (Note [The loss floor] in plan/fit.cpp) is a lower bound too: over micro-batches,
// accumulation, checkpointing, LoRA and every precision and optimizer, with Gemma-2's softcapped
// logits among the models. It is the sharper bound where the logits are large (asserted below, so
// that it rules something out at all).
TEST(Fit, TheLossFloorIsNeverAboveTheReplayedPeak) {
  std::uint64_t sharper = 0, counted = 0;
  for (const char* name : {"gpt2", "qwen3-0.6b", "gemma-2-2b", "llama-3.2-1b"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16Master, Precision::kBf16True}) {
      for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kSgd, Optimizer::kAdafactor}) {
        for (std::uint64_t batch : {1u, 4u}) {
          for (std::uint64_t accum : {1u, 2u, 3u}) {
            for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
              for (std::uint64_t lora : {0u, 8u}) {
                if (lora && (o != Optimizer::kAdamW || p == Precision::kBf16Master)) continue;
                Recipe r = base_recipe("h100-80gb", 256);
                r.precision = p;
                r.optimizer = o;
                r.batch = batch;
                r.grad_accum = accum;
                r.checkpointing = c;
                if (lora) {
                  r.lora.rank = lora;
                  r.lora.targets = {"default"};
                }
                const std::uint64_t floor = plan::loss_floor(m, r);
                const Estimate e = estimate(m, r);
                ASSERT_GT(floor, 0u);
                EXPECT_LE(floor, e.peak_allocated_bytes)
                    << name << " " << to_string(p) << " " << to_string(o) << " b" << batch << " accum " << accum
                    << " " << to_string(c) << " lora " << lora;
                ++counted;
                if (floor > plan::persistent_floor(m, r)) ++sharper;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(sharper, counted / 4);
  // Not counted where the fused loss never makes full logits, nor under a data-parallel wrapper.
  const Model m = model::with_layers(load_model("gpt2"), 2);
  Recipe r = base_recipe("h100-80gb", 256);
  r.loss = Loss::kFused;
  EXPECT_EQ(plan::loss_floor(m, r), 0u);
  r.loss = Loss::kStandard;
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  EXPECT_EQ(plan::loss_floor(m, r), 0u);
}

// fit() and plan::fit_reference() on one request: every field of `fit --json` but the replay and
// rule-out counts must agree, and the faster search replays no more. Returns fit()'s result.
FitResult expect_reference_answers(const char* model, const Model& m, const FitRequest& q, std::uint64_t seq,
                                   const char* gpu, FitResult* reference = nullptr) {
  const FitResult now = fit(m, q);
  const FitResult before = plan::fit_reference(m, q);
  nlohmann::json a = nlohmann::json::parse(report::fit_to_json(model, now));
  nlohmann::json b = nlohmann::json::parse(report::fit_to_json(model, before));
  const std::string what = std::string(model) + " on " + gpu + " seq " + std::to_string(seq) + " batch " +
                           std::to_string(q.global_batch) + " x" + std::to_string(q.gpus);
  EXPECT_EQ(a["searched"], b["searched"]) << what;
  EXPECT_LE(now.simulated, before.simulated) << what;
  for (const char* counter : {"simulated", "pruned"}) {
    a.erase(counter);
    b.erase(counter);
  }
  EXPECT_EQ(a.dump(1), b.dump(1)) << what;
  if (reference) *reference = before;
  return now;
}

// The search with fewer replays (Note [Fewer replays]) against the one before it: every field of
// `fit --json` but the replay and rule-out counts, over models x GPUs x global batches x GPU
// counts, with cases where nothing fits (closest miss and fits_on) and where the loss floor rules
// recipes out.
TEST(Fit, FewerReplaysGiveTheSameAnswers) {
  struct Case {
    const char* model;
    std::uint64_t layers;  // 0: all
    const char* gpu;
    std::uint64_t seq, global_batch, gpus;
  };
  const Case cases[] = {
      {"qwen3-0.6b", 0, "t4-16gb", 1024, 16, 1},      {"qwen3-0.6b", 0, "rtx-4090", 2048, 64, 1},
      {"gpt2", 0, "t4-16gb", 1024, 256, 1},            {"gemma-2-2b", 4, "a10g-24gb", 2048, 32, 1},
      {"llama-3.2-1b", 0, "a100-40gb", 4096, 32, 1},   {"llama-3.1-8b", 2, "rtx-4090", 4096, 64, 1},
      {"llama-3.1-8b", 2, "t4-16gb", 16384, 8, 1},     {"qwen3-0.6b", 0, "t4-16gb", 32768, 4, 1},
      {"qwen3-0.6b", 0, "rtx-4090", 2048, 64, 4},      {"llama-3.2-1b", 2, "a10g-24gb", 4096, 16, 2},
      {"gpt2", 0, "t4-16gb", 1024, 64, 8},           {"qwen3-0.6b", 0, "t4-16gb", 65536, 2, 1},
  };
  std::uint64_t nothing_fits = 0, fewer = 0;
  for (const Case& c : cases) {
    const Model full = load_model(c.model);
    const Model m = c.layers ? model::with_layers(full, c.layers) : full;
    FitRequest q;
    q.base = base_recipe(c.gpu, c.seq);
    if (!find_gpu(c.gpu).bf16) q.base.precision = Precision::kFp16Mixed;
    q.global_batch = c.global_batch;
    q.gpus = c.gpus;
    FitResult before;
    const FitResult now = expect_reference_answers(c.model, m, q, c.seq, c.gpu, &before);
    EXPECT_GE(now.pruned, before.pruned) << c.model << " on " << c.gpu;
    nothing_fits += now.plans.empty();
    fewer += now.simulated < before.simulated;
  }
  EXPECT_GE(nothing_fits, 2u);  // the closest miss's stop limit is exercised
  EXPECT_GE(fewer, 4u);
}

// The search's threads, its windows that end at the last plan, its single changes replayed at
// once and its pipeline stages and ZeRO ranks replayed apart (Note [Planner threads] in
// plan/fit.cpp) give every field of the reference search, which runs one estimate() per recipe on
// one thread: on several GPUs, with pipelines (PP x FSDP2 among them) in the plans, the stopped
// probes and the single changes, and with nothing fitting.
TEST(Fit, ThreadedSearchGivesTheReferenceAnswersOnSeveralGpus) {
  struct Case {
    const char* model;
    std::uint64_t layers;
    const char* gpu;
    std::uint64_t seq, global_batch, gpus;
    bool bf16_master = false;  // held: ZeRO-1/2 plans, whose ranks are replayed apart
    std::uint64_t top = 10;
  };
  const Case cases[] = {
      {"llama-3.1-8b", 4, "rtx-4090", 2048, 16, 4},
      {"llama-3.1-8b", 8, "a100-40gb", 2048, 16, 8},
      {"llama-3.1-8b", 12, "t4-16gb", 4096, 4, 2},  // nothing fits (8 layers fit under ZeRO-3 + offload)
      {"qwen3-0.6b", 0, "rtx-4090", 512, 16, 4, true},
      {"llama-3.1-8b", 8, "rtx-4090", 2048, 16, 4, false, 80},  // PP x FSDP2, PP x TP, interleaved among the plans
  };
  std::uint64_t pipeline_plans = 0, pipeline_changes = 0, nothing_fits = 0, zero_plans = 0;
  std::uint64_t fsdp_pipeline_plans = 0, fsdp_pipeline_changes = 0;  // PP x FSDP2
  std::uint64_t tp_pipeline_plans = 0, tp_pipeline_changes = 0;      // PP x TP
  std::uint64_t interleaved_plans = 0, interleaved_changes = 0;      // two stages per GPU
  for (const Case& c : cases) {
    const Model full = load_model(c.model);
    const Model m = c.layers ? model::with_layers(full, c.layers) : full;
    FitRequest q;
    q.base = base_recipe(c.gpu, c.seq);
    if (!find_gpu(c.gpu).bf16) q.base.precision = Precision::kFp16Mixed;
    if (c.bf16_master) {
      q.base.precision = Precision::kBf16Master;
      q.fixed = {"precision"};
    }
    q.global_batch = c.global_batch;
    q.gpus = c.gpus;
    q.top = c.top;
    const FitResult now = expect_reference_answers(c.model, m, q, c.seq, c.gpu);
    for (const Plan& p : now.plans) {
      pipeline_plans += p.recipe.pp > 1;
      fsdp_pipeline_plans += p.recipe.pp > 1 && p.recipe.parallel == Parallel::kFsdp;
      tp_pipeline_plans += p.recipe.pp > 1 && p.recipe.tp > 1;
      interleaved_plans += p.recipe.pp_stages_per_rank == 2;
      zero_plans += p.recipe.parallel == Parallel::kZero1 || p.recipe.parallel == Parallel::kZero2;
    }
    for (const Change& x : now.changes) {
      pipeline_changes += x.plan.recipe.pp > 1;
      fsdp_pipeline_changes += x.plan.recipe.pp > 1 && x.plan.recipe.parallel == Parallel::kFsdp;
      tp_pipeline_changes += x.plan.recipe.pp > 1 && x.plan.recipe.tp > 1;
      interleaved_changes += x.plan.recipe.pp_stages_per_rank == 2;
    }
    nothing_fits += now.plans.empty();
  }
  EXPECT_GE(pipeline_plans, 4u);
  EXPECT_GE(pipeline_changes, 4u);
  EXPECT_GE(fsdp_pipeline_plans, 1u);
  EXPECT_GE(fsdp_pipeline_changes, 3u);
  EXPECT_GE(tp_pipeline_plans, 1u);
  EXPECT_GE(tp_pipeline_changes, 2u);
  EXPECT_GE(interleaved_plans, 1u);
  EXPECT_GE(interleaved_changes, 1u);
  EXPECT_GE(zero_plans, 1u);
  EXPECT_GE(nothing_fits, 1u);
}

// The search skips a few refusals without asking Recipe::validate (Note [Refusals the search
// skips] in plan/fit.cpp); it must never skip a recipe validate() takes, and it does skip most of
// what validate() refuses among these.
TEST(Fit, PlainRefusalsAreRefusals) {
  std::uint64_t refused = 0, skipped = 0;
  for (Parallel dp : {Parallel::kNone, Parallel::kDdp, Parallel::kFsdp, Parallel::kZero1, Parallel::kZero2, Parallel::kZero3})
  for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16True, Precision::kBf16Master,
                      Precision::kFp16Mixed, Precision::kFp16True})
  for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamWFused, Optimizer::kAdamW8bit, Optimizer::kAdafactor, Optimizer::kSgd})
  for (Loss l : {Loss::kStandard, Loss::kFused})
  for (Offload off : {Offload::kNone, Offload::kOptimizer, Offload::kParams, Offload::kBoth})
  for (std::uint64_t gpus : {1, 4})
  for (std::uint64_t lora : {0, 16})
  for (std::uint64_t tp : {1, 2})
  for (std::uint64_t pp : {1, 2}) {
    Recipe r = base_recipe("h100-80gb", 1024);
    r.parallel = dp;
    r.gpus = dp == Parallel::kNone ? 1 : gpus;
    r.tp = tp;
    r.pp = pp;
    r.grad_accum = pp;
    r.precision = p;
    r.optimizer = o;
    r.loss = l;
    r.offload = off;
    if (lora) {
      r.lora.rank = lora;
      r.lora.targets = {"default"};
    }
    bool ok = true;
    try {
      r.validate();
    } catch (const Error&) {
      ok = false;
    }
    const bool plain = plan::plainly_refused(r);
    EXPECT_FALSE(ok && plain) << to_string(dp) << " " << to_string(p) << " " << to_string(o) << " " << to_string(l)
                              << " " << to_string(off) << " gpus " << r.gpus << " lora " << lora << " tp " << tp
                              << " pp " << pp;
    refused += !ok;
    skipped += plain;
  }
  EXPECT_GT(skipped, refused / 2);
}

// With a 4-bit base the floor counts the packed weights and fp32 for the rest: still below the
// replayed peak, and the planner offers QLoRA as a single change of a full fine-tuning recipe.
TEST(Fit, QloraFloorAndSingleChange) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  for (bool dq : {false, true}) {
   for (Precision p : {Precision::kBf16True, Precision::kBf16Mixed}) {
    Recipe r = base_recipe("h100-80gb", 64);
    r.precision = p;
    r.lora.rank = 8;
    r.lora.targets = {"default"};
    r.quant.load_in_4bit = true;
    r.quant.double_quant = dq;
    const Estimate e = estimate(m, r);
    EXPECT_LE(plan::persistent_floor(m, r), e.breakdown_at_peak[0]);
    // Under autocast the peak's weights also hold the frozen lm_head's bf16 cast (made at each use).
    if (p == Precision::kBf16True) EXPECT_GT(plan::persistent_floor(m, r), e.breakdown_at_peak[0] * 9 / 10);
   }
  }
  FitRequest q;
  q.base = base_recipe("a100-40gb", 512);
  const FitResult f = fit(m, q);
  bool offered = false;
  for (const Change& c : f.changes) {
    // The user's precision is kept: a 4-bit base runs under autocast too.
    if (c.what != "qlora 16 (default targets): nf4 base, double quant, bf16-mixed") continue;
    offered = true;
    EXPECT_TRUE(c.plan.recipe.quant.enabled() && c.plan.recipe.lora.rank == 16);
    EXPECT_EQ(c.plan.peak_reserved_bytes, estimate(m, c.plan.recipe).peak_reserved_bytes);
  }
  EXPECT_TRUE(offered);
}

// QLoRA on several GPUs: DDP and ZeRO-1/2 hold the whole packed base on every rank, FSDP2 shards
// it (Note [QLoRA under FSDP2]). Every plan keeps the 4-bit base, is the estimate of its recipe and
// keeps its floor; a 70B base, 35 GB packed, fits 24 GB GPUs only sharded.
TEST(Fit, QloraOnSeveralGpus) {
  for (const char* name : {"llama-3.2-1b", "llama-3.1-70b"}) {
    SCOPED_TRACE(name);
    const bool big = std::string(name) == "llama-3.1-70b";
    const Model m = big ? load_model(name) : model::with_layers(load_model(name), 2);
    FitRequest q;
    q.base = base_recipe("rtx-4090", big ? 2048 : 512);
    q.base.lora.rank = 16;
    q.base.lora.targets = {"default"};
    q.base.quant.load_in_4bit = true;
    q.base.quant.double_quant = true;
    q.gpus = big ? 4 : 2;
    q.global_batch = 8;
    q.top = 4;
    const FitResult f = fit(m, q);
    ASSERT_FALSE(f.plans.empty());
    for (const Plan& p : f.plans) {
      if (big) EXPECT_EQ(p.recipe.parallel, Parallel::kFsdp);
      EXPECT_TRUE(p.recipe.quant.enabled());
      EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum * q.gpus, 8u);
      const Estimate e = estimate(m, p.recipe);
      EXPECT_EQ(e.peak_reserved_bytes, p.peak_reserved_bytes);
      EXPECT_LE(plan::persistent_floor(m, p.recipe), e.peak_allocated_bytes);
    }
  }
}

// LoRA on several GPUs: DDP (its buckets hold the adapters' gradients) and ZeRO-1/2 (the flat
// group holds the adapters) take a peft model, FSDP2 and ZeRO-3 do not; every plan has the batch
// split, is the estimate of its recipe, and its floor never exceeds the replay.
TEST(Fit, LoraOnSeveralGpusIsPlannedUnderEveryWrapper) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  FitRequest q;
  q.base = base_recipe("rtx-4090", 512);
  q.base.lora.rank = 16;
  q.base.lora.targets = {"default"};
  q.gpus = 4;
  q.global_batch = 16;
  q.top = 6;
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  for (const Plan& p : f.plans) {
    EXPECT_NE(p.recipe.parallel, Parallel::kNone);
    EXPECT_EQ(p.recipe.gpus, 4u);
    EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum * 4, 16u);
    EXPECT_EQ(p.recipe.lora.rank, 16u);
    const Estimate e = estimate(m, p.recipe);
    EXPECT_EQ(e.peak_reserved_bytes, p.peak_reserved_bytes);
    EXPECT_LE(plan::persistent_floor(m, p.recipe), e.peak_allocated_bytes);
  }
  // The floor under ZeRO-1/2 counts the adapters' partition, not the whole model's; under ZeRO-3
  // and FSDP2 the frozen base's partitions or shards (HSDP: over its shard group).
  for (Parallel z : {Parallel::kZero1, Parallel::kZero2, Parallel::kZero3}) {
    for (Precision pr : {Precision::kFp32, Precision::kBf16Master}) {
      Recipe r = q.base;
      r.gpus = 4;
      r.parallel = z;
      r.precision = pr;
      r.validate();
      EXPECT_LE(plan::persistent_floor(m, r), estimate(m, r).peak_allocated_bytes) << to_string(z) << to_string(pr);
    }
  }
  for (std::uint64_t replicate : {1u, 2u}) {
    for (Precision pr : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16True}) {
      Recipe r = q.base;
      r.gpus = 4;
      r.parallel = Parallel::kFsdp;
      r.fsdp.replicate = replicate;
      r.precision = pr;
      r.validate();
      const std::uint64_t floor = plan::persistent_floor(m, r);
      EXPECT_LE(floor, estimate(m, r).peak_allocated_bytes) << replicate << to_string(pr);
      Recipe ddp = r;
      ddp.parallel = Parallel::kDdp;
      ddp.fsdp = Fsdp{};
      EXPECT_LT(floor, plan::persistent_floor(m, ddp)) << replicate << to_string(pr);
    }
  }
}

// A DDP recipe on four GPUs at seq 512, for a global batch of 16: the request the DDP knobs' tests
// start from (the base to be set further and validated).
FitRequest ddp_request(const char* gpu) {
  FitRequest q;
  q.base = base_recipe(gpu, 512);
  q.base.gpus = 4;
  q.base.parallel = Parallel::kDdp;
  q.gpus = 4;
  q.global_batch = 16;
  q.top = 40;
  return q;
}

// DDP's find_unused_parameters belongs to DDP: candidates and single changes under another wrapper
// drop it instead of being refused, and DDP candidates keep it.
TEST(Fit, FindUnusedParametersStaysWithDdp) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  FitRequest q = ddp_request("rtx-4090");
  q.base.ddp_find_unused_parameters = true;
  q.base.validate();
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  bool other_wrapper = false;
  for (const Plan& p : f.plans) {
    EXPECT_EQ(p.recipe.ddp_find_unused_parameters, p.recipe.parallel == Parallel::kDdp && p.recipe.pp == 1);
    other_wrapper = other_wrapper || p.recipe.parallel != Parallel::kDdp;
  }
  EXPECT_TRUE(other_wrapper);
  bool fsdp_change = false;
  for (const Change& c : f.changes) {
    if (c.what != "parallel fsdp") continue;
    fsdp_change = true;
    EXPECT_FALSE(c.plan.recipe.ddp_find_unused_parameters);
  }
  EXPECT_TRUE(fsdp_change);
}

// DDP's gradient_as_bucket_view: DDP candidates keep it and the others drop it; turning it off is a
// single change replayed as its own recipe (two copies of the gradients: a higher peak); and its
// floor counts the buckets once, never above the replayed peak (SGD and fused AdamW make no
// foreach temporaries to hide a double count).
TEST(Fit, GradientAsBucketViewIsADdpChangeWithItsOwnFloor) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  FitRequest q = ddp_request("h100-80gb");
  q.base.precision = Precision::kFp32;
  q.base.ddp_gradient_as_bucket_view = true;
  q.base.validate();
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  for (const Plan& p : f.plans) {
    EXPECT_EQ(p.recipe.ddp_gradient_as_bucket_view, p.recipe.parallel == Parallel::kDdp && p.recipe.pp == 1);
  }
  bool found = false;
  for (const Change& c : f.changes) {
    if (c.what != "ddp_gradient_as_bucket_view false") continue;
    found = true;
    EXPECT_FALSE(c.plan.recipe.ddp_gradient_as_bucket_view);
    EXPECT_GT(c.plan.peak_allocated_bytes, estimate(m, q.base).peak_allocated_bytes);
  }
  EXPECT_TRUE(found);
  for (Optimizer o : {Optimizer::kSgd, Optimizer::kAdamWFused, Optimizer::kAdamW}) {
    for (std::uint64_t accum : {1u, 2u}) {
      Recipe r = base_recipe("cpu", 64);  // few activations and no cuBLAS workspace: the gradients dominate
      r.batch = 1;
      r.precision = Precision::kFp32;
      r.parallel = Parallel::kDdp;
      r.gpus = 2;
      r.optimizer = o;
      r.grad_accum = accum;
      r.ddp_gradient_as_bucket_view = true;
      const Model& narrow = testing::llama_w512();  // a small vocabulary: no embedding backward on top
      EXPECT_LE(plan::persistent_floor(narrow, r), estimate(narrow, r).peak_allocated_bytes) << to_string(o) << " " << accum;
    }
  }
}

// Llama-3.1-70B with LoRA 16 on the default targets, planned over `gpus` GPUs.
FitResult fit_70b_lora(const char* gpu, std::uint64_t seq, std::uint64_t gpus, std::uint64_t global_batch) {
  FitRequest q;
  q.base = base_recipe(gpu, seq);
  q.base.lora.rank = 16;
  q.base.lora.targets = {"default"};
  q.gpus = gpus;
  q.global_batch = global_batch;
  q.top = 3;
  return fit(load_model("llama-3.1-70b"), q);
}

// A base no GPU holds whole with its activations: before FSDP2 and ZeRO-3 took adapters nothing
// fit, now the frozen 70B base is sharded over the eight GPUs (Note [LoRA under FSDP2] in
// graph/parallel.cpp, Note [LoRA under ZeRO-3] in graph/zero3.cpp).
TEST(Fit, LoraOfABaseTooLargeForOneGpuIsSharded) {
  const FitResult f = fit_70b_lora("h100-80gb", 4096, 8, 16);
  ASSERT_FALSE(f.plans.empty());
  const Model m = load_model("llama-3.1-70b");
  for (const Plan& p : f.plans) {
    EXPECT_TRUE(p.recipe.parallel == Parallel::kFsdp || p.recipe.parallel == Parallel::kZero3);
    EXPECT_EQ(p.recipe.lora.rank, 16u);
    EXPECT_LE(p.peak_reserved_bytes, f.capacity_bytes);
    EXPECT_LE(plan::persistent_floor(m, p.recipe), p.peak_allocated_bytes);
  }
}

// The example: Llama-3.1-70B on two 24 GiB GPUs. Sharded over two, the bf16 base alone is
// ~66 GiB a rank; with FSDP2's CPUOffloadPolicy the shards live on the host and a rank holds a
// unit or two at a time, so LoRA fits.
TEST(Fit, LoraOfA70BOnTwoConsumerGpusIsShardedAndOffloaded) {
  const FitResult f = fit_70b_lora("rtx-4090", 2048, 2, 8);
  ASSERT_FALSE(f.plans.empty());
  for (const Plan& p : f.plans) {
    EXPECT_EQ(p.recipe.parallel, Parallel::kFsdp);
    EXPECT_EQ(p.recipe.offload, Offload::kBoth);
    EXPECT_LE(p.peak_reserved_bytes, f.capacity_bytes);
    EXPECT_GT(p.host_bytes, 70'000'000'000u / 2);  // the bf16 base's shards, pinned
    EXPECT_GT(p.time.host_s, 0);
  }
}

TEST(Fit, TheFloorIsNeverAboveTheReplayedPeakUnderDataParallelism) {
  for (const char* name : {"gpt2", "qwen3-0.6b"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (Parallel dp : {Parallel::kDdp, Parallel::kFsdp, Parallel::kZero1, Parallel::kZero2, Parallel::kZero3}) {
      // ZeRO runs DeepSpeed's own precisions and a torch optimizer (Recipe::validate).
      const std::vector<Precision> precisions =
          is_zero(dp) ? std::vector<Precision>{Precision::kFp32, Precision::kBf16Master}
                      : std::vector<Precision>{Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16True};
      const std::vector<Optimizer> optimizers =
          is_zero(dp) ? std::vector<Optimizer>{Optimizer::kAdamW, Optimizer::kAdamWFused, Optimizer::kSgd}
                      : std::vector<Optimizer>{Optimizer::kAdamW};
      for (std::uint64_t gpus : {2u, 3u, 8u}) {
        for (Precision p : precisions) {
          for (Optimizer o : optimizers) {
            for (std::uint64_t accum : {1u, 2u}) {
              Recipe r = base_recipe("h100-80gb", 64);
              r.precision = p;
              r.optimizer = o;
              r.parallel = dp;
              r.gpus = gpus;
              r.grad_accum = accum;
              if (!is_zero(dp) && p == Precision::kBf16Mixed && gpus == 3) {
                r.load_dtype = LoadDtype::kBf16;  // a half model trained whole (its own floors)
              }
              const std::uint64_t floor = plan::persistent_floor(m, r);
              const Estimate e = estimate(m, r);
              EXPECT_LE(floor, e.peak_allocated_bytes) << name << " " << to_string(dp) << " x" << gpus << " "
                                                       << to_string(p) << " " << to_string(o) << " accum " << accum;
              // Under ZeRO-1/2 the floor still holds most of the peak: the whole flat group and the
              // partitions dominate a two-layer model at seq 64. ZeRO-3's floor leaves out what is
              // gathered (at the end of a forward every weight autograd saved), so it can be
              // below half the peak on 8 GPUs.
              if (is_zero(dp) && dp != Parallel::kZero3) {
                EXPECT_GT(floor, e.peak_allocated_bytes / 2)
                    << name << " " << to_string(dp) << " x" << gpus << " " << to_string(p) << " " << to_string(o);
              }
            }
          }
        }
      }
    }
  }
}

// ZeRO-1/2 are searched beside DDP and FSDP2 where the recipe validation takes them, their plans
// are estimates of exactly that recipe, and a held precision ZeRO refuses excludes it quietly.
TEST(Fit, SeveralGpusSearchZeroWhereItApplies) {
  const Model m = load_model("qwen3-0.6b");
  FitRequest q;
  q.base = base_recipe("rtx-4090", 512);
  q.base.precision = Precision::kBf16Master;
  q.fixed = {"precision"};
  q.gpus = 4;
  q.global_batch = 16;
  q.top = 12;
  const FitResult f = fit(m, q);
  std::set<Parallel> seen;
  for (const Plan& p : f.plans) {
    seen.insert(p.recipe.parallel);
    EXPECT_EQ(p.recipe.gpus, 4u);
    EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 4u);
    EXPECT_EQ(estimate(m, p.recipe).peak_reserved_bytes, p.peak_reserved_bytes);
    if (is_zero(p.recipe.parallel)) {
      EXPECT_EQ(p.recipe.precision, Precision::kBf16Master);
      EXPECT_NE(p.recipe.optimizer, Optimizer::kAdamW8bit);
      EXPECT_NE(p.recipe.optimizer, Optimizer::kAdafactor);
      EXPECT_EQ(p.recipe.loss, Loss::kStandard);
    }
  }
  EXPECT_TRUE(seen.count(Parallel::kZero1));
  EXPECT_TRUE(seen.count(Parallel::kZero2));
  EXPECT_FALSE(seen.count(Parallel::kFsdp));  // FSDP2 refuses bf16-master
  // The stages are single changes of the DDP baseline.
  for (const char* what : {"parallel zero1", "parallel zero2"}) {
    const auto c = std::find_if(f.changes.begin(), f.changes.end(), [&](const Change& x) { return x.what == what; });
    ASSERT_NE(c, f.changes.end()) << what;
    EXPECT_EQ(c->plan.peak_reserved_bytes, estimate(m, c->plan.recipe).peak_reserved_bytes);
  }
  // A held precision ZeRO does not take leaves it out of the search without an error; the single
  // change moves a bf16 recipe to DeepSpeed's bf16 mode and says so.
  q.base.precision = Precision::kBf16Mixed;
  const FitResult mixed = fit(m, q);
  ASSERT_FALSE(mixed.plans.empty());
  for (const Plan& p : mixed.plans) EXPECT_FALSE(is_zero(p.recipe.parallel));
  const auto c = std::find_if(mixed.changes.begin(), mixed.changes.end(), [](const Change& x) {
    return x.what == "parallel zero2, precision bf16-master";
  });
  ASSERT_NE(c, mixed.changes.end());
  EXPECT_EQ(c->plan.recipe.precision, Precision::kBf16Master);
  EXPECT_EQ(c->plan.recipe.parallel, Parallel::kZero2);
}

TEST(Fit, BadRequestsAreErrors) {
  const Model m = load_model("gpt2");
  FitRequest q;
  q.base = base_recipe("cpu", 128);
  EXPECT_NE(error_of([&] { fit(m, q); }).find("no memory to plan for"), std::string::npos);
  q.base.gpu = "h100-80gb";
  q.gpus = 5000;
  EXPECT_EQ(error_of([&] { fit(m, q); }), "gpus: must be between 1 and 4096, got 5000");
  q.gpus = 3;
  q.global_batch = 8;
  EXPECT_NE(error_of([&] { fit(m, q); }).find("8 sequences do not split over 3 data-parallel GPUs"), std::string::npos);
  q.gpus = 1;
  q.base.batch = 3;
  q.global_batch = 8;
  EXPECT_NE(error_of([&] { fit(m, q); }).find("not a multiple of batch 3"), std::string::npos);
  q.base.batch = 1;
  q.global_batch = 1 << 20;
  q.fixed = {"batch"};  // a micro-batch the user gave stays; one they did not grows (below)
  EXPECT_NE(error_of([&] { fit(m, q); }).find("more than 1024"), std::string::npos);
  q.fixed.clear();
  q.global_batch = 3 * 1025;  // 3 x 5^2 x 41: micro-batches of 1 and 3 need more than 1024 of them
  q.top = 1;
  const Plan base = fit(m, q).baseline;
  EXPECT_EQ(base.recipe.batch, 5u);
  EXPECT_EQ(base.recipe.grad_accum, 615u);
  // A prime past what any micro-batch splits within the cap is refused at once.
  q.global_batch = 1099511627791ull;
  EXPECT_NE(error_of([&] { fit(m, q); }).find("no micro-batch up to 16777216 splits it"), std::string::npos);
  // Over GPUs it does not split across, the pipeline or tensor-parallel baseline's micro-batch grows too.
  FitRequest t = q;
  t.gpus = 2;
  t.global_batch = 3 * 1025;
  const Plan moved = fit(load_model("llama-3.2-1b"), t).baseline;  // GPT-2 takes neither
  EXPECT_EQ(moved.recipe.tp, 2u);
  EXPECT_EQ(moved.recipe.batch, 5u);
  q.global_batch = 8;
  q.fixed = {"seq"};
  EXPECT_NE(error_of([&] { fit(m, q); }).find("'seq' is not a knob the planner searches"), std::string::npos);
}

TEST(Fit, SeveralGpusSearchDdpAndFsdpWithTheBatchSplit) {
  const Model m = load_model("qwen3-4b");
  FitRequest q;
  q.base = base_recipe("a100-40gb", 2048);
  q.gpus = 4;
  q.global_batch = 32;
  q.top = 6;
  const FitResult f = fit(m, q);
  EXPECT_EQ(f.baseline.recipe.parallel, Parallel::kDdp);  // the recipe named no wrapper
  EXPECT_EQ(f.baseline.recipe.gpus, 4u);
  ASSERT_FALSE(f.plans.empty());
  std::set<Parallel> seen;
  for (const Plan& p : f.plans) {
    if (p.recipe.cp > 1) continue;  // one context-parallel ring (LongSequencesSearchOneContextParallelRing)
    EXPECT_EQ(p.recipe.gpus, 4u);
    EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 8u);  // 32 sequences over 4 GPUs
    EXPECT_GT(p.time.comm_s, 0);
    seen.insert(p.recipe.parallel);
    // Every plan is an estimate of exactly that recipe.
    EXPECT_EQ(estimate(m, p.recipe).peak_reserved_bytes, p.peak_reserved_bytes);
  }
  EXPECT_TRUE(seen.count(Parallel::kFsdp));
  EXPECT_TRUE(std::any_of(f.changes.begin(), f.changes.end(), [](const Change& c) { return c.what == "parallel fsdp"; }));
  q.fixed = {"parallel"};
  for (const Plan& p : fit(m, q).plans) EXPECT_EQ(p.recipe.parallel, Parallel::kDdp);
}

TEST(StepTime, CollectivesAtTheInterconnect) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 4096);
  EXPECT_EQ(step_time(m, r).comm_s, 0);
  r.gpus = 8;
  r.parallel = Parallel::kDdp;
  const StepTime ddp = step_time(m, r);
  // A ring all-reduce of every fp32 gradient: 2 * 7/8 of them through each GPU's link.
  const double grads = static_cast<double>(m.parameter_count) * 4;
  EXPECT_DOUBLE_EQ(ddp.comm_s, 2 * 7.0 / 8 * grads / (find_gpu("h100-80gb").interconnect_gbps * 1e9));
  r.parallel = Parallel::kFsdp;
  // Two all-gathers of the decoder layers' units and one of the root (embedding, final norm and
  // the untied head, never resharded after forward), and a reduce-scatter of every gradient.
  const double n = static_cast<double>(m.parameter_count);
  const double root = 2.0 * static_cast<double>(m.arch.vocab_size * m.arch.hidden_size) + static_cast<double>(m.arch.hidden_size);
  const double fsdp_factor = ((2 * (n - root) + root) / n + 1) / 2;  // in DDP all-reduces
  EXPECT_GT(fsdp_factor, 1.4);
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * fsdp_factor);
  // ZeRO-1/2: DDP's all-reduce plus one all-gather of the parameters per step (fp32 here, so
  // the gather is half the all-reduce).
  r.grad_accum = 1;
  r.parallel = Parallel::kZero2;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * 1.5);
  r.parallel = Parallel::kZero1;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * 1.5);
  r.grad_accum = 2;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * 1.5);  // ZeRO-1 reduces at the boundary only
  r.parallel = Parallel::kZero2;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * 2.5);  // ZeRO-2 reduces every micro-batch
  r.parallel = Parallel::kFsdp;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, ddp.comm_s * 2 * fsdp_factor);  // every micro-batch communicates
}

// PP x DP (Notes [Pipeline with DDP] and [Pipeline with FSDP2] in graph/pipeline.cpp): each stage
// moves its share once per step, DDP one all-reduce, FSDP2 one reduce-scatter and its gathers as
// the stage's schedule needs them: M + 1 with reshard_after_forward (after every forward and at
// the start), 1 without.
// LoRA on several GPUs: DDP all-reduces the adapters' fp32 gradients whatever the base's dtype;
// DeepSpeed's bf16 mode casts the adapters to bf16.
TEST(StepTime, LoraCollectivesMoveTheAdapters) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 2048);
  r.precision = Precision::kBf16True;
  r.lora.rank = 16;
  r.lora.targets = {"default"};
  r.gpus = 4;
  r.parallel = Parallel::kDdp;
  const double link = find_gpu("h100-80gb").interconnect_gbps * 1e9;
  // q_proj (4096 -> 4096) and v_proj (4096 -> 1024) in each of the 32 layers, rank 16.
  const double adapters = 32.0 * 16 * ((4096 + 4096) + (4096 + 1024));
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, 2 * 0.75 * adapters * 4 / link);
  r.parallel = Parallel::kZero2;
  r.precision = Precision::kBf16Master;
  // ZeRO-2: the all-reduce in the model dtype and one all-gather of the 16-bit partitions.
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, (2 * 0.75 * adapters * 2 + 0.75 * adapters * 2) / link);
  // FSDP2: the layers' units gathered twice and the root once, each carrying the bf16 base and the
  // fp32 adapters; the reduce-scatter of the fp32 adapters alone.
  r.parallel = Parallel::kFsdp;
  r.precision = Precision::kBf16True;
  const double base = static_cast<double>(m.parameter_count), root = 2.0 * 128'256 * 4096 + 4096;
  const double gathered = 2 * ((base - root) * 2 + adapters * 4) + root * 2;
  EXPECT_NEAR(step_time(m, r).comm_s, 0.75 * (gathered + adapters * 4) / link, 1e-12);
  // ZeRO-3 in DeepSpeed's bf16 mode: the whole bf16 model gathered for the forward and again for
  // the backward, the bf16 adapters' gradients reduce-scattered.
  r.parallel = Parallel::kZero3;
  r.precision = Precision::kBf16Master;
  EXPECT_NEAR(step_time(m, r).comm_s, 0.75 * (2 * (base + adapters) * 2 + adapters * 2) / link, 1e-12);
}

TEST(StepTime, PipelineReplicasMoveTheirStagesShare) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 4096);
  r.pp = 4;
  r.gpus = 2;
  r.grad_accum = 8;
  r.parallel = Parallel::kDdp;
  const double link = find_gpu("h100-80gb").interconnect_gbps * 1e9;
  const double grads = static_cast<double>(m.parameter_count) * 4, stage = grads / 4;
  r.parallel = Parallel::kNone;
  r.gpus = 1;
  const double p2p = step_time(m, r).comm_s;  // the stages' activations and gradients
  r.parallel = Parallel::kDdp;
  r.gpus = 2;
  EXPECT_NEAR(step_time(m, r).comm_s - p2p, 2 * 0.5 * stage / link, 1e-12);
  r.parallel = Parallel::kFsdp;
  for (PipelineSchedule s : {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe}) {
    r.pp_schedule = s;
    r.fsdp.reshard_after_forward = true;
    EXPECT_NEAR(step_time(m, r).comm_s - p2p, 0.5 * (9 + 1) * stage / link, 1e-12) << to_string(s);
    r.fsdp.reshard_after_forward = false;
    EXPECT_NEAR(step_time(m, r).comm_s - p2p, 0.5 * (1 + 1) * stage / link, 1e-12) << to_string(s);
  }
}

// PP x TP: a stage's tensor-parallel collectives are its 1/N of the layers' in every one of the
// M + N - 1 slots, as its compute is; under sequence parallelism the stages send 1/T activations.
TEST(StepTime, PipelineStagesOfTensorParallelGroups) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 4096);
  r.precision = Precision::kBf16True;
  r.tp = 4;
  r.grad_accum = 8;
  const double tp_alone = step_time(m, r).comm_s;
  r.pp = 2;
  const StepTime both = step_time(m, r);
  const double link = find_gpu("h100-80gb").interconnect_gbps * 1e9, act = 4096.0 * 4096 * 2;
  const double p2p = (8 + 2 - 1) * 2 * act / link;
  EXPECT_NEAR(both.comm_s, tp_alone / 2 * (8 + 1) / 8 + p2p, 1e-12);
  r.sequence_parallel = true;
  Recipe alone = r;
  alone.pp = 1;
  EXPECT_NEAR(step_time(m, r).comm_s, step_time(m, alone).comm_s / 2 * (8 + 1) / 8 + p2p / 4, 1e-12);
}

TEST(StepTime, TensorParallelCollectivesPerLayer) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 4096);
  r.precision = Precision::kBf16True;
  const StepTime one = step_time(m, r);
  r.tp = 8;
  const StepTime tp = step_time(m, r);
  // 7 ring all-reduces of one bf16 activation (tokens x hidden) per layer: 2 * 7/8 of each.
  const double act = 4096.0 * 4096 * 2, link = find_gpu("h100-80gb").interconnect_gbps * 1e9;
  EXPECT_DOUBLE_EQ(tp.comm_s, 32 * 7 * 2 * (7.0 / 8) * act / link);
  // The local model computes the layers' matmuls at 1/8 (embedding and lm_head whole).
  EXPECT_LT(tp.flops, one.flops / 4);
  // Sequence parallelism moves the same volume per layer, plus lm_head's input and the
  // embedding's gradient once per micro-batch.
  r.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, tp.comm_s + 2 * (7.0 / 8) * act / link);
  // Checkpointing repeats the forward's collectives (2 all-reduces of 7).
  r.sequence_parallel = false;
  r.checkpointing = Checkpointing::kFull;
  EXPECT_DOUBLE_EQ(step_time(m, r).comm_s, tp.comm_s * 9 / 7);
  // Loss parallelism (Note [Loss parallel]): lm_head's input gradient all-reduced once per
  // micro-batch and three per-token fp32 all-reduces; lm_head's FLOPs at 1/8.
  r.checkpointing = Checkpointing::kNone;
  r.loss_parallel = true;
  const StepTime lp = step_time(m, r);
  EXPECT_DOUBLE_EQ(lp.comm_s, tp.comm_s + (2 * (7.0 / 8) * act + 3 * 2 * (7.0 / 8) * 4096.0 * 4) / link);
  EXPECT_DOUBLE_EQ(tp.flops - lp.flops, 3 * 2 * 4096.0 * 128'256 * 4096 * 7 / 8);
  EXPECT_LT(lp.memory_s, tp.memory_s);
}

TEST(Fit, SeveralGpusSearchTensorParallelism) {
  const Model m = load_model("llama-3.1-8b");
  FitRequest q;
  q.base = base_recipe("a100-40gb", 2048);
  q.gpus = 4;
  q.global_batch = 8;
  q.top = 1000;
  const FitResult f = fit(m, q);
  std::set<std::pair<std::uint64_t, bool>> seen;
  std::uint64_t pp_tp = 0;
  for (const Plan& p : f.plans) {
    if (p.recipe.tp == 1) continue;
    if (p.recipe.pp > 1) {
      // PP x TP (Note [Pipeline with tensor parallelism]): two stages of tensor-parallel groups of
      // 2, one pipeline running the whole global batch; its figures are the worst stage's.
      EXPECT_EQ(p.recipe.pp * p.recipe.tp, 4u);
      EXPECT_EQ(p.recipe.gpus, 1u);
      EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 8u);
      if (pp_tp++ == 0) EXPECT_EQ(estimate(m, p.recipe).peak_reserved_bytes, p.peak_reserved_bytes);
      continue;
    }
    if (p.recipe.tp == 2) {
      // TP x DP: two tensor-parallel groups of 2 under FSDP2, each running half the global batch.
      EXPECT_EQ(p.recipe.gpus, 2u);
      EXPECT_EQ(p.recipe.parallel, Parallel::kFsdp);
      EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 4u);
    } else {
      EXPECT_EQ(p.recipe.tp, 4u);
      EXPECT_EQ(p.recipe.gpus, 1u);
      EXPECT_EQ(p.recipe.parallel, Parallel::kNone);
      EXPECT_EQ(p.recipe.batch * p.recipe.grad_accum, 8u);  // one data-parallel rank: the global batch
    }
    EXPECT_GT(p.time.comm_s, 0);
    // A plan is an estimate of exactly that recipe (the floor, on the rank's local shards, let it through).
    if (seen.insert({p.recipe.tp, p.recipe.sequence_parallel}).second) {
      EXPECT_EQ(estimate(m, p.recipe).peak_reserved_bytes, p.peak_reserved_bytes);
    }
  }
  EXPECT_TRUE(seen.count({4, false}));
  EXPECT_TRUE(seen.count({4, true}));
  EXPECT_GE(pp_tp, 1u);
  EXPECT_TRUE(seen.count({2, false}));
  // The base recipe is bf16-mixed: tensor parallelism keeps it, alone and under FSDP2 (autocast
  // over DTensor parameters is modelled).
  EXPECT_TRUE(std::any_of(f.changes.begin(), f.changes.end(), [](const Change& c) {
    return c.what == "tp 4 (no data parallelism)" && c.plan.recipe.tp == 4 &&
           c.plan.recipe.precision == Precision::kBf16Mixed;
  }));
  EXPECT_TRUE(std::any_of(f.changes.begin(), f.changes.end(), [](const Change& c) {
    return c.what == "tp 2 x fsdp 2" && c.plan.recipe.precision == Precision::kBf16Mixed;
  }));
  // Loss parallelism is searched with tp (Llama-3.1-8B's lm_head is untied, 128,256 = 4 x 32,064),
  // and its plans are estimates of exactly their recipe too.
  bool lp_seen = false;
  for (const Plan& p : f.plans) {
    if (!p.recipe.loss_parallel) continue;
    // one group, TP x DP, or the last stage of PP x TP (Note [Pipeline with tensor parallelism])
    EXPECT_TRUE(p.recipe.tp == 4u || (p.recipe.tp == 2u && (p.recipe.gpus == 2u || p.recipe.pp == 2u)));
    if (!lp_seen) EXPECT_EQ(estimate(m, p.recipe).peak_reserved_bytes, p.peak_reserved_bytes);
    lp_seen = true;
  }
  EXPECT_TRUE(lp_seen);
  // Llama-3.2-1B ties lm_head to the embedding: tp plans, never loss parallelism.
  FitRequest t = q;
  t.top = 200;
  bool tied_tp = false;
  for (const Plan& p : fit(load_model("llama-3.2-1b"), t).plans) {
    EXPECT_FALSE(p.recipe.loss_parallel);
    tied_tp = tied_tp || p.recipe.tp > 1;
  }
  EXPECT_TRUE(tied_tp);
  // A family the engine does not split is never searched with tp.
  FitRequest g = q;
  g.top = 50;
  for (const Plan& p : fit(load_model("phi-3-mini-4k-instruct"), g).plans) EXPECT_EQ(p.recipe.tp, 1u);
  // tp held: only tp 4 plans; tp 2 of 4 GPUs: two groups under FSDP2, the baseline too; a tp that
  // does not divide --gpus is an error.
  q.base.tp = 4;
  q.base.precision = Precision::kBf16True;
  q.fixed = {"tp"};
  q.top = 5;
  const FitResult held = fit(m, q);
  EXPECT_EQ(held.baseline.recipe.tp, 4u);
  for (const Plan& p : held.plans) EXPECT_EQ(p.recipe.tp, 4u);
  q.base.tp = 2;
  const FitResult two = fit(m, q);
  EXPECT_EQ(two.baseline.recipe.tp, 2u);
  EXPECT_EQ(two.baseline.recipe.gpus, 2u);
  EXPECT_EQ(two.baseline.recipe.parallel, Parallel::kFsdp);
  EXPECT_EQ(two.baseline.recipe.batch * two.baseline.recipe.grad_accum, 4u);
  for (const Plan& p : two.plans) EXPECT_EQ(p.recipe.tp, 2u);
  q.base.tp = 3;
  EXPECT_EQ(error_of([&] { fit(m, q); }),
            "tp: 3 does not divide gpus 4: the planner splits the GPUs into tensor-parallel groups of tp, "
            "data-parallel over the groups");
}

TEST(StepTime, MovesAsTheModelSays) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = base_recipe("h100-80gb", 4096);
  const StepTime base = step_time(m, r);
  EXPECT_GT(base.seconds, 0);
  // 6 FLOPs per parameter and token, plus attention: within a few percent of the textbook figure.
  const double tokens = 4096;
  const double six_nd = 6.0 * static_cast<double>(m.parameter_count) * tokens;
  EXPECT_GT(base.flops, six_nd * 0.95);
  EXPECT_LT(base.flops, six_nd * 1.25);
  r.checkpointing = Checkpointing::kFull;
  EXPECT_GT(step_time(m, r).flops, base.flops * 1.25);  // one more forward of the layers
  r.checkpointing = Checkpointing::kNone;
  r.grad_accum = 4;
  EXPECT_DOUBLE_EQ(step_time(m, r).flops, base.flops * 4);
  r.grad_accum = 1;
  r.precision = Precision::kFp32;
  EXPECT_GT(step_time(m, r).compute_s, base.compute_s * 10);  // no tensor cores
  r.precision = Precision::kBf16Mixed;
  r.lora.rank = 16;
  EXPECT_LT(step_time(m, r).flops, base.flops * 0.75);  // frozen weights get no weight gradient
  EXPECT_EQ(step_time(m, base_recipe("cpu", 128)).seconds, 0);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// Context parallelism (Note [Context parallelism in the planner]): at a sequence length whose
// activations outgrow a GPU, one ring over every GPU is searched beside the data-parallel
// wrappers, and smaller rings under FSDP2; its plans are estimates of exactly their recipe, a ring
// over every GPU runs the whole global batch, smaller ones their group's share, and each GPU
// computes its 1/cp of the tokens.
TEST(Fit, LongSequencesSearchOneContextParallelRing) {
  const Model m = load_model("llama-3.1-8b");
  FitRequest q;
  q.base = base_recipe("h100-80gb", 32768);
  q.gpus = 8;
  q.global_batch = 8;
  q.top = 10;
  const FitResult f = fit(m, q);
  std::size_t rings = 0;
  for (const Plan& p : f.plans) {
    if (p.recipe.cp == 1) continue;
    EXPECT_EQ(p.recipe.cp * p.recipe.gpus, 8u);
    // cp 8 is the one ring, unsharded or sharded over its own ranks; smaller rings are FSDP2's.
    if (p.recipe.cp < 8) EXPECT_EQ(p.recipe.parallel, Parallel::kFsdp);
    if (p.recipe.parallel == Parallel::kNone) EXPECT_EQ(p.recipe.cp, 8u);
    EXPECT_EQ(p.recipe.gpus * p.recipe.batch * p.recipe.grad_accum, 8u);
    EXPECT_NE(p.recipe.precision, Precision::kBf16Mixed);  // the ring runs one dtype
    EXPECT_GT(p.time.comm_s, 0);
    if (rings++ == 0) {
      const Estimate e = estimate(m, p.recipe);
      EXPECT_EQ(e.peak_reserved_bytes, p.peak_reserved_bytes);
      EXPECT_EQ(e.peak_allocated_bytes, p.peak_allocated_bytes);
      // The same step on one GPU computes cp times the FLOPs of a ring rank.
      Recipe one = p.recipe;
      one.cp = 1;
      EXPECT_NEAR(step_time(m, one).flops / p.time.flops, static_cast<double>(p.recipe.cp), 1e-9);
    }
  }
  EXPECT_GE(rings, 1u);
  // The one ring sharded over its own ranks (gpus 1 x cp 8 under FSDP2) holds an eighth of the
  // model states the unsharded ring does: it is searched and offered as a single change.
  EXPECT_TRUE(std::any_of(f.plans.begin(), f.plans.end(), [](const Plan& p) {
    return p.recipe.cp == 8 && p.recipe.gpus == 1 && p.recipe.parallel == Parallel::kFsdp;
  }));
  const auto change_of = [&](std::uint64_t cp, Parallel parallel) {
    return std::find_if(f.changes.begin(), f.changes.end(), [&](const Change& c) {
      return c.plan.recipe.cp == cp && c.plan.recipe.parallel == parallel;
    });
  };
  const auto sharded = change_of(8, Parallel::kFsdp);
  const auto whole = change_of(8, Parallel::kNone);
  ASSERT_NE(sharded, f.changes.end());
  ASSERT_NE(whole, f.changes.end());
  EXPECT_NE(sharded->what.find("one ring of 8 GPUs, sharded over it"), std::string::npos);
  EXPECT_LT(sharded->plan.peak_reserved_bytes, whole->plan.peak_reserved_bytes);
  // The user's bf16-mixed DDP recipe: the single change moves to bf16-true for the ring.
  EXPECT_TRUE(std::any_of(f.changes.begin(), f.changes.end(), [](const Change& c) {
    return c.plan.recipe.cp == 8 && c.what.find("precision bf16-true") != std::string::npos;
  }));
  // A recipe given with cp is refused: the planner searches it itself.
  FitRequest given = q;
  given.base.cp = 2;
  given.base.precision = Precision::kBf16True;
  EXPECT_NE(testing::error_of([&] { (void)fit(m, given); }).find("fit searches context parallelism itself"),
            std::string::npos);
  // GPT-2 is not modelled under context parallelism: no ring.
  FitRequest gpt = q;
  gpt.base = base_recipe("h100-80gb", 1024);
  gpt.top = 50;
  for (const Plan& p : fit(load_model("gpt2"), gpt).plans) EXPECT_EQ(p.recipe.cp, 1u);
}

// Two stages per GPU are searched with data-parallel replicas of the pipeline too (Note [Pipeline
// schedule in the planner]): on 4 H100s the fastest 8B plan is two interleaved stages per GPU
// over two pipeline ranks, DDP over two replicas, an estimate of exactly that recipe; and the
// single changes offer it under both wrappers.
TEST(Fit, InterleavedPipelinesAreSearchedWithReplicas) {
  const Model m = load_model("llama-3.1-8b");
  FitRequest q;
  q.base = base_recipe("h100-80gb", 4096);
  q.gpus = 4;
  q.global_batch = 64;
  q.top = 1;
  const FitResult f = fit(m, q);
  ASSERT_EQ(f.plans.size(), 1u);
  const Recipe& r = f.plans[0].recipe;
  EXPECT_EQ(r.pp_schedule, PipelineSchedule::kInterleaved1F1B);
  EXPECT_EQ(r.pp_stages_per_rank, 2u);
  EXPECT_EQ(r.pp * r.gpus, 4u);
  EXPECT_NE(r.parallel, Parallel::kNone);
  EXPECT_EQ(r.batch * r.grad_accum * r.gpus, 64u);
  const Estimate e = estimate(m, r);
  EXPECT_EQ(e.peak_reserved_bytes, f.plans[0].peak_reserved_bytes);
  for (const char* what : {"pp 2 interleaved-1f1b, 2 stages per GPU x ddp 2", "pp 2 interleaved-1f1b, 2 stages per GPU x fsdp 2"}) {
    EXPECT_TRUE(std::any_of(f.changes.begin(), f.changes.end(), [&](const Change& c) {
      return c.what == what && c.plan.recipe.pp_stages_per_rank == 2 && c.plan.recipe.gpus == 2;
    })) << what;
  }
}

}  // namespace
}  // namespace trainmem
