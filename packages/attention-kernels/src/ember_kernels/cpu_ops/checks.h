// Argument checks of the compiled kernels, raised as standard exceptions, which pybind11 turns
// into Python's: std::invalid_argument into ValueError, std::runtime_error into RuntimeError.
// torch's own c10::Error (TORCH_CHECK) can crash the process instead when thrown from an
// extension built by a compiler other than torch's (seen with torch's wheels and a system g++:
// every c10::Error thrown from a test extension crashed, standard exceptions crossed fine).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>  // c10::str

#include <stdexcept>

// ValueError(message) unless cond; the message's parts are joined as c10::str joins them.
#define EMBER_CHECK_VALUE(cond, ...)                                   \
  do {                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                       \
      throw std::invalid_argument(::c10::str(__VA_ARGS__));            \
    }                                                                  \
  } while (false)

// RuntimeError(message) unless cond.
#define EMBER_CHECK(cond, ...)                                         \
  do {                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                       \
      throw std::runtime_error(::c10::str(__VA_ARGS__));               \
    }                                                                  \
  } while (false)
