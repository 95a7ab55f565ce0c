// fp8 (e4m3) quantisers of the serving layout: static_quant_fp8, dynamic_quant_fp8 (per token or
// per tensor), rms_norm_quant_fp8; contiguous x [..., N] and q, written in place (given outputs)
// (what their host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

// One plan per (device, N, x's dtype) serves the three ops: the elementwise kernels (static
// quantisation, the per-tensor amax) tile [ROWS, block]; the row kernels (per-token, RMSNorm)
// have one tile whatever M.
struct QuantPlan {
  int64_t n = 0, block = 0;
  RowTiles quant, amax;
  SlotPtr token, rms;
  int64_t token_rows = 1, rms_rows = 1;
};

// q <- clamp(x / scale): the scale per row (numel M) or one for all.
void static_launch(const QuantPlan& p, const Tensor& x, const Tensor& scale, const Tensor& q) {
  const int64_t m = x.numel() / p.n;
  const RowTiles::Tile& t = p.quant.for_rows(m);
  const int64_t col_blocks = cdiv(p.n, p.block);
  Arg a[] = {T(x), T(scale), T(q), I(m), I(p.n), I(col_blocks), I(p.n), I(p.n), I(scale.numel() == 1 ? 0 : 1)};
  t.slot->launch(static_cast<unsigned>(cdiv(m, t.rows) * col_blocks), 1, 1, a, 9);
}

std::string quant_key(const Tensor& x) {
  return plan_key(x.get_device(), x.dim() ? x.size(-1) : 1, {static_cast<int>(x.scalar_type())});
}

// What every entry takes: x and q contiguous CUDA of one size, q in e4m3, non-empty rows.
bool quant_takes(const Tensor& x, const Tensor& q) {
  return plain(x) && plain(q) && x.dim() > 0 && x.numel() > 0 && x.sizes().equals(q.sizes()) &&
         q.scalar_type() == at::kFloat8_e4m3fn;
}

bool scale_takes(const Tensor& s, int64_t count) {
  return plain(s) && s.scalar_type() == at::kFloat && s.numel() == count;
}

std::shared_ptr<QuantPlan> quant_plan(const Tensor& x) {
  std::shared_ptr<QuantPlan> p;
  return plans<QuantPlan>().find(quant_key(x), p) == 1 ? p : nullptr;
}

py::object static_quant_fp8(const Tensor& x, const Tensor& scale, const Tensor& q) {
  if (!quant_takes(x, q)) return py::none();
  const int64_t m = x.numel() / x.size(-1);
  if (!scale_takes(scale, 1) && !scale_takes(scale, m)) return py::none();
  auto p = quant_plan(x);
  if (!p) return py::none();
  static_launch(*p, x, scale, q);
  return py::cast(q);
}

// Per token: one launch (amax, scale, quantise per row). Per tensor: the scale zeroed, the amax
// kernel's integer atomic max on its bits, then the static kernel with that scale.
py::object dynamic_quant_fp8(const Tensor& x, bool per_token, const Tensor& q, const Tensor& scale) {
  if (!quant_takes(x, q)) return py::none();
  const int64_t m = x.numel() / x.size(-1);
  if (!scale_takes(scale, per_token ? m : 1)) return py::none();
  auto p = quant_plan(x);
  if (!p) return py::none();
  if (per_token) {
    Arg a[] = {T(x), T(q), T(scale), I(m), I(p->n), I(p->n), I(p->n)};
    p->token->launch(static_cast<unsigned>(cdiv(m, p->token_rows)), 1, 1, a, 7);
  } else {
    scale.zero_();  // the atomic max's start (0.0 has bits 0)
    const Tensor bits = scale.view(at::kInt);
    const RowTiles::Tile& t = p->amax.for_rows(m);
    const int64_t col_blocks = cdiv(p->n, p->block);
    Arg a[] = {T(x), T(bits), I(m), I(p->n), I(col_blocks), I(p->n)};
    t.slot->launch(static_cast<unsigned>(cdiv(m, t.rows) * col_blocks), 1, 1, a, 6);
    static_launch(*p, x, scale, q);
  }
  return py::make_tuple(q, scale);
}

py::object rms_norm_quant_fp8(const Tensor& x, const Tensor& w, const Tensor& scale, double eps, const Tensor& q) {
  if (!quant_takes(x, q) || !plain(w) || w.numel() != x.size(-1)) return py::none();
  const int64_t m = x.numel() / x.size(-1);
  if (!scale_takes(scale, 1) && !scale_takes(scale, m)) return py::none();
  auto p = quant_plan(x);
  if (!p) return py::none();
  Arg a[] = {T(x), T(w), T(scale), T(q), I(m), I(p->n), I(p->n), I(p->n), I(scale.numel() == 1 ? 0 : 1), F(eps)};
  p->rms->launch(static_cast<unsigned>(cdiv(m, p->rms_rows)), 1, 1, a, 10);
  return py::cast(q);
}

int quant_plan_state(const Tensor& x) { return plans<QuantPlan>().state(quant_key(x)); }

void set_quant_plan(const Tensor& x, py::object plan) {
  plans<QuantPlan>().store(quant_key(x), plan, [&](QuantPlan& p) {
    p.n = x.size(-1);
    p.block = plan.attr("block").cast<int64_t>();
    read_tiles(p.quant, plan.attr("quant"));
    read_tiles(p.amax, plan.attr("amax"));
    p.token = slot_of(plan, "token");
    p.token_rows = plan.attr("token_rows").cast<int64_t>();
    p.rms = slot_of(plan, "rms");
    p.rms_rows = plan.attr("rms_rows").cast<int64_t>();
  });
}

}  // namespace
