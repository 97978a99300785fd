// Fuzzes the `trainmem` command's argv handling end to end: CLI11 parsing, the unknown-command
// check, parse_count, the parse_* spellings, Recipe::validate, load_model on whatever name or
// path comes in, estimate and both renderings. The real main of src/cli/main.cpp is linked in
// under the name trainmem_cli_main (cli_main.cpp).
//
// Input: argv tokens separated by '\n' (argv[0] is supplied). Seeds: corpus/fuzz_cli/.
// Checks: the exit code is 0 or 2, and with 2 nothing reached stdout (the output contract of
// main.cpp). Stdout is captured in a memfd; run with -close_fd_mask=2 to silence stderr.
//
// Note [The CLI writes files]
// `estimate --trace FILE` writes wherever it is told, so the harness runs in a scratch directory
// of its own (with `data` and `tests` linked in from the source tree, for the relative paths of
// the seeds) and rewrites every --trace value to "trace.jsonl" in it. Without this, a campaign
// scatters event traces named by fuzzed bytes over the working directory.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <charconv>
#include <vector>

#include "fuzz_common.h"

int trainmem_cli_main(int argc, char** argv);

namespace {

constexpr std::size_t kMaxTokens = 32;
int g_stdout = -1;
std::string g_sandbox;

// See Note [The CLI writes files].
void confine_output_paths(std::vector<std::string>& tokens) {
  const std::string_view flag = "--trace";
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    std::string_view t = tokens[k];
    if (t == flag && k + 1 < tokens.size()) tokens[k + 1] = "trace.jsonl";
    else if (t.substr(0, flag.size() + 1) == "--trace=") tokens[k] = "--trace=trace.jsonl";
  }
}

bool parses_above(std::string_view v, std::uint64_t limit) {
  std::uint64_t x = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  return ec == std::errc() && ptr == v.data() + v.size() && x > limit;
}

// See Note [Fuzzing caps]: the CLI has no hook, so inputs asking for more micro-batches than
// the cap are skipped before main sees them.
bool too_costly(const std::vector<std::string>& tokens) {
  const std::string_view flag = "--grad-accum";
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    std::string_view t = tokens[k];
    if (t.substr(0, flag.size()) != flag) continue;
    if (t.size() == flag.size() && k + 1 < tokens.size() && parses_above(tokens[k + 1], fuzz::kMaxGradAccum))
      return true;
    if (t.size() > flag.size() && t[flag.size()] == '=' &&
        parses_above(t.substr(flag.size() + 1), fuzz::kMaxGradAccum))
      return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_stdout = memfd_create("trainmem-fuzz-stdout", 0);
  if (g_stdout < 0 || dup2(g_stdout, STDOUT_FILENO) < 0) fuzz::finding("cannot capture stdout");
  char tmpl[] = "/dev/shm/trainmem-fuzz-cli-XXXXXX";
  char alt[] = "/tmp/trainmem-fuzz-cli-XXXXXX";
  const char* d = mkdtemp(tmpl);
  if (d == nullptr) d = mkdtemp(alt);
  if (d == nullptr) fuzz::finding("cannot create a scratch directory");
  g_sandbox = d;
  for (const char* sub : {"data", "tests"}) {
    std::string from = std::string(TRAINMEM_SOURCE_DIR) + "/" + sub;
    if (symlink(from.c_str(), (g_sandbox + "/" + sub).c_str()) != 0) fuzz::finding("cannot link", sub);
  }
  if (chdir(d) != 0) fuzz::finding("cannot enter the scratch directory");
  std::atexit([] {
    for (const char* f : {"data", "tests", "trace.jsonl"}) unlink((g_sandbox + "/" + f).c_str());
    rmdir(g_sandbox.c_str());
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> tokens;
  std::string cur;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      tokens.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(data[i]));
    }
  }
  if (!cur.empty() || size == 0 || data[size - 1] != '\n') tokens.push_back(std::move(cur));
  if (size == 0) tokens.clear();
  if (tokens.size() > kMaxTokens || too_costly(tokens)) return 0;
  confine_output_paths(tokens);

  std::vector<char*> argv;
  std::string argv0 = "trainmem";
  argv.push_back(argv0.data());
  for (auto& t : tokens) argv.push_back(t.data());
  argv.push_back(nullptr);

  std::fflush(stdout);
  if (ftruncate(STDOUT_FILENO, 0) != 0 || lseek(STDOUT_FILENO, 0, SEEK_SET) != 0) {
    fuzz::finding("cannot reset captured stdout");
  }
  int rc = 0;
  // main must catch bad input itself: a trainmem::Error or overflow_error escaping it is a
  // finding too (the user would see std::terminate, not "trainmem: error: ...").
  if (!fuzz::expected_outcome([&] { rc = trainmem_cli_main(static_cast<int>(argv.size() - 1), argv.data()); })) {
    fuzz::finding("a bad-input exception escaped main");
  }
  std::fflush(stdout);
  const off_t written = lseek(STDOUT_FILENO, 0, SEEK_CUR);
  if (rc != 0 && rc != 2) fuzz::finding("exit code is neither 0 nor 2:", std::to_string(rc).c_str());
  if (rc == 2 && written != 0) fuzz::finding("exit code 2 with output on stdout");
  return 0;
}
