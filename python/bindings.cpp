// trainmem._core: binds the public API and nothing else (see python/trainmem/__init__.py for
// the Pythonic surface). trainmem::Error derives from std::invalid_argument, which nanobind
// raises as ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "report/report.h"
#include "trainmem/trainmem.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

trainmem::Estimate run_estimate(const std::string& model, std::uint64_t batch, std::uint64_t seq,
                                std::uint64_t grad_accum, const std::string& precision,
                                const std::string& optimizer, const std::string& checkpointing,
                                const std::string& attention, const std::string& loss,
                                const std::string& gpu, const std::string& allocator, bool timeline) {
  const trainmem::Recipe r = trainmem::parse_recipe(
      {batch, seq, grad_accum, precision, optimizer, checkpointing, attention, loss, gpu, allocator});
  trainmem::EstimateOptions opt;
  opt.timeline = timeline;
  return trainmem::estimate(trainmem::load_model(model), r, opt);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "trainmem engine (C++): GPU memory of a training step, simulated op by op";

  nb::class_<trainmem::Estimate>(m, "Estimate")
      .def_ro("model", &trainmem::Estimate::model)
      .def_ro("parameters", &trainmem::Estimate::parameters)
      .def_ro("trainable_parameters", &trainmem::Estimate::trainable_parameters)
      .def_ro("peak_allocated_bytes", &trainmem::Estimate::peak_allocated_bytes)
      .def_ro("peak_reserved_bytes", &trainmem::Estimate::peak_reserved_bytes)
      .def_ro("events", &trainmem::Estimate::events)
      .def("to_json", [](const trainmem::Estimate& e) { return trainmem::report::to_json(e); })
      .def("to_text", [](const trainmem::Estimate& e) { return trainmem::report::to_text(e); });

  m.def("estimate", &run_estimate, "model"_a, "batch"_a, "seq"_a, "grad_accum"_a, "precision"_a,
        "optimizer"_a, "checkpointing"_a, "attention"_a, "loss"_a, "gpu"_a, "allocator"_a,
        "timeline"_a);
  m.def("catalog_json", []() {
    std::string out = "[";
    for (const auto& c : trainmem::catalog()) {
      if (out.size() > 1) out += ",";
      out += "{\"name\":\"" + c.name + "\",\"hf_id\":\"" + c.hf_id + "\",\"family\":\"" + c.family +
             "\",\"parameters\":" + std::to_string(c.parameter_count) + "}";
    }
    return out + "]";
  });
}
