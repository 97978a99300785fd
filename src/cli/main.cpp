// The `trainmem` command: estimate, models, gpus.
//
// Output contract: on success the whole report is built first and printed at once; on bad
// input one line "trainmem: error: ..." goes to stderr, exit code 2, and nothing to stdout.
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <iostream>
#include <string>

#include "report/report.h"
#include "trainmem/trainmem.h"

namespace {

using trainmem::Error;

std::uint64_t parse_count(const std::string& s, const char* field) {
  std::uint64_t v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || ptr != end) {
    throw Error(std::string(field) + ": must be a positive integer, got '" + s + "'");
  }
  return v;
}

int fail(const std::string& msg) {
  std::fprintf(stderr, "trainmem: error: %s\n", msg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainmem: GPU memory of a training step, simulated op by op.\n"
               "Peak allocated/reserved bytes per GPU, broken down into weights, optimizer states,\n"
               "gradients, activations, temporaries and other, with the op where the peak happens."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("trainmem 0.1.0"));

  auto* est = app.add_subcommand("estimate", "Peak memory of one training step for a model and a recipe");
  std::string model, batch = "1", seq = "2048", accum = "1";
  std::string precision = "bf16-mixed", optimizer = "adamw", ckpt = "none", attention = "sdpa",
              loss = "standard", gpu = "h100-80gb", allocator = "default";
  bool as_json = false, timeline = false;
  std::string trace_path;
  est->add_option("model", model,
                  "Catalog name (qwen3-4b), Hugging Face id (Qwen/Qwen3-4B), config.json path or model directory")
      ->required();
  est->add_option("--batch", batch, "Micro-batch size")->capture_default_str();
  est->add_option("--seq", seq, "Sequence length in tokens")->capture_default_str();
  est->add_option("--grad-accum", accum, "Micro-batches per optimizer step")->capture_default_str();
  est->add_option("--precision", precision,
                  "fp32 | bf16-mixed | fp16-mixed | bf16-master | bf16-true | fp16-true")
      ->capture_default_str();
  est->add_option("--optimizer", optimizer, "adamw | adamw-fused | adamw-8bit | sgd | adafactor")
      ->capture_default_str();
  est->add_option("--checkpointing", ckpt, "none | full (per decoder layer)")->capture_default_str();
  est->add_option("--attention", attention, "eager | sdpa | flash")->capture_default_str();
  est->add_option("--loss", loss, "standard (fp32 logits) | fused (chunked linear + cross-entropy)")
      ->capture_default_str();
  est->add_option("--gpu", gpu, "GPU from `trainmem gpus`, or cpu")->capture_default_str();
  est->add_option("--allocator", allocator, "default | expandable (expandable_segments:True)")
      ->capture_default_str();
  est->add_flag("--json", as_json, "Print the JSON object of docs/schema.md");
  est->add_flag("--timeline", timeline, "Include an allocated/reserved timeline in --json");
  est->add_option("--trace", trace_path, "Write every simulated alloc/free event to FILE as JSON lines");

  auto* models = app.add_subcommand("models", "List the built-in model catalog");
  bool models_json = false;
  models->add_flag("--json", models_json, "Print as JSON");
  auto* gpus = app.add_subcommand("gpus", "List the built-in GPU catalog");
  bool gpus_json = false;
  gpus->add_flag("--json", gpus_json, "Print as JSON");

  if (argc > 1 && argv[1][0] != '-') {
    std::string cmd = argv[1];
    if (cmd != "estimate" && cmd != "models" && cmd != "gpus") {
      return fail("unknown command '" + cmd + "'; expected estimate, models or gpus (see --help)");
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return fail(msg + " (see --help)");
  }

  try {
    std::string out;
    if (*est) {
      trainmem::Recipe r;
      r.batch = parse_count(batch, "batch");
      r.seq = parse_count(seq, "seq");
      r.grad_accum = parse_count(accum, "grad_accum");
      r.precision = trainmem::parse_precision(precision);
      r.optimizer = trainmem::parse_optimizer(optimizer);
      r.checkpointing = trainmem::parse_checkpointing(ckpt);
      r.attention = trainmem::parse_attention(attention);
      r.loss = trainmem::parse_loss(loss);
      r.gpu = gpu;
      r.allocator = trainmem::parse_allocator(allocator);
      r.validate();
      trainmem::Model m = trainmem::load_model(model);
      trainmem::EstimateOptions opt;
      opt.timeline = timeline;
      opt.trace_path = trace_path;
      trainmem::Estimate e = trainmem::estimate(m, r, opt);
      out = as_json ? trainmem::report::to_json(e) + "\n" : trainmem::report::to_text(e);
    } else if (*models) {
      auto cat = trainmem::catalog();
      if (models_json) {
        std::string j = "[\n";
        for (std::size_t i = 0; i < cat.size(); ++i) {
          j += "  {\"name\": \"" + cat[i].name + "\", \"hf_id\": \"" + cat[i].hf_id + "\", \"family\": \"" +
               cat[i].family + "\", \"parameters\": " + std::to_string(cat[i].parameter_count) + "}" +
               (i + 1 < cat.size() ? ",\n" : "\n");
        }
        out = j + "]\n";
      } else {
        char line[200];
        std::snprintf(line, sizeof line, "%-24s %-36s %-8s %16s\n", "name", "hugging face id", "family", "parameters");
        out += line;
        for (const auto& c : cat) {
          std::snprintf(line, sizeof line, "%-24s %-36s %-8s %16llu\n", c.name.c_str(), c.hf_id.c_str(),
                        c.family.c_str(), static_cast<unsigned long long>(c.parameter_count));
          out += line;
        }
      }
    } else if (*gpus) {
      auto list = trainmem::gpus();
      if (gpus_json) {
        std::string j = "[\n";
        for (std::size_t i = 0; i < list.size(); ++i) {
          const auto& g = list[i];
          j += "  {\"name\": \"" + g.name + "\", \"capacity_bytes\": " + std::to_string(g.capacity_bytes) +
               ", \"context_bytes\": " + std::to_string(g.context_bytes) +
               ", \"cublas_workspace_bytes\": " + std::to_string(g.cublas_workspace_bytes) + "}" +
               (i + 1 < list.size() ? ",\n" : "\n");
        }
        out = j + "]\n";
      } else {
        char line[200];
        for (const auto& g : list) {
          std::snprintf(line, sizeof line, "%-12s %8.1f GiB  %s\n", g.name.c_str(),
                        static_cast<double>(g.capacity_bytes) / (1ull << 30), g.description.c_str());
          out += line;
        }
      }
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  } catch (const Error& e) {
    return fail(e.what());
  } catch (const std::overflow_error& e) {
    return fail(e.what());
  }
}
