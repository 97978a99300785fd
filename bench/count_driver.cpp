// The driver for counting instructions per estimate under callgrind (bench/README.md, "Cost per
// event"): loads a catalog model once, then runs the default recipe at seq 4096 (GPT-2: 1024) `n` times, the
// whole estimate or the graph stage alone, with layer stamping on or off. Run it with n = 1 and
// n = 6; (Ir(6) - Ir(1)) / 5 is one run without the loading.
//
//   valgrind --tool=callgrind --callgrind-out-file=/dev/null build-bench/bench/trainmem_count
//     llama-3.1-70b 6 [estimate|graph] [stamping 1|0]
#include <algorithm>
#include <cstdio>
#include <string>

#include "graph/step.h"
#include "trainmem/trainmem.h"

int main(int argc, char** argv) {
  using namespace trainmem;
  if (argc < 3) {
    std::fprintf(stderr, "usage: trainmem_count MODEL N [estimate|graph] [stamping 1|0]\n");
    return 2;
  }
  const Model m = load_model(argv[1]);
  const int n = std::stoi(argv[2]);
  const bool graph_only = argc > 3 && std::string(argv[3]) == "graph";
  graph::set_layer_stamping(argc <= 4 || std::string(argv[4]) != "0");
  Recipe r;
  r.seq = std::min<std::uint64_t>(4096, m.arch.family == Family::kGpt2 ? m.arch.max_positions : 4096);
  const Gpu gpu = find_gpu(r.gpu);
  unsigned long long sum = 0;  // printed, so that nothing is optimised away
  for (int i = 0; i < n; ++i) {
    if (graph_only) {
      graph::Trace t = graph::build_training_trace(m, r, gpu);
      sum += t.events.size();
      graph::recycle(std::move(t));
    } else {
      sum += estimate(m, r).peak_reserved_bytes;
    }
  }
  std::printf("%llu\n", sum);
}
