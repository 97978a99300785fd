// Renderings of an Estimate: the terminal picture and the stable JSON of docs/schema.md.
#pragma once

#include <string>

#include "trainmem/trainmem.h"

namespace trainmem::report {

std::string to_json(const Estimate& est, bool pretty = true);
std::string to_text(const Estimate& est);
std::string recipe_json(const Recipe& r);
std::string fit_to_json(const std::string& model, const FitResult& fit, bool pretty = true);
std::string fit_to_text(const std::string& model, const FitResult& fit);

}  // namespace trainmem::report
