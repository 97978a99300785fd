// Can an estimate be extrapolated over depth? The study behind Note [Estimates are not
// extrapolated over layers] (src/model/depth.cpp).
//
// For every catalog model and 288 recipes it replays the model cut to 2..10 layers and the full
// model, then asks each extrapolation rule below for the full model's Estimate: the rule checks
// that its sample depths lie on a line in every field (peaks, breakdown, step peaks, event count)
// and at the same peak moment (the same op, at a fixed layer or at the last layer), extrapolates
// when they do and declines when they do not. An accepted extrapolation is right only if every
// field equals the full replay's.
//
//   trainmem_depth_study [seq ...]      (default: 128 1024 4096; batch 1)
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "model/model.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

// The fields an Estimate's numbers are made of, plus its peak moment with the layer split off.
struct Sample {
  std::vector<std::int64_t> numbers;  // [0] peak allocated, [1] peak reserved, then the rest
  std::string moment;                 // "step/micro/phase/op" without the layer index
  std::int64_t layer = -1;            // layer of the peak op, -1 when outside the layers
};

Sample sample(const Estimate& e) {
  Sample s;
  s.numbers = {static_cast<std::int64_t>(e.peak_allocated_bytes), static_cast<std::int64_t>(e.peak_reserved_bytes),
               static_cast<std::int64_t>(e.events)};
  for (std::uint64_t b : e.breakdown_at_peak) s.numbers.push_back(static_cast<std::int64_t>(b));
  for (const StepPeak& p : e.steps) {
    s.numbers.push_back(static_cast<std::int64_t>(p.peak_allocated_bytes));
    s.numbers.push_back(static_cast<std::int64_t>(p.peak_reserved_bytes));
  }
  std::string op = e.peak.op;
  if (op.rfind("layer ", 0) == 0) {
    const std::size_t space = op.find(' ', 6);
    s.layer = std::stoll(op.substr(6, space - 6));
    op = op.substr(space + 1);
  }
  s.moment = std::to_string(e.peak.step) + "/" + std::to_string(e.peak.micro_batch) + "/" +
             std::string(phase_name(e.peak.phase)) + "/" + op;
  return s;
}

struct Rule {
  const char* name;
  std::vector<std::vector<std::int64_t>> tries;  // sample depths, tried in order
};

enum class Outcome { kDeclined, kRight, kWrong };

struct Tally {
  int declined = 0, right = 0, wrong = 0;
  double worst_allocated = 0, worst_reserved = 0;  // relative error of accepted wrong answers
};

// One try: nullopt-like `declined` when the samples are not collinear or the moment moves.
Outcome apply(const std::map<std::int64_t, Sample>& cut, const std::vector<std::int64_t>& depths, std::int64_t L,
              const Sample& full, Tally& tally) {
  const Sample& a = cut.at(depths[0]);
  const Sample& b = cut.at(depths[1]);
  const std::int64_t step = depths[1] - depths[0];
  for (std::size_t i = 2; i < depths.size(); ++i) {
    const Sample& p = cut.at(depths[i - 1]);
    const Sample& q = cut.at(depths[i]);
    for (std::size_t f = 0; f < a.numbers.size(); ++f) {
      if ((q.numbers[f] - p.numbers[f]) * step != (b.numbers[f] - a.numbers[f]) * (depths[i] - depths[i - 1])) {
        return Outcome::kDeclined;
      }
    }
  }
  bool fixed = true, last = true;
  for (std::int64_t d : depths) {
    const Sample& s = cut.at(d);
    if (s.moment != a.moment) return Outcome::kDeclined;
    fixed = fixed && s.layer == a.layer;
    last = last && s.layer == d - 1;
  }
  if (!fixed && !last) return Outcome::kDeclined;
  bool right = full.moment == a.moment && full.layer == (fixed ? a.layer : L - 1);
  for (std::size_t f = 0; f < a.numbers.size(); ++f) {
    const std::int64_t slope = (b.numbers[f] - a.numbers[f]) / step;
    const std::int64_t guess = a.numbers[f] + (L - depths[0]) * slope;
    if (guess == full.numbers[f]) continue;
    right = false;
    if (f < 2) {
      const double err = std::fabs(static_cast<double>(guess - full.numbers[f])) / static_cast<double>(full.numbers[f]);
      double& worst = f == 0 ? tally.worst_allocated : tally.worst_reserved;
      worst = std::max(worst, err);
    }
  }
  return right ? Outcome::kRight : Outcome::kWrong;
}

}  // namespace
}  // namespace trainmem

int main(int argc, char** argv) {
  using namespace trainmem;
  std::vector<std::uint64_t> seqs;
  for (int i = 1; i < argc; ++i) seqs.push_back(std::strtoull(argv[i], nullptr, 10));
  if (seqs.empty()) seqs = {128, 1024, 4096};

  const std::vector<Rule> rules = {
      {"3 depths: 2,3,4", {{2, 3, 4}}},
      {"3 depths: 2,3,4 then 4,5,6 then 8,9,10", {{2, 3, 4}, {4, 5, 6}, {8, 9, 10}}},
      {"4 depths: 2..5", {{2, 3, 4, 5}}},
      {"5 depths: 2..6", {{2, 3, 4, 5, 6}}},
      {"9 depths: 2..10", {{2, 3, 4, 5, 6, 7, 8, 9, 10}}},
  };
  const Precision precisions[] = {Precision::kFp32,       Precision::kBf16Mixed, Precision::kFp16Mixed,
                                  Precision::kBf16Master, Precision::kBf16True,  Precision::kFp16True};
  const Optimizer optimizers[] = {Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kAdafactor};

  std::printf("%-8s %-42s %9s %7s %7s %16s %16s\n", "seq", "rule", "declined", "right", "wrong",
              "worst alloc err", "worst resv err");
  for (std::uint64_t seq : seqs) {
    std::vector<Tally> tallies(rules.size());
    for (const CatalogEntry& entry : catalog()) {
      const Model m = load_model(entry.name);
      const auto L = static_cast<std::int64_t>(m.arch.num_layers);
      std::vector<Model> cut_models;
      for (std::int64_t d = 2; d <= 10 && d < L; ++d) cut_models.push_back(model::with_layers(m, d));
      for (Precision p : precisions)
        for (Optimizer o : optimizers)
          for (Checkpointing ck : {Checkpointing::kNone, Checkpointing::kFull})
            for (Attention at : {Attention::kEager, Attention::kSdpa})
              for (AllocatorMode al : {AllocatorMode::kDefault, AllocatorMode::kExpandable})
                for (const char* gpu : {"h100-80gb", "cpu"}) {
                  Recipe r;
                  // GPT-2 has n_positions (1,024) positions; a longer seq is refused.
                  r.seq = m.arch.family == Family::kGpt2 ? std::min<std::uint64_t>(seq, m.arch.max_positions) : seq;
                  r.precision = p;
                  r.optimizer = o;
                  r.checkpointing = ck;
                  r.attention = at;
                  r.allocator = al;
                  r.gpu = gpu;
                  const Sample full = sample(estimate(m, r));
                  std::map<std::int64_t, Sample> cut;
                  for (const Model& c : cut_models) {
                    cut[static_cast<std::int64_t>(c.arch.num_layers)] = sample(estimate(c, r));
                  }
                  for (std::size_t k = 0; k < rules.size(); ++k) {
                    Outcome out = Outcome::kDeclined;
                    for (const auto& depths : rules[k].tries) {
                      if (depths.back() >= L) break;  // too shallow a model to cut that far
                      out = apply(cut, depths, L, full, tallies[k]);
                      if (out != Outcome::kDeclined) break;
                    }
                    Tally& t = tallies[k];
                    (out == Outcome::kDeclined ? t.declined : out == Outcome::kRight ? t.right : t.wrong)++;
                  }
                }
    }
    for (std::size_t k = 0; k < rules.size(); ++k) {
      const Tally& t = tallies[k];
      std::printf("%-8llu %-42s %9d %7d %7d %15.1f%% %15.1f%%\n", static_cast<unsigned long long>(seq), rules[k].name,
                  t.declined, t.right, t.wrong, 100 * t.worst_allocated, 100 * t.worst_reserved);
    }
    std::fflush(stdout);
  }
  return 0;
}
