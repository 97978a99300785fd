// Helpers shared by the C++ test files.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <typeinfo>
#include <utility>

#include "trainmem/trainmem.h"

namespace trainmem::testing {

// Runs fn, expects it to throw exactly trainmem::Error, and returns what() ("" if it did not).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected trainmem::Error, got " << typeid(e).name() << ": " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

}  // namespace trainmem::testing
