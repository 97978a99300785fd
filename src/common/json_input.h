// JSON the user hands us (config.json, trainmem-measure output): read from a regular file of
// bounded size and parsed with a bounded nesting depth, so that a FIFO, /dev/zero or a value
// nested 100,000 deep ends as a trainmem::Error rather than a hang, a full memory or a stack
// overflow in the code that later copies the value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace trainmem::detail {

// Deeper than any file trainmem reads (a config.json nests three or four levels).
constexpr int kMaxJsonDepth = 128;

// The whole of the regular file `path`; `what` names it in errors ("config.json", "compare").
std::string read_input_file(const std::string& path, std::string_view what, std::uintmax_t max_bytes);

// `text` as a JSON document; throws Error "<what>: not valid JSON" or "<what>: nested deeper than ...".
nlohmann::json parse_input_json(std::string_view text, std::string_view what);

}  // namespace trainmem::detail
