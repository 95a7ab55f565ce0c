"""``serving.rotary_embedding_``: rotary position embedding in place, vLLM's layout and semantics.

``positions [T]`` (int32/int64) picks each token's row of ``cos_sin_cache [max_pos, rotary_dim]``,
whose first half holds cos and second half sin (``cat(cos, sin)``, rotary_dim/2 each). query is
``[T, Hq·head_size]`` or ``[T, Hq, head_size]``, key likewise with Hk heads, or None. In each head
the first ``rotary_dim`` features rotate (``rotary_dim < head_size``: the rest pass through
untouched, partial rotary), pair i by angle i:

- ``is_neox=True`` (rotate-half, NeoX/Llama): pairs ``(x[i], x[i + rotary_dim/2])``;
- ``is_neox=False`` (GPT-J, interleaved): pairs ``(x[2i], x[2i + 1])``;

``(x1, x2) <- (x1·cos - x2·sin, x2·cos + x1·sin)``, in fp32 (fp64 stays fp64), each result rounded
once to the tensor's dtype, written over query and key; returns ``(query, key)``.
``rotary_dim`` defaults to the cache's width and must equal it when given. The cache is read in
its own dtype: an fp32 cache with bf16 q rotates by the fp32 cos/sin (so does vLLM's kernel when
handed one; vLLM's ``RotaryEmbedding`` layer casts its cache to the query's dtype first, and a bf16
cache gives the same result here). Positions are ``[T]`` only (vLLM's take ``[B, S]`` too);
vLLM's ``offsets``, ``rope_dim_offset`` and ``inverse`` have no counterpart.

Positions outside ``[0, max_pos)``: for CPU tensors the call raises before writing anything. On
CUDA that check would need a device sync (no CUDA graphs, a host stall per call), so it is not
made: the impls never read outside the cache and write NaN into the rotated features of such a
token, so the fault shows downstream instead of a silently wrong rotation.
Inference only; CUDA-graph safe (one launch, no allocation).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _serving as serving

OP_ID = "serving.rotary_embedding_"
POSITION_DTYPES = (torch.int32, torch.int64)


def heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[T, H, head_size]`` view of query or key (no copy: splitting one dim is always a view)."""
    return t if t.dim() == 3 else t.unflatten(-1, (t.shape[-1] // head_size, head_size))


def reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64), written over query and key."""
    max_pos, rd = cos_sin_cache.shape
    half = rd // 2
    valid = (positions >= 0) & (positions < max_pos)
    rows = cos_sin_cache.index_select(0, positions.clamp(0, max_pos - 1).long())  # in bounds whatever positions hold
    acc = torch.promote_types(query.dtype, torch.float32)
    rows = torch.where(valid[:, None], rows.to(acc), float("nan"))[:, None, :]  # [T, 1, rd]: NaN for a bad position
    cos, sin = rows[..., :half], rows[..., half:]

    def rotate(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        part = heads(t, head_size)[..., :rd]
        v = part.to(acc)
        x1, x2 = (v[..., :half], v[..., half:]) if is_neox else (v[..., 0::2], v[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        part.copy_(torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2))
        return t

    return rotate(query), rotate(key)


def _qk(name: str, t: torch.Tensor, tokens: int, head_size: int) -> None:
    check.tensor(OP_ID, name, t)
    check.floating(OP_ID, name, t)
    if t.dim() == 2:
        if t.shape[0] != tokens or t.shape[1] % head_size:
            raise check.OpArgumentError(
                OP_ID, name, f"expected [T={tokens}, heads·head_size] with head_size={head_size} dividing the width, got {tuple(t.shape)}"
            )
    elif t.dim() == 3:
        if t.shape[0] != tokens or t.shape[2] != head_size:
            raise check.OpArgumentError(OP_ID, name, f"expected [T={tokens}, heads, head_size={head_size}], got {tuple(t.shape)}")
    else:
        raise check.OpArgumentError(OP_ID, name, f"expected [T, heads·head_size] or [T, heads, head_size], got shape {tuple(t.shape)}")
    serving.inference_only(OP_ID, name, t)
    serving.written(OP_ID, name, t)


def validate(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> None:
    check.tensor(OP_ID, "positions", positions)
    if positions.dtype not in POSITION_DTYPES or positions.dim() != 1:
        raise check.OpTypeError(
            OP_ID, "positions", f"expected a 1-d int32 or int64 tensor [T], got {positions.dtype} of shape {tuple(positions.shape)}"
        )
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise check.OpArgumentError(OP_ID, "head_size", f"expected a positive int, got {check.shown(head_size)}")
    tokens = positions.shape[0]
    check.tensor(OP_ID, "query", query)
    # positions is the odd one out where query (and key, if given) agree on T and it does not;
    # where key agrees with positions instead, query is (below)
    if query.dim() in (2, 3) and query.shape[0] != tokens and (not isinstance(key, torch.Tensor) or key.shape[:1] == query.shape[:1]):
        raise check.OpArgumentError(OP_ID, "positions", f"expected one position per token of query (T={query.shape[0]}), got {tokens}")
    _qk("query", query, tokens, head_size)
    if key is not None:
        _qk("key", key, tokens, head_size)
        if key.dtype != query.dtype:
            raise check.OpTypeError(OP_ID, "key", f"expected query's dtype {query.dtype}, got {key.dtype}")
    check.tensor(OP_ID, "cos_sin_cache", cos_sin_cache)
    check.floating(OP_ID, "cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] == 0:
        raise check.OpArgumentError(
            OP_ID, "cos_sin_cache", f"expected [max_pos, rotary_dim] with max_pos > 0, got {tuple(cos_sin_cache.shape)}"
        )
    rd = cos_sin_cache.shape[1]
    if rd == 0 or rd % 2 or rd > head_size:
        raise check.OpArgumentError(
            OP_ID, "cos_sin_cache", f"expected an even rotary_dim in (0, head_size={head_size}] as its width (cat(cos, sin)), got {rd}"
        )
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or rotary_dim != rd):
        raise check.OpArgumentError(OP_ID, "rotary_dim", f"expected None or the cache's width {rd}, got {check.shown(rotary_dim)}")
    check.boolean(OP_ID, "is_neox", is_neox)
    check.same_device(OP_ID, "positions", positions, "query", query)
    for name, t in (("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t is not None:
            check.same_device(OP_ID, name, t, "query", query)
    check_memory(positions, query, key, cos_sin_cache)


def check_memory(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cos_sin_cache: torch.Tensor) -> None:
    """What validity reads of memory and values (overlaps, strides, the positions on the CPU),
    on every call before anything is written: the guard recognises a repeat by metadata and
    options only."""
    if not all(isinstance(t, torch.Tensor) for t in (positions, query, cos_sin_cache)) or not isinstance(key, (torch.Tensor, type(None))):
        return  # validate names it
    serving.written(OP_ID, "query", query)
    serving.written(OP_ID, "key", key)
    serving.no_overlap(OP_ID, "key", key, "query", query)
    # a cache inside query or key would be read by one token after another token rotated it
    serving.no_overlap(OP_ID, "cos_sin_cache", cos_sin_cache, "query", query)
    serving.no_overlap(OP_ID, "cos_sin_cache", cos_sin_cache, "key", key)
    # Positions' values: checked where it is cheap, CPU tensors (on CUDA it needs a device sync;
    # the impls write NaN for such a token there instead: see the module doc).
    if (
        positions.numel()
        and positions.device.type == "cpu"
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[0]
        and not serving.compiling()
    ):
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            bad = lo if lo < 0 else hi
            raise check.OpArgumentError(OP_ID, "positions", f"position {bad} is outside the cache's [0, {cos_sin_cache.shape[0]})")


def _key(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple:
    return (
        query.device,
        query.dtype,
        False,
        head_size,
        cos_sin_cache.shape[-1],
        is_neox,
        key is not None,
        serving.tokens(positions.shape[0]),
    )


_op: Op  # defined below, after the public function it serves


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query and key in place by their tokens' positions; returns ``(query, key)``.

    >>> import torch, polykernel
    >>> pos = torch.tensor([0, 5]); cache = torch.cat((torch.ones(16, 4), torch.zeros(16, 4)), -1)
    >>> q, k = torch.randn(2, 2 * 8), torch.randn(2, 8)
    >>> q0 = q.clone()
    >>> q2, k2 = polykernel.rotary_embedding_(pos, q, k, 8, cache)  # angle 0: unchanged
    >>> q2 is q and torch.equal(q, q0)
    True
    """
    if not serving.compiling():  # every call, before any write (compiled: the custom op checks)
        check_memory(positions, query, key, cos_sin_cache)
    if rotary_dim is None:  # the cache's width (a cache that has none: validate names it)
        rotary_dim = cos_sin_cache.shape[-1] if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() else None
    return _dispatch(impl, positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each rotated value is x1·c - x2·s (or x2·c + x1·s) in fp32, rounded once: two products and a
# sum that may cancel, so its error is relative to |x1·c| + |x2·s| <= max|x|·max(|c| + |s|),
# the output's own scale (|c|, |s| <= 1 for a real cache). The cache is read in fp32 from its own
# dtype (the same values in the exact result); the pass-through features are copied exactly.
def error_model(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> Bounds:
    cs = cos_sin_cache.detach().double()
    half = cs.shape[-1] // 2
    trig = (cs[:, :half].abs() + cs[:, half:].abs()).max().item() if cs.numel() else 1.0

    def model(t: torch.Tensor | None) -> ErrorModel:
        x_max = t.detach().abs().max().item() if t is not None and t.numel() else 0.0
        return ErrorModel(ops=3, cancel=3, scale=x_max * max(trig, 1.0))

    return Bounds(outputs=(model(query), model(key)))


def rope_cache(
    max_pos: int, rotary_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """vLLM's ``cos_sin_cache`` for the standard RoPE: ``cat(cos(p·θ_i), sin(p·θ_i))`` with
    ``θ_i = base^(-2i/rotary_dim)``, ``[max_pos, rotary_dim]`` (tests, benchmarks, examples).
    Computed in float64 and rounded once to ``dtype``; vLLM computes θ and p·θ in fp32, so its
    entries at position p are off by up to about p·2^-23 radians from these."""
    inv_freq = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), -1).to(dtype)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Arguments for a query of shape ``[T, Hq·head_size]`` (head_size 128, Hk = Hq/4 as in
    Llama-3's GQA, positions spread over a 4096-row cache)."""
    tokens, width = shape[0], shape[-1]
    head_size = 128 if width % 128 == 0 else width
    hq = width // head_size
    hk = max(1, hq // 4)
    q = torch.randn(tokens, width, dtype=dtype, device=device)
    k = torch.randn(tokens, hk * head_size, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    return Case(f"{tokens}x{width}", (positions, q, k, head_size, rope_cache(4096, head_size, device=device)))


def bytes_moved(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    *_: object,
    backward: bool = False,
) -> int:
    """Fewest bytes: the rotated features of query and key read and written, the tokens' cache rows read."""
    rd = cos_sin_cache.shape[-1]
    feats = (query.numel() + (key.numel() if key is not None else 0)) // head_size * rd
    return 2 * feats * query.element_size() + positions.shape[0] * (rd * cos_sin_cache.element_size() + positions.element_size())


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """NeoX and GPT-J, partial rotary, GQA, no key, strided slices of a fused QKV, sized for the
    CPU interpreter unless ``large``."""

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device).to(dtype)

    def pos(tokens: int, max_pos: int) -> torch.Tensor:
        return torch.randint(0, max_pos, (tokens,), device=device)

    def qkv(tokens: int, hq: int, hk: int, hs: int) -> tuple[torch.Tensor, torch.Tensor]:
        # query and key as slices of one fused [T, (Hq + 2·Hk)·hs] projection (vLLM's qkv.split)
        fused = t(tokens, (hq + 2 * hk) * hs)
        return fused[:, : hq * hs], fused[:, hq * hs : (hq + hk) * hs]

    cache = rope_cache(64, 16, device=device)
    out = []
    for neox in (True, False):
        tag = "neox" if neox else "gptj"
        kw = {"is_neox": neox}
        out += [
            Case(f"1tok-4x16-{tag}", (pos(1, 64), t(1, 64), t(1, 32), 16, cache), kw),
            Case(f"5tok-gqa-{tag}", (pos(5, 64), t(5, 8 * 16), t(5, 2 * 16), 16, cache), kw),
            Case(f"3tok-partial-{tag}", (pos(3, 64), t(3, 4 * 24), t(3, 24), 24, cache), kw),  # rotary_dim 16 of 24
            Case(f"4tok-fused-qkv-{tag}", (pos(4, 64), *qkv(4, 4, 2, 16), 16, cache), kw),
            Case(f"6tok-3d-{tag}", (pos(6, 64), t(6, 3, 16), t(6, 1, 16), 16, cache), kw),
        ]
    out += [
        Case("0tok", (pos(0, 64), t(0, 64), t(0, 32), 16, cache)),
        Case("4tok-no-key", (pos(4, 64), t(4, 48), None, 16, cache)),
        Case("3tok-int32-positions", (pos(3, 64).int(), t(3, 32), t(3, 32), 16, cache)),
        Case("7tok-cache-fp64", (pos(7, 64), t(7, 32), t(7, 16), 16, rope_cache(64, 16, dtype=torch.float64, device=device))),
        Case("2tok-head256-rd64", (pos(2, 1000), t(2, 2 * 256), t(2, 256), 256, rope_cache(1000, 64, device=device)), {"is_neox": False}),
        # head sizes FlashInfer compiles, in the two forms the others leave out there: NeoX with a
        # partial rotary_dim (its kernel pairs x[i] with x[i + rotary_dim/2], not head_size/2) and GPT-J whole
        Case("3tok-head128-rd32", (pos(3, 64), t(3, 2 * 128), t(3, 128), 128, rope_cache(64, 32, device=device))),
        Case("2tok-head64-gptj", (pos(2, 64), t(2, 4 * 64), t(2, 64), 64, rope_cache(64, 64, device=device)), {"is_neox": False}),
        Case("40tok-wide", (pos(40, 4096), t(40, 4 * 128), t(40, 128), 128, rope_cache(4096, 128, device=device))),
    ]
    if large:
        big = rope_cache(8192, 128, device=device)
        out += [
            Case("8192tok-llama8b", (pos(8192, 8192), t(8192, 32 * 128), t(8192, 8 * 128), 128, big)),
            Case("64tok-llama8b", (pos(64, 8192), t(64, 32 * 128), t(64, 8 * 128), 128, big)),
            Case(
                "8192tok-gptj",
                (pos(8192, 8192), t(8192, 16 * 256), t(8192, 16 * 256), 256, rope_cache(8192, 64, device=device)),
                {"is_neox": False},
            ),
        ]
    return out


def outputs(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, *_: object
) -> tuple[tuple[torch.Size, torch.dtype] | None, ...]:
    """The outputs' shapes and dtypes (query's and key's), without running anything."""
    return ((query.shape, query.dtype), (key.shape, key.dtype) if key is not None else None)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "head_size", "rotary_dim", "is_neox", "has_key", "tokens"),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, None, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, True, True, None),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    writes=("query", "key"),
    validate_each_call=True,
)
_dispatch = _op.dispatch
