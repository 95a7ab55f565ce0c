// glu_and_mul (silu_and_mul, gelu_and_mul): x [..., 2d] -> act(x[..., :d]) * x[..., d:], [..., d]
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

// The forward kernel's rows path on the two halves of each contiguous [M, 2d] row; its tile
// depends on M through ROWS only (RowTiles).
struct AndMulPlan {
  int64_t d = 0, block = 0;
  RowTiles fwd;
};

void and_mul_forward(const AndMulPlan& p, const Tensor& x, const Tensor& out) {
  const int64_t m = x.numel() / (2 * p.d);
  const RowTiles::Tile& t = p.fwd.for_rows(m);
  const int64_t col_blocks = cdiv(p.d, p.block);
  // up: x + d elements (x is contiguous: plain())
  Arg a[] = {T(x), TAt(x, p.d * x.element_size()), T(out), I(m), I(p.d), I(col_blocks), I(2 * p.d), I(2 * p.d), I(p.d)};
  t.slot->launch(static_cast<unsigned>(cdiv(m, t.rows) * col_blocks), 1, 1, a, 9);
}

std::string and_mul_key(const Tensor& x, int64_t act) {
  return plan_key(x.get_device(), x.dim() ? x.size(-1) : 0, {static_cast<int>(act), static_cast<int>(x.scalar_type())});
}

// out given: written in place, nothing allocated (CUDA-graph capture); else allocated like x.
py::object glu_and_mul(const Tensor& x, const c10::optional<Tensor>& out, int64_t act) {
  if (!plain(x) || x.dim() == 0 || x.numel() == 0 || x.size(-1) % 2) return py::none();
  if (out.has_value() && (!plain(*out) || out->scalar_type() != x.scalar_type() || out->numel() * 2 != x.numel())) {
    return py::none();
  }
  std::shared_ptr<AndMulPlan> p;
  if (plans<AndMulPlan>().find(and_mul_key(x, act), p) != 1) return py::none();
  Tensor y;
  if (out.has_value()) {
    y = *out;
  } else {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() /= 2;
    y = at::empty(sizes, x.options());
  }
  and_mul_forward(*p, x, y);
  return py::cast(y);
}

int and_mul_plan_state(const Tensor& x, int64_t act) { return plans<AndMulPlan>().state(and_mul_key(x, act)); }

void set_and_mul_plan(const Tensor& x, int64_t act, py::object plan) {
  plans<AndMulPlan>().store(and_mul_key(x, act), plan, [&](AndMulPlan& p) {
    p.d = x.size(-1) / 2;
    p.block = plan.attr("block").cast<int64_t>();
    read_tiles(p.fwd, plan.attr("tiles"));
  });
}

}  // namespace
