// The allocator model alone, replayed over an estimate's event trace: what callgrind needs to
// count the instructions of CachingAllocator per event without the graph stage or the replay
// loop around it (bench/README.md, "Cost per event, fourth pass").
//
//   build/trainmem estimate llama-3.1-70b --seq 4096 --trace t70.jsonl > /dev/null
//   build-bench/bench/trainmem_alloc_replay t70.jsonl 6 [expandable]
//   valgrind --tool=callgrind build-bench/bench/trainmem_alloc_replay t70.jsonl 1   # and 6: (Ir(6) - Ir(1)) / 5
//
// Every replay after the first starts from reset(), as a pooled replay does (Note [Pooled
// replay state] in src/sim/simulator.cpp). Prints the peaks, so two builds can be compared.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sim/caching_allocator.h"

namespace {
struct Event {
  bool alloc;
  std::uint32_t tensor;
  std::uint64_t bytes;
};

// The value after `"key":` in one JSON line of `trainmem estimate --trace`.
bool field(const char* line, const char* key, std::uint64_t& out) {
  const char* p = std::strstr(line, key);
  if (p == nullptr) return false;
  out = std::strtoull(p + std::strlen(key), nullptr, 10);
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TRACE.jsonl [replays] [expandable]\n", argv[0]);
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "r");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot read %s\n", argv[1]);
    return 2;
  }
  std::vector<Event> events;
  std::uint32_t tensors = 0;
  char line[1024];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    std::uint64_t sid = 0, bytes = 0;
    if (!field(line, "\"sid\":", sid) || !field(line, "\"nbytes\":", bytes)) continue;
    events.push_back({std::strstr(line, "\"event\":\"alloc\"") != nullptr, static_cast<std::uint32_t>(sid), bytes});
    if (sid + 1 > tensors) tensors = static_cast<std::uint32_t>(sid + 1);
  }
  std::fclose(f);
  const int replays = argc > 2 ? std::atoi(argv[2]) : 1;
  trainmem::sim::AllocatorConfig config;
  config.expandable_segments = argc > 3 && std::string(argv[3]) == "expandable";
  trainmem::sim::CachingAllocator allocator(config);
  std::vector<trainmem::sim::CachingAllocator::BlockId> block(tensors);
  for (int r = 0; r < replays; ++r) {
    allocator.reset();
    for (const Event& e : events) {
      if (e.alloc) {
        block[e.tensor] = allocator.allocate(e.bytes);
      } else {
        allocator.release(block[e.tensor]);
      }
    }
  }
  std::printf("%zu events, peak allocated %llu B, peak reserved %llu B, %llu segments at the end\n", events.size(),
              static_cast<unsigned long long>(allocator.peak_allocated_bytes()),
              static_cast<unsigned long long>(allocator.peak_reserved_bytes()),
              static_cast<unsigned long long>(allocator.segment_count()));
  return 0;
}
