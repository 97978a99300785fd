// Every field of a few thousand estimates, one line each, to diff one build against another: a
// change that is meant to make estimates faster and leave them exactly as they were (bench/README.md,
// "Cost per event, third pass") must print the same bytes as the build before it.
//
//   build-bench/bench/trainmem_exact_diff [stride] > new.txt   # every stride-th recipe (13: ~8,000 lines)
//
// 9 catalog models x precision x optimizer x checkpointing x attention x loss x allocator x GPU x
// one of {plain, LoRA, DDP, ZeRO-2, ZeRO-3, FSDP2, generation, QLoRA nf4}, with batch, seq and
// grad_accum spread over them; each estimate also as a stop-limit probe (half its peak reserved)
// and every fifth with a timeline. Recipes the engine rejects print their error.
#include <cstdio>
#include <string>
#include <vector>
#include "report/report.h"
#include "trainmem/trainmem.h"
using namespace trainmem;
int main(int argc, char** argv) {
  const std::vector<std::string> models = {"gpt2", "qwen3-0.6b", "gemma-2-2b", "phi-3-mini-4k-instruct", "llama-3.2-1b",
                                           "qwen2.5-0.5b", "mistral-7b-v0.1", "llama-3.1-8b", "llama-3.1-70b"};
  unsigned k = 0, n = 0;
  const unsigned stride = argc > 1 ? std::stoul(argv[1]) : 7;
  for (const auto& name : models) {
    const Model m = load_model(name);
    for (int p = 0; p < 6; ++p)
      for (int o = 0; o < 5; ++o)
        for (int c = 0; c < 2; ++c)
          for (int a = 0; a < 3; ++a)
            for (int l = 0; l < 2; ++l)
              for (int al = 0; al < 2; ++al)
                for (int g = 0; g < 2; ++g)
                  for (int x = 0; x < 8; ++x) {
                    if (k++ % stride) continue;
                    Recipe r;
                    r.precision = Precision(p);
                    r.optimizer = Optimizer(o);
                    r.checkpointing = Checkpointing(c);
                    r.attention = Attention(a);
                    r.loss = Loss(l);
                    r.allocator = AllocatorMode(al);
                    r.gpu = g ? "cpu" : "h100-80gb";
                    r.batch = 1 + (k / 3) % 4;
                    r.seq = std::vector<std::uint64_t>{64, 128, 512, 1024, 2048, 4096}[(k / 5) % 6];
                    if (name == "gpt2" && r.seq > 1024) r.seq = 1024;
                    r.grad_accum = std::vector<std::uint64_t>{1, 1, 2, 4}[(k / 11) % 4];
                    switch (x) {
                      case 1: r.lora.rank = 8; break;
                      case 2: r.gpus = 2; r.parallel = Parallel::kDdp; break;
                      case 3: r.gpus = 2; r.parallel = Parallel::kZero2; break;
                      case 4: r.gpus = 2; r.parallel = Parallel::kZero3; break;
                      case 5: r.gpus = 2; r.parallel = Parallel::kFsdp; break;
                      case 6: r.mode = Mode::kInference; r.precision = Precision::kBf16True; r.new_tokens = 16; break;
                      case 7: r.lora.rank = 16; r.quant.load_in_4bit = true; r.quant.quant_type = QuantType::kNf4; r.precision = Precision::kBf16True; break;
                      default: break;
                    }
                    std::string line;
                    try {
                      r.validate();
                      Estimate e = estimate(m, r);
                      line = report::to_json(e, false) + " events " + std::to_string(e.events) + " " + std::to_string(e.complete) + " " + std::to_string(e.trainable_parameters);
                      EstimateOptions probe;
                      probe.stop_above_reserved_bytes = e.peak_reserved_bytes / 2 + 1;
                      Estimate s = estimate(m, r, probe);
                      line += " stop " + std::to_string(s.complete) + " " + std::to_string(s.peak_reserved_bytes) + " " +
                              std::to_string(s.peak_allocated_bytes) + " " + std::to_string(s.events);
                      if (k % 5 == 0) {
                        EstimateOptions tl;
                        tl.timeline = true;
                        { Estimate t = estimate(m, r, tl); line += " tl " + report::to_json(t, false) + " " + std::to_string(t.events); }
                      }
                    } catch (const std::exception& ex) {
                      line = std::string("error ") + ex.what();
                    }
                    std::printf("%s %u %s\n", name.c_str(), k, line.c_str());
                    ++n;
                  }
  }
  std::fprintf(stderr, "%u estimates\n", n);
}
