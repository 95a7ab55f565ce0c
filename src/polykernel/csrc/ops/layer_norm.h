// layer_norm (weight and bias each optional)
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

struct LnPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, colsum_w, colsum_b;
};

void ln_forward(LnPlan& p, const Tensor& x, const Tensor* w, const Tensor* b, const Tensor& y, const Tensor* mean,
                const Tensor* rstd, double eps) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  // Absent tensors are never read (HAS_W/HAS_B/STORE_STATS are constexprs): any pointer will do.
  Arg a[] = {T(x), T(w ? *w : x), T(b ? *b : x), T(y), T(mean ? *mean : y), T(rstd ? *rstd : y),
             I(m), I(p.n), I(p.n), I(p.n), F(eps)};
  (mean ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 11);
}

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const c10::optional<Tensor>& w,
                        const c10::optional<Tensor>& b, double eps, int64_t plan) {
    LnPlan& p = *reinterpret_cast<LnPlan*>(plan);
    const bool has_w = w.has_value() && w->defined(), has_b = b.has_value() && b->defined();
    const int64_t m = x.numel() / p.n;
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor mean = at::empty({m}, x.options().dtype(at::kFloat));
    Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
    ln_forward(p, x, has_w ? &*w : nullptr, has_b ? &*b : nullptr, y, &mean, &rstd, eps);
    ctx->save_for_backward({x, has_w ? *w : Tensor(), mean, rstd});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["bias"] = has_b ? static_cast<int64_t>(b->scalar_type()) : int64_t(-1);
    if (has_b) ctx->saved_data["bias_sizes"] = b->sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("layer_norm");
    LnPlan& p = *reinterpret_cast<LnPlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    const int64_t bias_dtype = ctx->saved_data["bias"].toInt();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    const bool has_w = w.defined(), has_b = bias_dtype >= 0;
    const int64_t m = x.numel() / p.n;
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t progs = std::min(std::min(p.programs, m), cdiv(m, p.rows_bwd));
    const auto part_opts = x.options().dtype(at::kFloat);
    Tensor dw_part = has_w ? at::empty({progs, p.n}, part_opts) : dx;
    Tensor db_part = has_b ? at::empty({progs, p.n}, part_opts) : dx;
    Arg a[] = {T(x), T(has_w ? w : x), T(dy), T(mean), T(rstd), T(dx), T(dw_part), T(db_part),
               I(m), I(p.n), I(p.n), I(p.n), I(p.n)};
    p.bwd->launch(static_cast<unsigned>(progs), 1, 1, a, 13);
    const unsigned cgrid = static_cast<unsigned>(cdiv(p.n, p.colsum_block));
    // needs_input_grad counts only the tensor inputs that were given: x, then w, then b.
    const size_t w_edge = 1, b_edge = has_w ? 2 : 1;
    Tensor dw, db;
    if (has_w && ctx->needs_input_grad(w_edge)) {
      dw = at::empty(w.sizes(), w.options());
      Arg c[] = {T(dw_part), T(dw), I(progs), I(p.n)};
      p.colsum_w->launch(cgrid, 1, 1, c, 4);
    }
    if (has_b && ctx->needs_input_grad(b_edge)) {
      db = at::empty(ctx->saved_data["bias_sizes"].toIntVector(), x.options().dtype(static_cast<c10::ScalarType>(bias_dtype)));
      Arg c[] = {T(db_part), T(db), I(progs), I(p.n)};
      p.colsum_b->launch(cgrid, 1, 1, c, 4);
    }
    return {ctx->needs_input_grad(0) ? dx : Tensor(), dw, db, Tensor(), Tensor()};
  }
};

std::string ln_key(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), dtype_code(w), dtype_code(b)});
}

py::object layer_norm(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b, double eps) {
  if (!plain(x) || x.dim() == 0 || x.numel() == 0) return py::none();
  if ((w.has_value() && !plain(*w)) || (b.has_value() && !plain(*b))) return py::none();
  std::shared_ptr<LnPlan> p;
  if (plans<LnPlan>().find(ln_key(x, w, b), p) != 1) return py::none();
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (w.has_value() && w->requires_grad()) || (b.has_value() && b->requires_grad()));
  if (grad) return py::cast(LayerNormFn::apply(x, w, b, eps, reinterpret_cast<int64_t>(p.get())));
  Tensor y = at::empty(x.sizes(), x.options());
  ln_forward(*p, x, w.has_value() ? &*w : nullptr, b.has_value() ? &*b : nullptr, y, nullptr, nullptr, eps);
  return py::cast(y);
}

int ln_plan_state(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b) {
  return plans<LnPlan>().state(ln_key(x, w, b));
}

void set_ln_plan(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b, py::object plan) {
  plans<LnPlan>().store(ln_key(x, w, b), plan, [&](LnPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.colsum_w = slot_of(plan, "colsum_w");
    p.colsum_b = slot_of(plan, "colsum_b");
    read_rows(p, plan, x.size(-1));
  });
}

}  // namespace
