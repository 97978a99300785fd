// Every trace of a few thousand recipes, one hash per line, to diff one build's graph stage against
// another's: a change meant to make building the trace cheaper must leave every storage (bytes,
// category, refs), event and moment (step, micro-batch, phase, layer, op label, recompute flag)
// as it was (bench/README.md, "Cost per event, fourth pass"). trainmem_exact_diff compares the
// estimates; this compares what they are replayed from, and covers TP, SP, CP, PP and offload too.
//
//   build-bench/bench/trainmem_trace_diff [stride] > new.txt   # 5: 16,848 lines, ~9,200 valid recipes
#include <cstdio>
#include <string>
#include <vector>
#include "graph/step.h"
#include "model/model.h"
#include "trainmem/trainmem.h"
using namespace trainmem;
struct H { std::uint64_t h = 1469598103934665603ull; void add(std::uint64_t v) { for (int i = 0; i < 8; ++i) { h ^= (v >> (8*i)) & 0xff; h *= 1099511628211ull; } } };
int main(int argc, char** argv) {
  const std::vector<std::string> models = {"gpt2", "qwen3-0.6b", "gemma-2-2b", "phi-3-mini-4k-instruct", "llama-3.2-1b",
                                           "qwen2.5-0.5b", "mistral-7b-v0.1", "llama-3.1-8b", "llama-3.1-70b"};
  unsigned k = 0, n = 0;
  const unsigned stride = argc > 1 ? std::stoul(argv[1]) : 7;
  for (const auto& name : models) {
    const Model m = load_model(name);
    for (int p = 0; p < 6; ++p) for (int o = 0; o < 5; ++o) for (int c = 0; c < 2; ++c) for (int a = 0; a < 3; ++a)
    for (int l = 0; l < 2; ++l) for (int g = 0; g < 2; ++g) for (int x = 0; x < 13; ++x) {
      if (k++ % stride) continue;
      Recipe r;
      r.precision = Precision(p); r.optimizer = Optimizer(o); r.checkpointing = Checkpointing(c);
      r.attention = Attention(a); r.loss = Loss(l); r.gpu = g ? "cpu" : "h100-80gb";
      r.batch = 1 + (k / 3) % 4;
      r.seq = std::vector<std::uint64_t>{64, 128, 512, 1024, 2048, 4096}[(k / 5) % 6];
      if (name == "gpt2" && r.seq > 1024) r.seq = 1024;
      r.grad_accum = std::vector<std::uint64_t>{1, 1, 2, 4}[(k / 11) % 4];
      switch (x) {
        case 1: r.lora.rank = 8; break;
        case 2: r.gpus = 2; r.parallel = Parallel::kDdp; break;
        case 3: r.gpus = 2; r.parallel = Parallel::kZero2; break;
        case 4: r.gpus = 2; r.parallel = Parallel::kZero3; if (p != 0 && p != 3) r.precision = Precision::kBf16Master; r.loss = Loss::kStandard; if (o > 1) r.optimizer = Optimizer::kAdamW; break;
        case 5: r.gpus = 2; r.parallel = Parallel::kFsdp; break;
        case 6: r.lora.rank = 16; r.quant.load_in_4bit = true; r.quant.quant_type = QuantType::kNf4; r.precision = Precision::kBf16True; break;
        case 7: r.tp = 2; r.loss = Loss::kStandard; if (o > 1) r.optimizer = Optimizer::kAdamW; if (p != 0 && p != 5) r.precision = Precision::kBf16True; break;
        case 8: r.tp = 2; r.sequence_parallel = true; r.loss = Loss::kStandard; if (o > 1) r.optimizer = Optimizer::kAdamW; if (p != 0 && p != 5) r.precision = Precision::kBf16True; break;
        case 9: r.cp = 2; break;
        case 10: r.pp = 2; r.grad_accum = 4; break;
        case 11: r.gpus = 2; r.parallel = Parallel::kZero3; r.offload = Offload(1 + k % 3); if (p != 0 && p != 3) r.precision = Precision::kBf16Master; r.loss = Loss::kStandard; if (o > 1) r.optimizer = Optimizer::kAdamW; break;
        case 12: r.gpus = 2; r.parallel = Parallel::kZero2; r.offload = Offload::kOptimizer; if (p != 0 && p != 3) r.precision = Precision::kBf16Master; break;
        default: break;
      }
      std::string line;
      try {
        if (r.lora.enabled()) { if (r.precision == Precision::kBf16Master) r.precision = Precision::kBf16True; r.lora.targets = resolve_lora_targets(m.arch, r.lora.targets); }
        r.validate();
        graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
        H h;
        for (auto& s : t.storages) { h.add(s.bytes); h.add((std::uint64_t)s.category); h.add(s.refs); }
        for (auto& e : t.events) { h.add(e.tensor); h.add(e.moment); h.add(e.alloc); }
        for (auto& mo : t.moments) { h.add(mo.step); h.add(mo.micro); h.add((std::uint64_t)mo.phase); h.add((std::uint64_t)(std::uint32_t)mo.layer); h.add(mo.recompute); for (char ch : mo.op) h.add((unsigned char)ch); h.add(0xabc); }
        h.add(t.trainable_parameters);
        line = std::to_string(t.storages.size()) + " " + std::to_string(t.events.size()) + " " + std::to_string(t.moments.size()) + " " + std::to_string(h.h);
      } catch (const std::exception& ex) { line = std::string("error ") + ex.what(); }
      std::printf("%s %u %s\n", name.c_str(), k, line.c_str());
      ++n;
    }
  }
  std::fprintf(stderr, "%u traces\n", n);
}
