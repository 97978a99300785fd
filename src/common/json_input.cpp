#include "common/json_input.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/checked.h"

namespace trainmem::detail {

std::string read_input_file(const std::string& path, std::string_view what, std::uintmax_t max_bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || st.type() == fs::file_type::not_found) {
    throw Error(std::string(what) + ": cannot read '" + path + "' (" +
                (ec ? ec.message() : std::string("no such file or directory")) + ")");
  }
  if (st.type() != fs::file_type::regular) {
    throw Error(std::string(what) + ": '" + path + "' is not a regular file");
  }
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) throw Error(std::string(what) + ": cannot read the size of '" + path + "' (" + ec.message() + ")");
  if (size > max_bytes) {
    throw Error(std::string(what) + ": '" + path + "' is too large (" + format_bytes(size) + "; at most " +
                format_bytes(max_bytes) + ")");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(std::string(what) + ": cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json parse_input_json(std::string_view text, std::string_view what) {
  // The parser keeps its own stack; the callback sees the depth of every value as it opens.
  const nlohmann::json::parser_callback_t cb = [&](int depth, nlohmann::json::parse_event_t event,
                                                    nlohmann::json&) {
    if (depth > kMaxJsonDepth && (event == nlohmann::json::parse_event_t::object_start ||
                                  event == nlohmann::json::parse_event_t::array_start)) {
      throw Error(std::string(what) + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    }
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(text, cb, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(std::string(what) + ": not valid JSON");
  return j;
}

}  // namespace trainmem::detail
