// rms_norm
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

struct RmsPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, colsum;
};

void rms_forward(RmsPlan& p, const Tensor& x, const Tensor& w, const Tensor& y, const Tensor* rstd, double eps,
                 double offset) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  Arg a[] = {T(x), T(w), T(y), T(rstd ? *rstd : y), I(m), I(p.n), I(p.n), I(p.n), F(eps), F(offset)};
  (rstd ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 10);
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps, double offset,
                        int64_t plan) {
    RmsPlan& p = *reinterpret_cast<RmsPlan*>(plan);
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor rstd = at::empty({x.numel() / p.n}, x.options().dtype(at::kFloat));
    rms_forward(p, x, w, y, &rstd, eps, offset);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["plan"] = plan;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("rms_norm");
    RmsPlan& p = *reinterpret_cast<RmsPlan*>(ctx->saved_data["plan"].toInt());
    const double offset = ctx->saved_data["offset"].toDouble();
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    const int64_t m = x.numel() / p.n;
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t progs = std::min(p.programs, cdiv(m, p.rows_bwd));
    Tensor part = at::empty({progs, p.n}, x.options().dtype(at::kFloat));
    Arg a[] = {T(x), T(w), T(dy), T(rstd), T(dx), T(part), I(m), I(p.n), I(p.n), I(p.n), I(p.n), F(offset)};
    p.bwd->launch(static_cast<unsigned>(progs), 1, 1, a, 12);
    Tensor dw;
    if (ctx->needs_input_grad(1)) {
      dw = at::empty(w.sizes(), w.options());
      Arg c[] = {T(part), T(dw), I(progs), I(p.n)};
      p.colsum->launch(static_cast<unsigned>(cdiv(p.n, p.colsum_block)), 1, 1, c, 4);
    }
    return {ctx->needs_input_grad(0) ? dx : Tensor(), dw, Tensor(), Tensor(), Tensor()};
  }
};

std::string rms_key(const Tensor& x, const Tensor& w, bool llama) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), static_cast<int>(w.scalar_type()),
                                                llama ? 1 : 0});
}

// The op on the native path, or None: no plan for this key yet (plan_state says which), or an
// input this path does not take. Arguments are validated by polykernel.rms_norm before.
py::object rms_norm(const Tensor& x, const Tensor& w, double eps, double offset, bool llama) {
  if (!plain(x) || !plain(w) || x.dim() == 0 || x.numel() == 0) return py::none();
  std::shared_ptr<RmsPlan> p;
  if (plans<RmsPlan>().find(rms_key(x, w, llama), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad())) {
    return py::cast(RmsNormFn::apply(x, w, eps, offset, reinterpret_cast<int64_t>(p.get())));
  }
  Tensor y = at::empty(x.sizes(), x.options());
  rms_forward(*p, x, w, y, nullptr, eps, offset);
  return py::cast(y);
}

int rms_plan_state(const Tensor& x, const Tensor& w, bool llama) { return plans<RmsPlan>().state(rms_key(x, w, llama)); }

void set_rms_plan(const Tensor& x, const Tensor& w, bool llama, py::object plan) {
  plans<RmsPlan>().store(rms_key(x, w, llama), plan, [&](RmsPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.colsum = slot_of(plan, "colsum");
    read_rows(p, plan, x.size(-1));
  });
}

}  // namespace
