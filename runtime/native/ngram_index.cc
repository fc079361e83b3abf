// Prompt-lookup (n-gram) index for speculative decoding.
//
// The index keeps the token history and, for every n in [min_n, max_n], a hash table from the
// n-gram ending at a position to the latest position where it ended. When a token is appended,
// the table entry for each n-gram ending there is read (that is the latest *earlier* occurrence of
// the current suffix) and then overwritten with the new position. Appending costs O(max_n) and a
// proposal O(k + max_n) on average, independent of the context length.
//
// Tables are keyed by a 64-bit hash of the n-gram; a proposal compares the candidate's tokens with
// the current suffix before using it, so a hash collision can only cost a missed draft, never a
// wrong one.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "mix64.h"
#include "tokens.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using mlc_spec::Mix64;
using mlc_spec::ToTokens;

// Open-addressing (linear probing) map from a non-zero 64-bit key to a position; key 0 marks an
// empty slot. Much faster than std::unordered_map for this insert-or-replace workload.
class PositionTable {
 public:
  PositionTable() : slots_(kInitialCapacity) {}

  // Stores `pos` under `key` and returns the position previously stored there, or -1.
  int64_t Exchange(uint64_t key, int64_t pos) {
    key = key ? key : 1;
    if (2 * (used_ + 1) > slots_.size()) Grow();
    Slot& slot = Find(slots_, key);
    int64_t prev = -1;
    if (slot.key == key) {
      prev = slot.pos;
    } else {
      slot.key = key;
      ++used_;
    }
    slot.pos = pos;
    return prev;
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int64_t pos = 0;
  };
  static constexpr size_t kInitialCapacity = 1024;  // power of two

  static Slot& Find(std::vector<Slot>& slots, uint64_t key) {
    size_t mask = slots.size() - 1;
    size_t i = key & mask;
    while (slots[i].key != 0 && slots[i].key != key) i = (i + 1) & mask;
    return slots[i];
  }

  void Grow() {
    std::vector<Slot> bigger(2 * slots_.size());
    for (const Slot& s : slots_) {
      if (s.key != 0) Find(bigger, s.key) = s;
    }
    slots_ = std::move(bigger);
  }

  std::vector<Slot> slots_;
  size_t used_ = 0;
};

class NgramIndex {
 public:
  NgramIndex(int64_t min_n, int64_t max_n) : min_n_(min_n), max_n_(max_n) {
    if (min_n < 1) throw py::value_error("min_n must be >= 1, got " + std::to_string(min_n));
    if (max_n < min_n) {
      throw py::value_error("max_n must be >= min_n, got min_n=" + std::to_string(min_n) +
                            ", max_n=" + std::to_string(max_n));
    }
    tables_.resize(max_n - min_n + 1);
    prev_end_.assign(max_n - min_n + 1, -1);
  }

  void Extend(const int32_t* tokens, size_t count) {
    for (size_t i = 0; i < count; ++i) Append(tokens[i]);
  }

  // The tokens that followed the latest earlier occurrence of the longest matching suffix.
  std::pair<const int32_t*, size_t> Propose(int64_t k) const {
    if (k < 0) throw py::value_error("k must be >= 0, got " + std::to_string(k));
    if (k == 0) return {nullptr, 0};
    const int64_t len = static_cast<int64_t>(history_.size());
    for (int64_t n = max_n_; n >= min_n_; --n) {
      const int64_t end = prev_end_[n - min_n_];
      if (end < 0) continue;
      const int32_t* cand = history_.data() + end - n + 1;
      if (std::memcmp(cand, history_.data() + len - n, n * sizeof(int32_t)) != 0) continue;
      const int64_t available = len - 1 - end;
      return {history_.data() + end + 1, static_cast<size_t>(available < k ? available : k)};
    }
    return {nullptr, 0};
  }

  size_t Size() const { return history_.size(); }
  int64_t min_n() const { return min_n_; }
  int64_t max_n() const { return max_n_; }

 private:
  void Append(int32_t token) {
    history_.push_back(token);
    const int64_t pos = static_cast<int64_t>(history_.size()) - 1;
    // Hash the n-grams ending at `pos` from the right, one token further left per n.
    uint64_t hash = 0x9e3779b97f4a7c15ULL;
    // Only n-grams that fit in the history end here; prev_end_ of longer ones stays -1.
    const int64_t longest = std::min(max_n_, pos + 1);
    for (int64_t n = 1; n <= longest; ++n) {
      const uint64_t tok = static_cast<uint32_t>(history_[pos - n + 1]);
      hash = Mix64(hash + 0x9e3779b97f4a7c15ULL * (tok + 1));
      if (n >= min_n_) prev_end_[n - min_n_] = tables_[n - min_n_].Exchange(hash, pos);
    }
  }

  int64_t min_n_;
  int64_t max_n_;
  std::vector<int32_t> history_;
  std::vector<PositionTable> tables_;  // tables_[n - min_n]
  std::vector<int64_t> prev_end_;      // latest earlier end of the current n-gram suffix, or -1
};

}  // namespace

PYBIND11_MODULE(_ngram, m) {
  m.doc() = "Native prompt-lookup (n-gram) index for speculative decoding.";
  py::class_<NgramIndex>(m, "NgramIndex")
      .def(py::init<int64_t, int64_t>(), py::arg("min_n"), py::arg("max_n"))
      .def(
          "extend",
          [](NgramIndex& self, const py::object& tokens) {
            py::array_t<int32_t> ids = ToTokens(tokens);  // validate everything before appending
            self.Extend(ids.data(), static_cast<size_t>(ids.size()));
          },
          py::arg("tokens"))
      .def(
          "propose",
          [](const NgramIndex& self, int64_t k) {
            auto [data, count] = self.Propose(k);
            py::array_t<int32_t> out(static_cast<py::ssize_t>(count));
            if (count) std::memcpy(out.mutable_data(), data, count * sizeof(int32_t));
            return out;
          },
          py::arg("k"))
      .def("size", &NgramIndex::Size)
      .def("__len__", &NgramIndex::Size)
      .def_property_readonly("min_n", &NgramIndex::min_n)
      .def_property_readonly("max_n", &NgramIndex::max_n);
}
