// trainmem._core: binds the public API and nothing else (see python/trainmem/__init__.py for
// the Pythonic surface). trainmem::Error (a std::invalid_argument) is raised as ValueError, its
// message decoded with backslashreplace: it may echo a path that is not UTF-8.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "report/report.h"
#include "trainmem/trainmem.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Model sources arrive as bytes (os.fsencode): a path need not be valid UTF-8.
std::string source_of(const nb::bytes& model) { return std::string(model.c_str(), model.size()); }

trainmem::Estimate run_estimate(const nb::bytes& model_bytes, const trainmem::RecipeSpelling& spelling,
                                bool timeline, bool phases, std::int64_t rank, bool seq_given) {
  const std::string model = source_of(model_bytes);
  trainmem::Recipe r = trainmem::parse_recipe(spelling);
  trainmem::EstimateOptions opt;
  opt.timeline = timeline;
  opt.phases = phases;
  opt.rank = rank;  // -1: the worst rank
  const trainmem::Model m = trainmem::load_model(model);
  if (!seq_given) r.seq = trainmem::default_seq(m, r);
  return trainmem::estimate(m, r, opt);
}

// Returns (json, text) of trainmem::fit.
std::pair<std::string, nb::bytes> run_fit(const nb::bytes& model_bytes, const trainmem::RecipeSpelling& spelling,
                                            std::uint64_t gpus, std::uint64_t global_batch,
                                            const std::vector<std::string>& fixed, std::uint64_t top,
                                            std::uint64_t host_memory_bytes, bool seq_given) {
  const std::string model = source_of(model_bytes);
  trainmem::FitRequest q;
  q.base = trainmem::parse_fit_recipe(spelling);
  q.gpus = gpus;
  q.global_batch = global_batch;
  q.fixed = fixed;
  q.top = static_cast<std::size_t>(top);
  q.host_memory_bytes = host_memory_bytes;
  const trainmem::Model m = trainmem::load_model(model);
  if (!seq_given) q.base.seq = trainmem::default_seq(m, q.base);
  const trainmem::FitResult f = trainmem::fit(m, q);
  const std::string text = trainmem::report::fit_to_text(m.name, f);
  return {trainmem::report::fit_to_json(m.name, f), nb::bytes(text.data(), text.size())};
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "trainmem engine (C++): GPU memory of a training step, simulated op by op";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      PyObject* msg = PyUnicode_DecodeUTF8(what.data(), static_cast<Py_ssize_t>(what.size()), "backslashreplace");
      if (msg == nullptr) {
        PyErr_SetString(PyExc_ValueError, "bad input (the message could not be decoded)");
        return;
      }
      PyErr_SetObject(PyExc_ValueError, msg);
      Py_DECREF(msg);
    }
  });

  using trainmem::RecipeSpelling;
  nb::class_<RecipeSpelling>(m, "RecipeSpelling")
      .def(nb::init<>())
      .def_rw("batch", &RecipeSpelling::batch)
      .def_rw("seq", &RecipeSpelling::seq)
      .def_rw("grad_accum", &RecipeSpelling::grad_accum)
      .def_rw("precision", &RecipeSpelling::precision)
      .def_rw("optimizer", &RecipeSpelling::optimizer)
      .def_rw("checkpointing", &RecipeSpelling::checkpointing)
      .def_rw("attention", &RecipeSpelling::attention)
      .def_rw("loss", &RecipeSpelling::loss)
      .def_rw("attention_mask", &RecipeSpelling::attention_mask)
      .def_rw("gpu", &RecipeSpelling::gpu)
      .def_rw("allocator", &RecipeSpelling::allocator)
      .def_rw("lora_rank", &RecipeSpelling::lora_rank)
      .def_rw("lora_targets", &RecipeSpelling::lora_targets)
      .def_rw("lora_dropout", &RecipeSpelling::lora_dropout)
      .def_rw("load_in_4bit", &RecipeSpelling::load_in_4bit)
      .def_rw("bnb_4bit_quant_type", &RecipeSpelling::bnb_4bit_quant_type)
      .def_rw("load_dtype", &RecipeSpelling::load_dtype)
      .def_rw("bnb_4bit_quant_storage", &RecipeSpelling::bnb_4bit_quant_storage)
      .def_rw("prepare_kbit_training", &RecipeSpelling::prepare_kbit_training)
      .def_rw("bnb_4bit_use_double_quant", &RecipeSpelling::bnb_4bit_use_double_quant)
      .def_rw("load_in_8bit", &RecipeSpelling::load_in_8bit)
      .def_rw("mode", &RecipeSpelling::mode)
      .def_rw("new_tokens", &RecipeSpelling::new_tokens)
      .def_rw("beams", &RecipeSpelling::beams)
      .def_rw("gpus", &RecipeSpelling::gpus)
      .def_rw("parallel", &RecipeSpelling::parallel)
      .def_rw("tp", &RecipeSpelling::tp)
      .def_rw("sequence_parallel", &RecipeSpelling::sequence_parallel)
      .def_rw("loss_parallel", &RecipeSpelling::loss_parallel)
      .def_rw("cp", &RecipeSpelling::cp)
      .def_rw("pp", &RecipeSpelling::pp)
      .def_rw("pp_schedule", &RecipeSpelling::pp_schedule)
      .def_rw("pp_stages_per_rank", &RecipeSpelling::pp_stages_per_rank)
      .def_rw("fsdp_reshard_after_forward", &RecipeSpelling::fsdp_reshard_after_forward)
      .def_rw("fsdp_replicate", &RecipeSpelling::fsdp_replicate)
      .def_rw("fsdp_param_dtype", &RecipeSpelling::fsdp_param_dtype)
      .def_rw("fsdp_reduce_dtype", &RecipeSpelling::fsdp_reduce_dtype)
      .def_rw("ddp_find_unused_parameters", &RecipeSpelling::ddp_find_unused_parameters)
      .def_rw("ddp_gradient_as_bucket_view", &RecipeSpelling::ddp_gradient_as_bucket_view)
      .def_rw("ddp_no_sync", &RecipeSpelling::ddp_no_sync)
      .def_rw("fp32_outputs", &RecipeSpelling::fp32_outputs)
      .def_rw("fsdp_no_sync", &RecipeSpelling::fsdp_no_sync)
      .def_rw("use_cache", &RecipeSpelling::use_cache)
      .def_rw("clip_grad_norm", &RecipeSpelling::clip_grad_norm)
      .def_rw("offload", &RecipeSpelling::offload);

  nb::class_<trainmem::Estimate>(m, "Estimate")
      .def_ro("model", &trainmem::Estimate::model)
      .def_ro("parameters", &trainmem::Estimate::parameters)
      .def_ro("trainable_parameters", &trainmem::Estimate::trainable_parameters)
      .def_ro("peak_allocated_bytes", &trainmem::Estimate::peak_allocated_bytes)
      .def_ro("peak_reserved_bytes", &trainmem::Estimate::peak_reserved_bytes)
      .def_ro("events", &trainmem::Estimate::events)
      .def("to_json", [](const trainmem::Estimate& e) { return trainmem::report::to_json(e); })
      // The picture echoes the model path, which need not be UTF-8: bytes, decoded in Python.
      .def("to_text", [](const trainmem::Estimate& e) {
        const std::string t = trainmem::report::to_text(e);
        return nb::bytes(t.data(), t.size());
      });

  m.def("estimate", &run_estimate, "model"_a, "recipe"_a, "timeline"_a, "phases"_a, "rank"_a, "seq_given"_a);
  m.def("fit_knobs", &trainmem::fit_knobs);
  m.def("fit", &run_fit, "model"_a, "recipe"_a, "gpus"_a, "global_batch"_a, "fixed"_a, "top"_a, "host_memory_bytes"_a,
        "seq_given"_a);
  m.attr("DEFAULT_HOST_MEMORY_BYTES") = trainmem::kDefaultHostMemoryBytes;
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
