// rope: q [B, HQ, T, D] and k [B, HK, T, D] rotated by cos/sin [B or 1, T, D], any strides.
// Outputs keep q's / k's dense layout (empty_like); backward rotates the gradients by -sin.
// (what its host side does, next to the other ops': csrc/README.md)
#pragma once

#include "../plans.h"

namespace {

struct RopePlan {
  SlotPtr fwd, bwd;
  int64_t block_t = 0;    // positions per program
  bool per_head = false;  // one head per program (the grid is B · cdiv(T, block_t) · (HQ + HK)), or all
};

// Launch one rotation: rot(q) into qo and rot(k) into ko, where a null q (or k) takes no heads and
// the other pair stands in for its pointers (HQ = 0: never read), as the Python launcher does.
void rope_launch(RopePlan& p, bool backward, const Tensor* q, const Tensor* k, const Tensor& cos, const Tensor& sin,
                 const Tensor* qo, const Tensor* ko) {
  const Tensor& qa = q ? *q : *k;
  const Tensor& ka = k ? *k : *q;
  const Tensor& qoa = q ? *qo : *ko;
  const Tensor& koa = k ? *ko : *qo;
  const int64_t b = qa.size(0), t = qa.size(2);
  const int64_t hq = q ? q->size(1) : 0, hk = k ? k->size(1) : 0;
  const int64_t n_tblocks = cdiv(t, p.block_t);
  const auto qs = qa.strides(), ks = ka.strides(), qos = qoa.strides(), kos = koa.strides();
  const auto cs = cos.strides(), ss = sin.strides();
  Arg a[] = {T(qa), T(ka), T(qoa), T(koa), T(cos), T(sin), I(t), I(n_tblocks), I(hq), I(hk),
             I(qs[0]), I(qs[1]), I(qs[2]), I(qs[3]), I(ks[0]), I(ks[1]), I(ks[2]), I(ks[3]),
             I(qos[0]), I(qos[1]), I(qos[2]), I(qos[3]), I(kos[0]), I(kos[1]), I(kos[2]), I(kos[3]),
             I(cos.size(0) != 1 ? cs[0] : 0), I(cs[1]), I(cs[2]), I(sin.size(0) != 1 ? ss[0] : 0), I(ss[1]), I(ss[2])};
  const int64_t grid = b * n_tblocks * (p.per_head ? hq + hk : 1);
  (backward ? p.bwd : p.fwd)->launch(static_cast<unsigned>(grid), 1, 1, a, 32);
}

struct RopeFn : public torch::autograd::Function<RopeFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, int64_t plan) {
    RopePlan& p = *reinterpret_cast<RopePlan*>(plan);
    Tensor qo = at::empty_like(q), ko = at::empty_like(k);
    rope_launch(p, false, &q, &k, cos, sin, &qo, &ko);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["q_strides"] = qo.strides().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["k_strides"] = ko.strides().vec();
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: not rotated
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("rope");
    RopePlan& p = *reinterpret_cast<RopePlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1];
    const bool use_q = grads[0].defined() && ctx->needs_input_grad(0);
    const bool use_k = grads[1].defined() && ctx->needs_input_grad(1);
    // dq / dk in the forward outputs' layout (which the gradients usually share)
    auto like = [&](const char* sizes, const char* strides, const Tensor& g) {
      return at::empty_strided(ctx->saved_data[sizes].toIntVector(), ctx->saved_data[strides].toIntVector(), g.options());
    };
    Tensor dq = use_q ? like("q_sizes", "q_strides", grads[0]) : Tensor();
    Tensor dk = use_k ? like("k_sizes", "k_strides", grads[1]) : Tensor();
    if (use_q || use_k) {
      rope_launch(p, true, use_q ? &grads[0] : nullptr, use_k ? &grads[1] : nullptr, cos, sin,
                  use_q ? &dq : nullptr, use_k ? &dk : nullptr);
    }
    return {dq, dk, Tensor(), Tensor(), Tensor()};
  }
};

// The tile choice depends on T only through its next power of two (capped in Python): keying on
// that keeps the table small when prompt lengths vary.
int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

std::string rope_key(const Tensor& q, const Tensor& k) {
  std::string key = plan_key(q.get_device(), next_pow2(q.size(2)), {});
  const int64_t more[] = {q.size(1), k.size(1), q.size(3)};
  key.append(reinterpret_cast<const char*>(more), sizeof more);
  return key;
}

py::object rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  auto strided_cuda = [](const Tensor& t) { return t.is_cuda() && t.layout() == c10::kStrided; };
  if (!strided_cuda(q) || !strided_cuda(k) || !strided_cuda(cos) || !strided_cuda(sin)) return py::none();
  if (q.dim() != 4 || k.dim() != 4 || cos.dim() != 3 || sin.dim() != 3 || q.numel() == 0 || k.numel() == 0) {
    return py::none();
  }
  std::shared_ptr<RopePlan> p;
  if (plans<RopePlan>().find(rope_key(q, k), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || cos.requires_grad() || sin.requires_grad())) {
    if (cos.requires_grad() || sin.requires_grad()) return py::none();  // Python's path refuses it by name
    variable_list out = RopeFn::apply(q, k, cos, sin, reinterpret_cast<int64_t>(p.get()));
    return py::make_tuple(out[0], out[1]);
  }
  Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  rope_launch(*p, false, &q, &k, cos, sin, &qo, &ko);
  return py::make_tuple(qo, ko);
}

int rope_plan_state(const Tensor& q, const Tensor& k) { return plans<RopePlan>().state(rope_key(q, k)); }

void set_rope_plan(const Tensor& q, const Tensor& k, py::object plan) {
  plans<RopePlan>().store(rope_key(q, k), plan, [&](RopePlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.bwd = slot_of(plan, "bwd");
    p.block_t = plan.attr("block_t").cast<int64_t>();
    p.per_head = plan.attr("per_head").cast<bool>();
  });
}

}  // namespace
