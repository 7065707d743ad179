// One error vocabulary for all of csrc/: every failed check throws flux::Error (a std::runtime_error) with
// file:line and what was expected; nothing calls exit(). The torch binding layer turns these into Python errors.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace flux {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
[[noreturn]] inline void fail(const char* file, int line, const char* cond, Args&&... args) {
  std::ostringstream os;
  os << "flux_layers: ";
  ((os << args), ...);
  os << " [" << cond << " failed at " << file << ":" << line << "]";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace flux

// FLUX_CHECK(cond, "message parts", value, ...): throws flux::Error when cond is false.
#define FLUX_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) ::flux::detail::fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)

// CUDA runtime call that must succeed.
#define FLUX_CUDA_CHECK(expr)                                                                           \
  do {                                                                                                  \
    cudaError_t flux_err_ = (expr);                                                                     \
    if (flux_err_ != cudaSuccess)                                                                       \
      ::flux::detail::fail(__FILE__, __LINE__, #expr, "CUDA error ", cudaGetErrorName(flux_err_), ": ", \
                           cudaGetErrorString(flux_err_));                                              \
  } while (0)
