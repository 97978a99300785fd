// Renderings of an Estimate: the terminal picture and the stable JSON of docs/schema.md.
#pragma once

#include <string>

#include "trainmem/trainmem.h"

namespace trainmem::report {

std::string to_json(const Estimate& est, bool pretty = true);
// Whether the peak reserved bytes and the CUDA context fit in the GPU's memory; always true on a
// device of no capacity (the CPU, which the text and JSON leave unjudged).
bool fits_gpu(const Estimate& est);
std::string to_text(const Estimate& est);
std::string recipe_json(const Recipe& r);
std::string fit_to_json(const std::string& model, const FitResult& fit, bool pretty = true);
std::string fit_to_text(const std::string& model, const FitResult& fit);

}  // namespace trainmem::report
