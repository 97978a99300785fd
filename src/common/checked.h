// Overflow-checked byte arithmetic and internal invariants.
//
// User input can ask for absurd sizes (10^15 parameters, a sequence length that overflows a byte
// count). Every byte quantity that depends on input goes through these helpers, so such input
// ends as a trainmem::Error naming what overflowed instead of a wrapped, plausible number.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "trainmem/trainmem.h"

namespace trainmem::detail {

[[noreturn]] void bug(std::string_view what, const char* file, int line);

#define TRAINMEM_ASSERT(cond, what) \
  do {                              \
    if (!(cond)) ::trainmem::detail::bug((what), __FILE__, __LINE__); \
  } while (0)

inline std::uint64_t mul(std::uint64_t a, std::uint64_t b, std::string_view what) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw Error(std::string(what) + " overflows a 64-bit byte count; use smaller sizes");
  }
  return r;
}

inline std::uint64_t add(std::uint64_t a, std::uint64_t b, std::string_view what) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    throw Error(std::string(what) + " overflows a 64-bit byte count; use smaller sizes");
  }
  return r;
}

inline std::uint64_t mul(std::initializer_list<std::uint64_t> xs, std::string_view what) {
  std::uint64_t r = 1;
  for (std::uint64_t x : xs) r = mul(r, x, what);
  return r;
}

// "12.50 GiB": binary units, as torch prints memory.
std::string format_bytes(std::uint64_t bytes);
std::string format_count(std::uint64_t n);
// ASCII lowercase (catalog names, recipe spellings).
std::string lower(std::string_view s);

}  // namespace trainmem::detail
