// Suffix trees for suffix decoding (SuffixDecoding, arXiv 2411.04975).
//
// A tree indexes documents (token sequences) and counts, for every string w of at most
// `max_depth` tokens, how many times it occurs in them. It is a depth-bounded trie of all
// suffixes: each node is a string, and its count the number of positions where it starts. A
// document keeps its open suffixes (those shorter than `max_depth` that end at its last token),
// so appending a token extends each of them by one node: O(max_depth) per token. Removing a
// document walks its suffixes again and decrements; nodes that reach zero are freed (every
// descendant of a node counts at most as often as the node, so they are freed with it).
//
// A speculation matches a suffix of the context of m tokens, for each m, and walks down from it
// to the most frequent child while the product of the branch fractions stays at or above
// `min_token_prob`; the walk with the largest expected number of accepted tokens (the sum of
// those products) wins, the longer match on a tie. Where the context is a document's own end
// (a request drafting from its prompt and output), its open suffixes are those matches, so
// `SpeculateTail` starts from them instead of looking each one up from the root: up to
// max_depth^2 / 2 probes of the child table, each likely a cache miss right after a forward
// pass has swept the caches.
//
// Children are found through one open-addressing table keyed by (parent, token), and listed
// through sibling links for the walk; freed nodes are reused, so memory follows the live count.
// Every method takes the tree's mutex: the global cache is shared by a server's threads.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "mix64.h"
#include "tokens.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using mlc_spec::Mix64;
using mlc_spec::ToTokens;

// Linear-probing map from a (parent, token) key to a child node, with backward-shift deletion
// (no tombstones, so lookups stay short however many documents come and go).
class ChildTable {
 public:
  ChildTable() : slots_(kInitialCapacity) {}

  int32_t Get(uint64_t key) const {
    const Slot& slot = slots_[Find(key)];
    return slot.key == key ? slot.node : -1;
  }

  void Put(uint64_t key, int32_t node) {
    if (2 * (used_ + 1) > slots_.size()) Grow();
    Slot& slot = slots_[Find(key)];
    if (slot.key != key) ++used_;
    slot = {key, node};
  }

  void Erase(uint64_t key) {
    size_t hole = Find(key);
    if (slots_[hole].key != key) return;
    --used_;
    const size_t mask = slots_.size() - 1;
    // Move later entries of the probe run back into the hole unless their home slot lies
    // cyclically in (hole, j]: then they would no longer be found.
    for (size_t j = (hole + 1) & mask; slots_[j].key != kEmpty; j = (j + 1) & mask) {
      const size_t home = Mix64(slots_[j].key) & mask;
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      slots_[hole] = slots_[j];
      hole = j;
    }
    slots_[hole].key = kEmpty;
  }

  static constexpr size_t SlotBytes() { return sizeof(Slot); }

 private:
  static constexpr uint64_t kEmpty = std::numeric_limits<uint64_t>::max();  // no real key
  static constexpr size_t kInitialCapacity = 64;  // power of two
  struct Slot {
    uint64_t key = kEmpty;
    int32_t node = -1;
  };

  size_t Find(uint64_t key) const {
    const size_t mask = slots_.size() - 1;
    size_t i = Mix64(key) & mask;
    while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask;
    return i;
  }

  void Grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.key != kEmpty) slots_[Find(s.key)] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t used_ = 0;
};

struct Speculation {
  std::vector<int32_t> tokens;
  std::vector<double> probs;  // chance that each draft and all before it are right
  double score = 0.0;         // expected drafts accepted: the sum of probs
  int64_t match_len = 0;      // context tokens matched
};

class SuffixTree {
 public:
  explicit SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 2) throw py::value_error("max_depth must be >= 2, got " + std::to_string(max_depth));
    nodes_.push_back(Node{});  // the root: the empty string
  }

  void Extend(int64_t doc_id, const int32_t* tokens, size_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    Document& doc = docs_[doc_id];
    for (size_t i = 0; i < count; ++i) {
      const int32_t token = tokens[i];
      doc.tokens.push_back(token);
      doc.open.push_back(0);  // the suffix that starts at this token, empty so far
      for (int32_t& node : doc.open) {
        node = ChildOrNew(node, token);
        ++nodes_[node].count;
      }
      if (nodes_[doc.open.front()].depth == max_depth_) doc.open.pop_front();
    }
  }

  // Forgets a document; false if there is none under `doc_id`.
  bool Remove(int64_t doc_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = docs_.find(doc_id);
    if (it == docs_.end()) return false;
    const std::vector<int32_t>& tokens = it->second.tokens;
    for (size_t start = 0; start < tokens.size(); ++start) {
      const size_t end = std::min(tokens.size(), start + static_cast<size_t>(max_depth_));
      int32_t node = 0;
      for (size_t j = start; j < end; ++j) {
        node = table_.Get(Key(node, tokens[j]));
        --nodes_[node].count;
      }
      // Free the zero-count tail of this path, deepest first (a zero node has no live child).
      while (node != 0 && nodes_[node].count == 0) {
        const int32_t parent = nodes_[node].parent;
        Free(node);
        node = parent;
      }
    }
    docs_.erase(it);
    return true;
  }

  Speculation Speculate(const int32_t* context, size_t length, int64_t max_tokens,
                        double max_spec_factor, double min_token_prob) const {
    std::lock_guard<std::mutex> lock(mutex_);
    Speculation best;
    const size_t longest = std::min(length, static_cast<size_t>(max_depth_ - 1));
    for (size_t m = 1; m <= longest; ++m) {
      int32_t node = 0;
      for (size_t j = length - m; j < length && node >= 0; ++j) {
        node = table_.Get(Key(node, context[j]));
      }
      if (node < 0) break;  // a longer suffix contains this one, so it is not there either
      Consider(node, max_tokens, max_spec_factor, min_token_prob, best);
    }
    return best;
  }

  // `Speculate` with the last max_depth - 1 tokens of document `doc_id` as the context.
  Speculation SpeculateTail(int64_t doc_id, int64_t max_tokens, double max_spec_factor,
                            double min_token_prob) const {
    std::lock_guard<std::mutex> lock(mutex_);
    Speculation best;
    auto it = docs_.find(doc_id);
    if (it == docs_.end()) return best;
    const std::deque<int32_t>& open = it->second.open;  // longest first, each one token shorter
    for (auto node = open.rbegin(); node != open.rend(); ++node) {
      Consider(*node, max_tokens, max_spec_factor, min_token_prob, best);
    }
    return best;
  }

  size_t NumNodes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return nodes_.size() - free_.size();
  }

  // Bytes the live nodes take with their table entries (the table is kept at most half full).
  size_t LiveBytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return (nodes_.size() - free_.size()) * (sizeof(Node) + 2 * ChildTable::SlotBytes());
  }

  size_t NumTokens(int64_t doc_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = docs_.find(doc_id);
    return it == docs_.end() ? 0 : it->second.tokens.size();
  }

  size_t NumDocuments() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return docs_.size();
  }

  int64_t max_depth() const { return max_depth_; }

 private:
  struct Node {
    int32_t count = 0;
    int32_t depth = 0;
    int32_t token = -1;
    int32_t parent = -1;
    int32_t first_child = -1;
    int32_t next_sibling = -1;
    int32_t prev_sibling = -1;
  };
  struct Document {
    std::vector<int32_t> tokens;  // kept to find its suffixes again when it is removed
    std::deque<int32_t> open;     // nodes of the suffixes still shorter than max_depth
  };

  static uint64_t Key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(parent) << 32) | static_cast<uint32_t>(token);
  }

  int32_t ChildOrNew(int32_t parent, int32_t token) {
    const uint64_t key = Key(parent, token);
    int32_t child = table_.Get(key);
    if (child >= 0) return child;
    if (free_.empty()) {
      child = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    } else {
      child = free_.back();
      free_.pop_back();
    }
    Node& node = nodes_[child];
    node = Node{0, nodes_[parent].depth + 1, token, parent, -1, nodes_[parent].first_child, -1};
    if (node.next_sibling >= 0) nodes_[node.next_sibling].prev_sibling = child;
    nodes_[parent].first_child = child;
    table_.Put(key, child);
    return child;
  }

  void Free(int32_t id) {
    const Node& node = nodes_[id];
    if (node.prev_sibling >= 0) {
      nodes_[node.prev_sibling].next_sibling = node.next_sibling;
    } else {
      nodes_[node.parent].first_child = node.next_sibling;
    }
    if (node.next_sibling >= 0) nodes_[node.next_sibling].prev_sibling = node.prev_sibling;
    table_.Erase(Key(node.parent, node.token));
    free_.push_back(id);
  }

  // The walk below `node`, a match of `node`'s depth, replaces `best` if it scores as well.
  void Consider(int32_t node, int64_t max_tokens, double max_spec_factor, double min_token_prob,
                Speculation& best) const {
    const int32_t m = nodes_[node].depth;
    const double limit = std::min(static_cast<double>(max_tokens), m * max_spec_factor);
    Speculation walk = Walk(node, static_cast<int64_t>(limit + 1e-9), min_token_prob);
    walk.match_len = m;
    if (walk.score >= best.score) best = std::move(walk);
  }

  // The most frequent path below `node` (the smaller token on a tie) while its chance holds.
  Speculation Walk(int32_t node, int64_t limit, double min_token_prob) const {
    Speculation walk;
    double prob = 1.0;
    while (static_cast<int64_t>(walk.tokens.size()) < limit) {
      int64_t total = 0;
      int32_t best = -1;
      for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next_sibling) {
        const Node& child = nodes_[c];
        total += child.count;
        if (best < 0 || child.count > nodes_[best].count ||
            (child.count == nodes_[best].count && child.token < nodes_[best].token)) {
          best = c;
        }
      }
      if (best < 0) break;
      const double next = prob * static_cast<double>(nodes_[best].count) / static_cast<double>(total);
      if (next < min_token_prob) break;
      prob = next;
      walk.tokens.push_back(nodes_[best].token);
      walk.probs.push_back(prob);
      walk.score += prob;
      node = best;
    }
    return walk;
  }

  int64_t max_depth_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  ChildTable table_;
  std::unordered_map<int64_t, Document> docs_;
  mutable std::mutex mutex_;
};

py::tuple ToPython(const Speculation& s) {
  py::array_t<int32_t> tokens(static_cast<py::ssize_t>(s.tokens.size()));
  std::copy(s.tokens.begin(), s.tokens.end(), tokens.mutable_data());
  py::array_t<double> probs(static_cast<py::ssize_t>(s.probs.size()));
  std::copy(s.probs.begin(), s.probs.end(), probs.mutable_data());
  return py::make_tuple(tokens, probs, s.score, s.match_len);
}

}  // namespace

PYBIND11_MODULE(_suffix, m) {
  m.doc() = "Native depth-bounded suffix trees with counts, for suffix decoding.";
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int64_t>(), py::arg("max_depth"))
      .def(
          "extend",
          [](SuffixTree& self, int64_t doc_id, const py::object& tokens) {
            py::array_t<int32_t> ids = ToTokens(tokens);  // validate everything before appending
            self.Extend(doc_id, ids.data(), static_cast<size_t>(ids.size()));
          },
          py::arg("doc_id"), py::arg("tokens"))
      .def("remove", &SuffixTree::Remove, py::arg("doc_id"))
      .def("num_tokens", &SuffixTree::NumTokens, py::arg("doc_id"))
      .def(
          "speculate",
          [](const SuffixTree& self, const py::object& context, int64_t max_tokens,
             double max_spec_factor, double min_token_prob) {
            if (max_tokens < 0) throw py::value_error("max_tokens must be >= 0");
            py::array_t<int32_t> ids = ToTokens(context);
            Speculation s;
            {
              py::gil_scoped_release release;
              s = self.Speculate(ids.data(), static_cast<size_t>(ids.size()), max_tokens,
                                 max_spec_factor, min_token_prob);
            }
            return ToPython(s);
          },
          py::arg("context"), py::arg("max_tokens"), py::arg("max_spec_factor"),
          py::arg("min_token_prob"))
      .def(
          "speculate_tail",
          [](const SuffixTree& self, int64_t doc_id, int64_t max_tokens, double max_spec_factor,
             double min_token_prob) {
            if (max_tokens < 0) throw py::value_error("max_tokens must be >= 0");
            return ToPython(
                self.SpeculateTail(doc_id, max_tokens, max_spec_factor, min_token_prob));
          },
          py::arg("doc_id"), py::arg("max_tokens"), py::arg("max_spec_factor"),
          py::arg("min_token_prob"))
      .def_property_readonly("num_nodes", &SuffixTree::NumNodes)
      .def_property_readonly("live_bytes", &SuffixTree::LiveBytes)
      .def_property_readonly("num_documents", &SuffixTree::NumDocuments)
      .def_property_readonly("max_depth", &SuffixTree::max_depth);
}
