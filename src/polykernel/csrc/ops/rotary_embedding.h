// rotary_embedding_ (vLLM's serving layout, in place): query [T, HQ·hs] or [T, HQ, hs], key the
// same or absent, rotated by the rows of cos_sin_cache [max_pos, rotary_dim] that positions [T]
// pick; any strides (q and k are addressed as [T, H, hs] through theirs).
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include <array>

#include "../plans.h"

namespace {

struct RotaryPlan {
  SlotPtr fwd;
  int64_t block_h = 0;  // heads per program
};

// [T, H, hs] strides of query or key: a 2-D [T, H·hs] tensor splits its last dim (a view).
std::array<int64_t, 3> head_strides(const Tensor& t, int64_t head_size) {
  if (t.dim() == 3) return {t.stride(0), t.stride(1), t.stride(2)};
  return {t.stride(0), head_size * t.stride(1), t.stride(1)};
}

int64_t head_count(const Tensor& t, int64_t head_size) {
  if (t.dim() == 3) return t.size(1);
  return head_size > 0 && t.dim() == 2 ? t.size(1) / head_size : 0;
}

// One launch for q's and k's heads; an absent key takes no heads and q stands in for its
// pointer and strides (HK = 0: never read), as the Python launcher does.
void rotary_launch(const RotaryPlan& p, const Tensor& pos, const Tensor& q, const c10::optional<Tensor>& key,
                   int64_t head_size, const Tensor& cache) {
  const Tensor& k = key.has_value() ? *key : q;
  const int64_t hq = head_count(q, head_size), hk = key.has_value() ? head_count(k, head_size) : 0;
  const auto qs = head_strides(q, head_size), ks = head_strides(k, head_size);
  const int64_t nq = cdiv(hq, p.block_h);
  Arg a[] = {T(pos), T(q), T(k), T(cache), I(hq), I(hk), I(nq), I(cache.size(0)), I(pos.stride(0)),
             I(qs[0]), I(qs[1]), I(qs[2]), I(ks[0]), I(ks[1]), I(ks[2]), I(cache.stride(0)), I(cache.stride(1))};
  p.fwd->launch(static_cast<unsigned>(pos.size(0)), static_cast<unsigned>(nq + cdiv(hk, p.block_h)), 1, a, 17);
}

bool rotary_takes(const Tensor& t, int64_t head_size) {
  return on_device(t) && t.layout() == c10::kStrided && (t.dim() == 2 || t.dim() == 3) && t.numel() > 0 &&
         (t.dim() == 3 || t.size(1) % head_size == 0);
}

// The plan depends on the heads (BLOCK_H), the half width and the pair layout; dtypes only on
// the Slot's keys.
std::string rotary_key(const Tensor& q, const c10::optional<Tensor>& key, int64_t head_size, const Tensor& cache,
                       bool is_neox) {
  const int64_t hq = head_count(q, head_size), hk = key.has_value() ? head_count(*key, head_size) : 0;
  const int64_t heads = std::max(hq, hk);
  const int64_t half = cache.dim() == 2 ? cache.size(1) / 2 : 0;  // any cache: plan_state asks for what the op refused too
  return plan_key(q.get_device(), (heads << 32) | half, {is_neox ? 1 : 0});
}

// In place; nothing allocated: CUDA-graph safe. None (the Python path) for what it does not take.
py::object rotary_embedding(const Tensor& pos, const Tensor& q, const c10::optional<Tensor>& key, int64_t head_size,
                            const Tensor& cache, bool is_neox) {
  if (head_size <= 0 || !rotary_takes(q, head_size) || (key.has_value() && !rotary_takes(*key, head_size))) {
    return py::none();
  }
  if (!on_device(pos) || pos.dim() != 1 || pos.size(0) != q.size(0) || (key.has_value() && key->size(0) != q.size(0)) ||
      !on_device(cache) || cache.dim() != 2 || cache.size(0) == 0 || cache.size(1) == 0 || cache.size(1) % 2 ||
      pos.size(0) > INT32_MAX) {
    return py::none();
  }
  std::shared_ptr<RotaryPlan> p;
  if (plans<RotaryPlan>().find(rotary_key(q, key, head_size, cache, is_neox), p) != 1) return py::none();
  rotary_launch(*p, pos, q, key, head_size, cache);
  return py::make_tuple(q, key.has_value() ? py::cast(*key) : py::none());
}

int rotary_plan_state(const Tensor& q, const c10::optional<Tensor>& key, int64_t head_size, const Tensor& cache,
                      bool is_neox) {
  return plans<RotaryPlan>().state(rotary_key(q, key, head_size, cache, is_neox));
}

void set_rotary_plan(const Tensor& q, const c10::optional<Tensor>& key, int64_t head_size, const Tensor& cache,
                     bool is_neox, py::object plan) {
  plans<RotaryPlan>().store(rotary_key(q, key, head_size, cache, is_neox), plan, [&](RotaryPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.block_h = plan.attr("block_h").cast<int64_t>();
  });
}

}  // namespace
