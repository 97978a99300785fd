#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "common/checked.h"

namespace trainmem {

std::string_view category_name(Category c) {
  switch (c) {
    case Category::kWeights: return "weights";
    case Category::kOptimizerStates: return "optimizer_states";
    case Category::kGradients: return "gradients";
    case Category::kActivations: return "activations";
    case Category::kTemporaries: return "temporaries";
    case Category::kOther: return "other";
  }
  return "?";
}

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::kSetup: return "setup";
    case Phase::kForward: return "forward";
    case Phase::kLoss: return "loss";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kPrefill: return "prefill";
    case Phase::kDecode: return "decode";
  }
  return "?";
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
    case DType::kI8: return "int8";
    case DType::kI32: return "int32";
  }
  return "?";
}

std::uint64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kI64: return 8;
    case DType::kU8:
    case DType::kI8: return 1;
    case DType::kI32: return 4;
  }
  return 0;
}

std::string_view family_name(Family f) {
  switch (f) {
    case Family::kGpt2: return "gpt2";
    case Family::kLlama: return "llama";
    case Family::kMistral: return "mistral";
    case Family::kQwen2: return "qwen2";
    case Family::kQwen3: return "qwen3";
    case Family::kGemma2: return "gemma2";
    case Family::kPhi3: return "phi3";
  }
  return "?";
}

namespace detail {

void bug(std::string_view what, const char* file, int line) {
  std::fprintf(stderr, "trainmem: internal error (a bug, please report it): %.*s at %s:%d\n",
               static_cast<int>(what.size()), what.data(), file, line);
  std::abort();
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

// 8030261248 → "8.03 B", 20971520 → "20.97 M" (decimal, as parameter counts are quoted).
std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

std::string format_count(std::uint64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (n >= 1000000000ull) std::snprintf(buf, sizeof buf, "%.2f B", v / 1e9);
  else if (n >= 1000000ull) std::snprintf(buf, sizeof buf, "%.2f M", v / 1e6);
  else if (n >= 1000ull) std::snprintf(buf, sizeof buf, "%.2f K", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace detail
}  // namespace trainmem
