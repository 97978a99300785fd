// The data/ files compiled into the library (see cmake/embed_data.cmake).
#pragma once
#include <string_view>
#include <vector>

namespace trainmem::data {
struct File {
  std::string_view path;      // relative to data/, e.g. "models/qwen3-4b.json"
  std::string_view contents;
};
const std::vector<File>& files();
}  // namespace trainmem::data
