"""A tied head (the embedding's weight as the LM head: Llama-3.2-1B/3B, Gemma, small Qwens) gets two
gradients in one backward, the fused loss's and the embedding's, which autograd sums. It sums them
in place into the first one only when that tensor is its own (no view, no other reference); the
fused losses returned a view of their padded ``[Vp, H]`` buffer, so autograd summed into a third
``[V, H]`` tensor: TRL's GRPO on a Llama-1B shape peaked 0.43 GiB above Liger's, one head's bf16
size (benchmarks/results/h100-2026-12-07-thirtieth/trl-memory/). Checked here on the op's own
backward: the sum is an in-place ``add_`` (no out-of-place ``add`` of ``[V, H]``), and the summed
gradient matches the op's reference, for an aligned V and a padded one. (A plain ``F.linear`` head
sums out of place too, torch 2.13: its dW reaches the sum as a transposed view.)"""

from __future__ import annotations

import pytest
import torch

import polykernel
from polykernel.ops import fused_linear_cross_entropy as flce_op
from polykernel.ops import fused_linear_dpo_loss as dpo_op
from polykernel.ops import fused_linear_grpo_loss as grpo_op
from polykernel.ops import fused_linear_jsd as jsd_op

H, T = 32, 8


def _loss(name: str, impl: str | None):
    """(polykernel's loss, the op's reference) as functions of (hidden [R, T, H], the tied weight, ids [R, T])."""
    if name == "flce":
        return (
            lambda h, w, ids: polykernel.fused_linear_cross_entropy(h.reshape(-1, H), w, ids.reshape(-1), impl=impl),
            lambda h, w, ids: flce_op.reference(h.reshape(-1, H), w, ids.reshape(-1)),
        )
    if name == "fused_linear_jsd":

        def args(h, w, ids):  # the same teacher for both calls
            g = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(h) * 0.5
            return h.reshape(-1, H), w, g.reshape(-1, H), w.detach().flip(0)

        return (
            lambda h, w, ids: polykernel.fused_linear_jsd(*args(h, w, ids), impl=impl),
            lambda h, w, ids: jsd_op.reference(*args(h, w, ids)),
        )
    if name == "dpo":  # rows: the chosen, then the rejected
        return (
            lambda h, w, ids: polykernel.fused_linear_dpo_loss(h, w, ids, impl=impl)[0],
            lambda h, w, ids: dpo_op.reference(h, w, ids)[0],
        )
    assert name == "grpo"

    def grpo_args(ids):
        mask = torch.ones(ids.shape, device=ids.device)
        adv = torch.linspace(-1, 1, ids.shape[0], device=ids.device)
        return ids, mask, adv

    return (
        lambda h, w, ids: polykernel.fused_linear_grpo_loss(h, w, *grpo_args(ids), beta=0.0, impl=impl)[0],
        lambda h, w, ids: grpo_op.reference(h, w, *grpo_args(ids), beta=0.0)[0],
    )


def _backward(loss_fn, emb: torch.nn.Embedding, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, list]]]:
    """The tied weight's summed gradient and the [V, H] additions the backward ran."""
    emb.weight.grad = None
    hidden = emb(ids) * 1.0  # the model's hidden states: the embedding's rows, through one op
    loss = loss_fn(hidden, emb.weight, ids)
    v, h = emb.weight.shape
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    adds = [
        (e.name, e.input_shapes[0])
        for e in prof.events()
        if e.name in ("aten::add", "aten::add_") and e.input_shapes and e.input_shapes[0] == [v, h]
    ]
    return emb.weight.grad, adds


def _profiler_sees_adds() -> None:
    # the check below can fail: an out-of-place sum of two [V, H] tensors is an aten::add event
    a, b = torch.ones(5, 3), torch.ones(5, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        a + b
    assert any(e.name == "aten::add" and e.input_shapes[0] == [5, 3] for e in prof.events())


def _check(name: str, impl: str | None, device: str, v: int, dtype: torch.dtype) -> None:
    _profiler_sees_adds()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(v, H, device=device, dtype=dtype)
    with torch.no_grad():
        emb.weight.mul_(0.5)
    ids = torch.randint(0, v, (4, T), device=device)
    fn, ref = _loss(name, impl)
    got, adds = _backward(fn, emb, ids)
    assert adds == [("aten::add_", [v, H])], f"{name}: the tied head's two gradients were summed as {adds}, not in place"
    want, _ = _backward(ref, emb, ids)
    torch.testing.assert_close(got.float(), want.float(), **_TOL[dtype])


_TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-3}}
LOSSES = ("flce", "fused_linear_jsd", "dpo", "grpo")


@pytest.mark.parametrize("v", [256, 251], ids=["aligned-V", "padded-V"])
@pytest.mark.parametrize("name", LOSSES)
def test_a_tied_heads_gradients_are_summed_in_place(name, v):
    _check(name, None, "cpu", v, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [4096, 4093], ids=["aligned-V", "padded-V"])
@pytest.mark.parametrize("name", LOSSES)
def test_gpu_a_tied_heads_gradients_are_summed_in_place(name, v):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check(name, "triton", "cuda", v, torch.bfloat16)
