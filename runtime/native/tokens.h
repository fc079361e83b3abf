// Token ids from Python, checked, for both native indexes.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace mlc_spec {

namespace py = pybind11;

// Views `arr` as contiguous T (a copy only if needed), checks every id, returns them as int32.
template <typename T>
inline py::array_t<int32_t> CheckedIds(const py::array& arr) {
  constexpr uint64_t kMaxId = std::numeric_limits<int32_t>::max();
  auto ids = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(arr);
  const T* data = ids.data();
  for (py::ssize_t i = 0; i < ids.size(); ++i) {
    if ((std::is_signed_v<T> && data[i] < 0) || static_cast<uint64_t>(data[i]) > kMaxId) {
      throw py::value_error("token ids must be in [0, 2**31 - 1], got " + std::to_string(data[i]));
    }
  }
  return py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(ids);
}

// Converts any 1-D integer array-like to int32 token ids, rejecting what is not a valid id.
inline py::array_t<int32_t> ToTokens(const py::object& obj) {
  py::array arr = py::array::ensure(obj);
  if (!arr) throw py::value_error("tokens must be a 1-D array-like of integers");
  if (arr.ndim() != 1) {
    throw py::value_error("tokens must be 1-D, got " + std::to_string(arr.ndim()) + " dims");
  }
  if (arr.size() == 0) return py::array_t<int32_t>(0);
  const char kind = arr.dtype().kind();
  if (kind == 'u') return CheckedIds<uint64_t>(arr);
  if (kind != 'i') {
    throw py::value_error("tokens must have an integer dtype, got " +
                          py::str(arr.dtype()).cast<std::string>());
  }
  // int32 (the common case) is checked in place; other signed widths go through int64.
  if (arr.itemsize() == 4) return CheckedIds<int32_t>(arr);
  return CheckedIds<int64_t>(arr);
}

}  // namespace mlc_spec
