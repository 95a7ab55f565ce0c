"""``patch(model, mode="inference")`` under ``torch.compile(fullgraph=True)``: one graph (no break),
the logits of the eager patched and the unpatched model, prefill and decode steps on a
``StaticCache``; and no stale merged weight after the projections change under a compiled model
(``.to()``, ``load_state_dict(assign=True)``, a wrapper or hook swapped in). ``aot_eager``/``eager``
backends: what is proven is Dynamo's trace and functionalization, not Inductor's code."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_inference import prompt, tiny_llama  # noqa: E402

from polykernel.integrations.transformers import patch  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)  # test_inference's fp32 tolerance


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode(forward, config, steps: int = 2) -> torch.Tensor:
    """Prefill 5 tokens into a StaticCache, then ``steps`` greedy steps: the logits of each."""
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    out = []
    with torch.no_grad():
        logits = forward(prompt(2, 5), past_key_values=cache, use_cache=True, cache_position=torch.arange(5)).logits[:, -1]
        out.append(logits)
        for i in range(steps):
            tok = logits.argmax(-1, keepdim=True)
            logits = forward(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([5 + i])).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def test_fullgraph_compile_matches_eager_and_unpatched_on_a_static_cache():
    ref = tiny_llama(layers=2)
    model = copy.deepcopy(ref)
    patch(model, mode="inference")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break raises
    want = _decode(ref, ref.config)
    torch.testing.assert_close(_decode(model, model.config), want, **TOL)
    torch.testing.assert_close(_decode(compiled, model.config), want, **TOL)
    # (without a cache: the tests below)
    # the carried residual stream and the merged-layout activation are in the graph (not a fallback)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert {"polykernel.fused_add_rms_norm_.default", "polykernel.silu_and_mul.default"} <= ops


def _compiled_pair(layers: int = 1) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(unpatched, patched, the patched one compiled) after one compiled call."""
    ref = tiny_llama(layers)
    model = copy.deepcopy(ref)
    patch(model, mode="inference")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(prompt()).logits, ref(prompt()).logits, **TOL)
    return ref, model, compiled


def _same_logits(compiled: torch.nn.Module, ref: torch.nn.Module) -> None:
    with torch.no_grad():
        torch.testing.assert_close(compiled(prompt()).logits, ref(prompt()).logits, **TOL)


def test_compiled_after_to_dtype_uses_the_moved_weights():
    ref, model, compiled = _compiled_pair()
    ref.to(torch.float64)
    model.to(torch.float64)  # the projections' .data replaced: no longer views of the merged weight
    _same_logits(compiled, ref)


def test_compiled_after_load_state_dict_assign_uses_the_new_weights():
    # same shapes and dtype: no guard of Dynamo's changes, only the parameters' identity
    ref, model, compiled = _compiled_pair()
    new = tiny_llama(1, seed=1).state_dict()
    ref.load_state_dict(new)
    model.load_state_dict(copy.deepcopy(new), assign=True)
    _same_logits(compiled, ref)


def test_compiled_after_a_wrapper_or_hook_on_the_projections_runs_them():
    class Scaled(torch.nn.Module):  # as PEFT's LoRA layer wraps the linear it adapts
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) * 1.5

    ref, model, compiled = _compiled_pair()
    for m in (ref, model):
        mlp = m.model.layers[0].mlp
        mlp.gate_proj = Scaled(mlp.gate_proj)
        mlp.up_proj.register_forward_hook(lambda mod, args, out: out * 2)
        m.model.layers[0].self_attn.k_proj.register_forward_hook(lambda mod, args, out: out * 2)
    _same_logits(compiled, ref)


def test_generate_auto_compiles_the_patched_forward_in_one_graph():
    # transformers' generate() compiles a static-cache decode step by itself (on CUDA; here forced
    # on the CPU): fullgraph=True raises at a break, and the tokens are the unpatched model's
    ref = tiny_llama(layers=2)
    model = copy.deepcopy(ref)
    patch(model, mode="inference")
    config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None, dynamic=False)
    config._compile_all_devices = True
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(prompt(), **kw)
        torch._dynamo.utils.counters.clear()
        got = model.generate(prompt(), compile_config=config, **kw)
    assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
