// Plans: per op and (dtypes, row length, flags, device), the slots and the shape numbers Python
// chose. Kept for the process's life (a handful per model); `clear_plans` forgets them. Each op's
// plan type is in its file (ops/); here is what they share.
#pragma once

#include "slot.h"

namespace {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The norms' shape numbers: rows per program forward and backward, the backward's persistent
// grid size, the column-sum kernel's block; n is the row length the plan is for.
struct RowPlan {
  int64_t n = 0, rows_fwd = 0, rows_bwd = 0, programs = 0, colsum_block = 0;
};

template <typename P>
struct PlanTable {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<P>> plans;  // null: this key stays in Python
  std::vector<std::shared_ptr<P>> retired;                    // cleared plans a saved node may still use

  // 0: no entry yet, 1: a plan, 2: Python's path for this key
  int find(const std::string& key, std::shared_ptr<P>& out) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it == plans.end()) return 0;
    out = it->second;
    return out ? 1 : 2;
  }
  void set(const std::string& key, std::shared_ptr<P> p) {
    std::lock_guard<std::mutex> lock(mu);
    plans[key] = std::move(p);
  }
  int state(const std::string& key) {
    std::shared_ptr<P> p;
    return find(key, p);
  }
  // Python's plan object (None: this key stays in Python), read by `fill`.
  template <typename Fill>
  void store(const std::string& key, const py::object& plan, Fill fill) {
    if (plan.is_none()) {
      set(key, nullptr);
      return;
    }
    auto p = std::make_shared<P>();
    fill(*p);
    set(key, std::move(p));
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& kv : plans)
      if (kv.second) retired.push_back(kv.second);
    plans.clear();
  }
};

// The process's plan table of each plan type (one per op), never destroyed: a saved autograd
// node may still point into it at exit.
template <typename P>
PlanTable<P>& plans() {
  static auto* t = new PlanTable<P>();
  return *t;
}

SlotPtr slot_of(const py::object& plan, const char* name) { return plan.attr(name).cast<SlotPtr>(); }

void read_rows(RowPlan& p, const py::object& plan, int64_t n) {
  p.n = n;
  p.rows_fwd = plan.attr("rows_fwd").cast<int64_t>();
  p.rows_bwd = plan.attr("rows_bwd").cast<int64_t>();
  p.programs = plan.attr("programs").cast<int64_t>();
  p.colsum_block = plan.attr("colsum_block").cast<int64_t>();
}

// Slots of a kernel whose tile depends on the row count M only through ROWS (short rows: several
// per program, never more than M's next power of two): one per power of two of M up to the
// largest ROWS; the last serves every larger M. Python's plan gives them as `tiles` (slot, rows).
struct RowTiles {
  struct Tile {
    SlotPtr slot;
    int64_t rows = 1;
  };
  std::vector<Tile> tiles;  // tiles[i]: M with next power of two 2^i

  const Tile& for_rows(int64_t m) const {
    size_t i = 0;
    while ((int64_t{1} << i) < m) ++i;
    return tiles[std::min(i, tiles.size() - 1)];
  }
};

void read_tiles(RowTiles& t, const py::object& tiles) {
  for (py::handle h : tiles) t.tiles.push_back({h.attr("slot").cast<SlotPtr>(), h.attr("rows").cast<int64_t>()});
  if (t.tiles.empty()) throw std::invalid_argument("polykernel native launch: a plan without tiles");
}

// The plan-table key of a call: what the plan's tile choice and kernels depend on (device, the row
// length or size, small codes: dtypes, flags). Raw bytes, short enough for the string's own buffer:
// no allocation on the per-call path.
std::string plan_key(int device, int64_t n, std::initializer_list<int> codes) {
  std::string key(1 + sizeof n, '\0');
  key[0] = static_cast<char>(device);
  std::memcpy(&key[1], &n, sizeof n);
  for (int c : codes) key.push_back(static_cast<char>(c));
  return key;
}

inline int dtype_code(const c10::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? static_cast<int>(t->scalar_type()) : -1;
}

// Where the native path's inputs live: CUDA. The host-side test's build (POLYKERNEL_NATIVE_HOST_TEST,
// tests/backends/test_native.py) takes CPU tensors too, so that where there is no GPU the launches'
// arguments can be checked against the Python launchers' (its Slots only call back, never launch).
inline bool on_device(const Tensor& t) {
#ifdef POLYKERNEL_NATIVE_HOST_TEST
  return t.defined();
#else
  return t.is_cuda();
#endif
}

// Inputs the native path takes: CUDA, dense and contiguous, non-empty rows.
bool plain(const Tensor& t) { return on_device(t) && t.layout() == c10::kStrided && t.is_contiguous(); }

}  // namespace
