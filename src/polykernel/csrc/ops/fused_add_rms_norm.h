// fused_add_rms_norm: s = x + residual, y = rms_norm(s); returns (y, s)
// fused_add_rms_norm_ (serving, in place): residual <- s, x <- y; the same plan
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

struct AddRmsPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, bwd_dso, colsum;  // bwd_dso: the new residual's gradient added in
};

void add_rms_forward(AddRmsPlan& p, const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& y, const Tensor& s,
                     const Tensor* rstd, double eps, double offset) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  Arg a[] = {T(x), T(r), T(w), T(y), T(s), T(rstd ? *rstd : y), I(m), I(p.n), I(p.n), I(p.n), I(p.n), I(p.n),
             F(eps), F(offset)};
  (rstd ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 14);
}

struct FusedAddRmsNormFn : public torch::autograd::Function<FusedAddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w, double eps,
                               double offset, int64_t plan) {
    AddRmsPlan& p = *reinterpret_cast<AddRmsPlan*>(plan);
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor s = at::empty(x.sizes(), x.options());  // its own storage: saved for backward alone
    Tensor rstd = at::empty({x.numel() / p.n}, x.options().dtype(at::kFloat));
    add_rms_forward(p, x, r, w, y, s, &rstd, eps, offset);
    ctx->save_for_backward({s, w, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["plan"] = plan;
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: no zeros read
    return {y, s};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("fused_add_rms_norm");
    AddRmsPlan& p = *reinterpret_cast<AddRmsPlan*>(ctx->saved_data["plan"].toInt());
    const double offset = ctx->saved_data["offset"].toDouble();
    auto saved = ctx->get_saved_variables();
    const Tensor &s = saved[0], &w = saved[1], &rstd = saved[2];
    const Tensor& dy_in = grads[0];
    const Tensor& dso_in = grads[1];
    Tensor ds, dw;
    if (!dy_in.defined()) {  // only the new residual was used: y contributes nothing
      ds = dso_in;
    } else {
      const Tensor dy = dy_in.is_contiguous() ? dy_in : dy_in.contiguous();
      const bool has_dso = dso_in.defined();
      const Tensor dso = !has_dso ? dy : (dso_in.is_contiguous() ? dso_in : dso_in.contiguous());
      const int64_t m = s.numel() / p.n;
      ds = at::empty(s.sizes(), s.options());
      const int64_t progs = std::min(std::min(p.programs, m), cdiv(m, p.rows_bwd));
      Tensor part = at::empty({progs, p.n}, s.options().dtype(at::kFloat));
      Arg a[] = {T(s), T(w), T(dy), T(dso), T(rstd), T(ds), T(part), I(m), I(p.n), I(p.n), I(p.n), I(p.n), I(p.n),
                 F(offset)};
      (has_dso ? p.bwd_dso : p.bwd)->launch(static_cast<unsigned>(progs), 1, 1, a, 14);
      if (ctx->needs_input_grad(2)) {
        dw = at::empty(w.sizes(), w.options());
        Arg c[] = {T(part), T(dw), I(progs), I(p.n)};
        p.colsum->launch(static_cast<unsigned>(cdiv(p.n, p.colsum_block)), 1, 1, c, 4);
      }
    }
    return {ctx->needs_input_grad(0) ? ds : Tensor(), ctx->needs_input_grad(1) ? ds : Tensor(), dw, Tensor(), Tensor(),
            Tensor()};
  }
};

std::string add_rms_key(const Tensor& x, const Tensor& r, const Tensor& w) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), static_cast<int>(r.scalar_type()),
                                                static_cast<int>(w.scalar_type())});
}

py::object fused_add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& w, double eps, double offset) {
  if (!plain(x) || !plain(r) || !plain(w) || x.dim() == 0 || x.numel() == 0 || !x.sizes().equals(r.sizes())) {
    return py::none();
  }
  std::shared_ptr<AddRmsPlan> p;
  if (plans<AddRmsPlan>().find(add_rms_key(x, r, w), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (x.requires_grad() || r.requires_grad() || w.requires_grad())) {
    variable_list out = FusedAddRmsNormFn::apply(x, r, w, eps, offset, reinterpret_cast<int64_t>(p.get()));
    return py::make_tuple(out[0], out[1]);
  }
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor s = at::empty(x.sizes(), x.options());
  add_rms_forward(*p, x, r, w, y, s, nullptr, eps, offset);
  return py::make_tuple(y, s);
}

// In place: the inference forward with y = x and s = residual (each program reads its rows before
// it writes them); rstd is never written. Nothing allocated: CUDA-graph safe.
py::object fused_add_rms_norm_inplace(const Tensor& x, const Tensor& r, const Tensor& w, double eps, double offset) {
  if (!plain(x) || !plain(r) || !plain(w) || x.dim() == 0 || x.numel() == 0 || !x.sizes().equals(r.sizes())) {
    return py::none();
  }
  std::shared_ptr<AddRmsPlan> p;
  if (plans<AddRmsPlan>().find(add_rms_key(x, r, w), p) != 1) return py::none();
  add_rms_forward(*p, x, r, w, x, r, nullptr, eps, offset);
  return py::make_tuple(x, r);
}

int add_rms_plan_state(const Tensor& x, const Tensor& r, const Tensor& w) {
  return plans<AddRmsPlan>().state(add_rms_key(x, r, w));
}

void set_add_rms_plan(const Tensor& x, const Tensor& r, const Tensor& w, py::object plan) {
  plans<AddRmsPlan>().store(add_rms_key(x, r, w), plan, [&](AddRmsPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.bwd_dso = slot_of(plan, "bwd_dso");
    p.colsum = slot_of(plan, "colsum");
    read_rows(p, plan, x.size(-1));
  });
}

}  // namespace
