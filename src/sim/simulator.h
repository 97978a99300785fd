// Replays a graph::Trace through the caching-allocator model and accounts every byte to its
// category: peak allocated and reserved bytes, the breakdown at the peak, where it happened.
#pragma once

#include <memory>

#include "graph/step.h"

namespace trainmem::sim {

// A replay that can follow a trace while it is being built: consume() takes the events added
// since the last call, finish() the rest.
class Replay {
 public:
  Replay(const Recipe& recipe, const EstimateOptions& options);
  ~Replay();
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

  // Called by the graph stage after each micro-batch's backward. kSkipRest when the micro-batch
  // just replayed repeated the one before it exactly, in its events and in the allocator state
  // it left (Note [Repeated micro-batches] in simulator.cpp): every later micro-batch of the
  // step would repeat it too. kStop when reserved bytes passed the options' stop limit.
  // Between a pipeline schedule's actions (micro graph::kMidSchedule) it only consumes the events
  // so far, and only under a stop limit: kStop once they passed it (Note [Peeks inside a
  // schedule] in graph/pipeline.cpp).
  graph::MicroBatchNext micro_batch_done(const graph::Trace& trace, std::uint32_t step, std::uint32_t micro);
  // Mid-schedule calls are answered kGoOn unread; peeked(): one was read.
  void no_peeks();
  bool peeked() const;

  Estimate finish(const graph::Trace& trace);

  struct State;  // defined in simulator.cpp

 private:
  std::unique_ptr<State> s_;
};

// The whole trace at once (no micro-batch is skipped).
Estimate simulate(const graph::Trace& trace, const Recipe& recipe, const EstimateOptions& options);

}  // namespace trainmem::sim
