// GLU: act(gate) * up (swiglu, geglu), contiguous inputs as one flat row
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

struct GluPlan {
  SlotPtr fwd, bwd;
  int64_t numel = 0, block = 0;  // the flat walk: one row of numel elements, block elements per program
};

void glu_forward(GluPlan& p, const Tensor& g, const Tensor& u, const Tensor& y) {
  const int64_t blocks = cdiv(p.numel, p.block);
  Arg a[] = {T(g), T(u), T(y), I(1), I(p.numel), I(blocks), I(0), I(0), I(0)};
  p.fwd->launch(static_cast<unsigned>(blocks), 1, 1, a, 9);
}

struct GluFn : public torch::autograd::Function<GluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& g, const Tensor& u, int64_t act, int64_t plan) {
    GluPlan& p = *reinterpret_cast<GluPlan*>(plan);
    Tensor y = at::empty(g.sizes(), g.options());
    glu_forward(p, g, u, y);
    ctx->save_for_backward({g, u});
    ctx->saved_data["plan"] = plan;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("swiglu/geglu");
    GluPlan& p = *reinterpret_cast<GluPlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &g = saved[0], &u = saved[1];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    Tensor dg = at::empty(g.sizes(), g.options());
    Tensor du = at::empty(g.sizes(), g.options());
    const int64_t blocks = cdiv(p.numel, p.block);
    Arg a[] = {T(g), T(u), T(dy), T(dg), T(du), I(1), I(p.numel), I(blocks), I(0), I(0), I(0), I(0), I(0)};
    p.bwd->launch(static_cast<unsigned>(blocks), 1, 1, a, 13);
    return {ctx->needs_input_grad(0) ? dg : Tensor(), ctx->needs_input_grad(1) ? du : Tensor(), Tensor(), Tensor()};
  }
};

std::string glu_key(const Tensor& g, const Tensor& u, int64_t act) {
  return plan_key(g.get_device(), g.numel(), {static_cast<int>(act), static_cast<int>(g.scalar_type()),
                                               static_cast<int>(u.scalar_type())});
}

py::object glu(const Tensor& g, const Tensor& u, int64_t act) {
  if (!plain(g) || !plain(u) || g.numel() == 0 || !g.sizes().equals(u.sizes())) return py::none();
  std::shared_ptr<GluPlan> p;
  if (plans<GluPlan>().find(glu_key(g, u, act), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (g.requires_grad() || u.requires_grad())) {
    return py::cast(GluFn::apply(g, u, act, reinterpret_cast<int64_t>(p.get())));
  }
  Tensor y = at::empty(g.sizes(), g.options());
  glu_forward(*p, g, u, y);
  return py::cast(y);
}

int glu_plan_state(const Tensor& g, const Tensor& u, int64_t act) { return plans<GluPlan>().state(glu_key(g, u, act)); }

void set_glu_plan(const Tensor& g, const Tensor& u, int64_t act, py::object plan) {
  plans<GluPlan>().store(glu_key(g, u, act), plan, [&](GluPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.bwd = slot_of(plan, "bwd");
    p.numel = g.numel();
    p.block = plan.attr("block").cast<int64_t>();
  });
}

}  // namespace
