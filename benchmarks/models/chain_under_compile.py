"""The inference patch's residual-stream check under torch.compile (a diagnostic).

On the GPU machine's torch 2.11 the ``polykernel+compile`` decode rows ran transformers' forward
(h100-2026-12-06-twentyfirst/decode): ``_inference._chain_whole`` returned False while Dynamo
traced the model's forward, not on the CPU's torch 2.13. This evaluates the check's pieces in eager
and under ``torch.compile`` (the ``eager`` backend: Dynamo alone) on a tiny patched Llama, alone
(``compiled``) and inside the model's own compiled forward (``in_forward``), and says whether the
patch fell back. What it found (h100-2026-12-06-twentysecond/chain/): inside the forward, torch
2.11's Dynamo answered None to ``getattr(fn, "__func__", None)`` on a layer's bound forward while
``fn.__func__`` and the method's own attributes read right; ``_on_stream`` now reads the tag
through the method. One JSON object on stdout.

    PYTHONPATH=src python benchmarks/models/chain_under_compile.py
"""

from __future__ import annotations

import json
import logging

import torch

PIECES = ("forward_in_dict", "getattr_func", "tag_via_func", "direct_func", "tag_via_method", "self_is_module", "stream_is", "on_stream")


def pieces(module, stream, place: str) -> tuple:
    """``_inference._on_stream``'s steps on ``module``'s bound forward, each way of reading its tag
    (through ``getattr(fn, "__func__", None)``, ``fn.__func__``, the method itself), as booleans."""
    from polykernel.integrations.transformers import _inference

    fn = module.__dict__.get("forward")
    func = getattr(fn, "__func__", None)
    via_func = getattr(func, "_polykernel_stream", None)
    try:
        direct = fn.__func__ is not None
    except Exception as exc:  # (what Dynamo raises there, if it does)
        direct = type(exc).__name__
    tag = getattr(fn, "_polykernel_stream", None)
    return (
        fn is not None,
        func is not None,
        via_func is not None,
        direct,
        tag is not None,
        tag is not None and fn.__self__ is module,
        tag is not None and tag[0] is stream and tag[1] == place,
        _inference._on_stream(module, stream, place),
    )


def steps(base_model, stream) -> tuple:
    """The pieces for the final norm and the second layer, then the whole check."""
    from polykernel.integrations.transformers import _inference

    return (
        *pieces(base_model.norm, stream, "norm"),
        *pieces(base_model.layers[1], stream, "layer"),
        _inference._chain_whole(base_model, stream),
    )


NAMES = [f"{m}:{p}" for m in ("norm", "layer1") for p in PIECES] + ["chain_whole"]


def main() -> None:
    import transformers

    import polykernel
    from polykernel.integrations.transformers import patch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    patch(model, mode="inference")
    base_model = model.model
    stream = None  # the stream the patch installed (a closure cell of the base model's forward)
    for cell in base_model.__dict__["forward"].__func__.__closure__ or ():
        if type(cell.cell_contents).__name__ == "_Stream":
            stream = cell.cell_contents
    result = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "stream_found": stream is not None,
    }
    eager = steps(base_model, stream)
    torch._dynamo.reset()
    try:
        traced = torch.compile(lambda: steps(base_model, stream), backend="eager", fullgraph=False)()
    except Exception as exc:
        traced = f"{type(exc).__name__}: {exc}"[:500]
    result["eager"] = dict(zip(NAMES, eager))
    result["compiled"] = dict(zip(NAMES, traced)) if isinstance(traced, tuple) else traced
    if isinstance(traced, tuple):
        result["differ"] = [n for n, a, b in zip(NAMES, eager, traced) if a != b]
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage()[:300])

    logging.getLogger("polykernel").addHandler(Keep())
    from polykernel.integrations.transformers import _inference

    seen: list = []  # each check's pieces as the model's own compiled forward sees them
    original = _inference._chain_whole

    def recording(base, stream_):
        seen.append([stream_ is stream, *(pieces(layer, stream_, "layer" if i else "first") for i, layer in enumerate(base.layers))])
        return original(base, stream_)

    _inference._chain_whole = recording
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (2, 8), device=device)
    with torch.no_grad():
        try:
            out = torch.compile(model.forward, backend="eager")(input_ids=ids).logits
            ref = model(input_ids=ids).logits
            result["compiled_forward_max_diff"] = float((out - ref).abs().max())
        except Exception as exc:
            result["compiled_forward_error"] = f"{type(exc).__name__}: {exc}"[:500]
    _inference._chain_whole = original
    result["fallbacks_logged"] = list(records)
    result["in_forward"] = [repr(p)[:400] for p in seen]
    result["decisions"] = sorted({d["op"] for d in polykernel.decisions()})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
