// Internals of the planner that tests look at.
#pragma once

#include "trainmem/trainmem.h"

namespace trainmem::plan {

// Bytes per parameter element, and per element of full-size optimizer state, under a precision
// policy (Note [Precision policies] in graph/step_builder.h): half weights for bf16-master and the
// *-true policies; half states only for *-true (bf16-master keeps fp32 masters and states).
inline std::uint64_t parameter_bytes(Precision p) {
  return p == Precision::kBf16Master || p == Precision::kBf16True || p == Precision::kFp16True ? 2 : 4;
}
// A recipe's model parameters: a half-loaded model's are half under autocast (Notes [A half model
// under autocast] and [A half model trained whole] in graph/step_parameters.cpp; a 4-bit base's
// rest without prepare_model_for_kbit_training, Note [QLoRA without prepare_model_for_kbit_training]
// in graph/quant.h).
inline std::uint64_t parameter_bytes(const Recipe& r) {
  return r.half_model() ? 2 : parameter_bytes(r.precision);
}
inline std::uint64_t state_bytes(Precision p) {
  return p == Precision::kBf16True || p == Precision::kFp16True ? 2 : 4;
}
// A recipe's full-size optimizer states: a half model trained whole keeps half ones (zeros_like its
// half parameters); adapters are fp32.
inline std::uint64_t state_bytes(const Recipe& r) {
  return r.half_model() && !r.lora.enabled() ? 2 : state_bytes(r.precision);
}

// Bytes alive together when step 2's optimizer step starts (weights, fp32 masters, every
// parameter's gradient, optimizer states; under ZeRO-1/2 the flat group, this rank's fp32
// partition and states, and the larger of the ipg bucket and the fp32 gradient partition): the
// peak of a two-step estimate is never below it.
std::uint64_t persistent_floor(const Model& m, const Recipe& r);

// Bytes alive together at the standard loss of step 2's forward (Note [The loss floor] in
// plan/fit.cpp): 0 where it is not counted. The peak is never below it either.
std::uint64_t loss_floor(const Model& m, const Recipe& r);

// A few of Recipe::validate's refusals, told without an exception (Note [Refusals the search
// skips] in plan/fit.cpp): true only for recipes validate() refuses.
bool plainly_refused(const Recipe& r);

// Whether the events of `r`'s step before its first optimizer step are the same whichever
// optimizer it names (Note [Optimizer twins] in plan/fit.cpp).
bool optimizer_waits_for_its_step(const Recipe& r);

// Internal: the search before the loss floor and the closest miss's stop limit, with one
// estimate() per recipe on the caller's thread (Note [Planner threads] in plan/fit.cpp); kept for
// the differential tests and the benchmark: same answers, more replays.
FitResult fit_reference(const Model& model, const FitRequest& request);

}  // namespace trainmem::plan
