"""The distillation kernels' launch settings (block, warps) on a CUDA GPU, against Liger's TVD kernel.

    PYTHONPATH=src python benchmarks/kernels/sweep_distill_config.py [--json FILE] [--rows 8192] [--vocab 128256]

Our kl_div, jsd and tvd kernels walk one row per program in chunks whose size and warp count
``backends/triton/_distill.config`` picks. Each row times one kernel launch (the forward that also
writes the gradient: what a training step runs) with ``config`` replaced by one setting, the first
of each loss being the library's current one, and Liger's ``tv_distance_forward_triton`` at the
same shape (no labels: no host sync in it). The first sweep (2026-12-07, H100) found the default
of then, 16 KB chunks on 8 warps, slower than 4096 elements on 16 warps:
benchmarks/results/h100-2026-12-07-thirtieth/distill_config/.

Timing: ``triton.testing.do_bench`` (L2 flushed between calls), median of the calls. Bytes moved:
3·N·V·elt (both inputs read once, the gradient written once); TB/s from the median.
``--json FILE`` keeps the rows, written as they are measured.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
import triton.testing

from polykernel.backends.triton import _distill
from polykernel.backends.triton import jsd as tjsd
from polykernel.backends.triton import kl_div as tkl
from polykernel.backends.triton import tvd as ttvd
from polykernel.tools.rows import RowFile, announce

# (block elements, warps); None: the library's own choice
SETTINGS: tuple[tuple[int, int] | None, ...] = (None, (8192, 8), (4096, 8), (2048, 8), (8192, 16), (8192, 32), (16384, 16), (16384, 32))
MODULES = {"kl_div": tkl, "jsd": tjsd, "tvd": ttvd}


@contextlib.contextmanager
def setting(module, block_warps: tuple[int, int] | None) -> Iterator[None]:
    """The module's launcher reads ``config`` at each launch: replaced for the block."""
    if block_warps is None:
        yield
        return
    module.config = lambda v, elt: block_warps
    try:
        yield
    finally:
        module.config = _distill.config


def launcher(loss: str, x: torch.Tensor, y: torch.Tensor, dx: torch.Tensor, scale: torch.Tensor) -> Callable[[], object]:
    if loss == "kl_div":  # x: log-probs, y: probabilities (log_target False)
        return lambda: tkl.kl_div_rows(x, y, False, 1, dx, None, scale=1.0 / x.shape[0])
    if loss == "jsd":
        return lambda: tjsd.jsd_rows(x, y, None, -100, 0.5, dx, scale)
    return lambda: ttvd.tvd_rows(x, y, None, -100, 1, dx, None, scale=scale)


def inputs(loss: str, rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(rows, vocab, device="cuda", dtype=torch.float32).log_softmax(-1)
    b = torch.randn(rows, vocab, device="cuda", dtype=torch.float32).log_softmax(-1)
    if loss == "kl_div":
        return a.to(dtype), b.exp().to(dtype)
    if loss == "tvd":  # probabilities
        return a.exp().to(dtype), b.exp().to(dtype)
    return a.to(dtype), b.to(dtype)


def liger_tvd() -> Callable | None:
    try:
        from liger_kernel.ops.tvd import tv_distance_forward_triton
    except Exception:  # not installed here: no peer row
        return None
    return tv_distance_forward_triton


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--losses", default="tvd,kl_div,jsd")
    a = p.parse_args(argv)
    losses, dtypes = a.losses.split(","), [getattr(torch, d) for d in a.dtypes.split(",")]
    announce(len(losses) * len(dtypes) * (len(SETTINGS) + 1), per_case_s=1.5, what="loss x dtype x setting", path=a.json)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "rows": a.rows, "vocab": a.vocab, "torch": torch.__version__})
    peer = liger_tvd()
    for dtype in dtypes:
        for loss in losses:
            x, y = inputs(loss, a.rows, a.vocab, dtype)
            dx = torch.empty_like(x)
            scale = torch.full((1,), 1.0 / a.rows, device="cuda")
            nbytes = 3 * x.numel() * x.element_size()
            base = {"loss": loss, "dtype": str(dtype).removeprefix("torch."), "shape": f"{a.rows}x{a.vocab}"}
            for label, fn in candidates(loss, x, y, dx, scale, peer):
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                except Exception as exc:  # a setting a kernel cannot take (registers, shared memory) is a row too
                    out.add({**base, "setting": label, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    continue
                out.add({**base, "setting": label, "ms": ms, "tb_s": nbytes / ms / 1e9})
            del x, y, dx
            torch.cuda.empty_cache()
    out.finish()


def candidates(loss, x, y, dx, scale, peer) -> list[tuple[str, Callable[[], object]]]:
    """(label, call) per setting, the library's default first; Liger's TVD last where installed."""
    fn, module = launcher(loss, x, y, dx, scale), MODULES[loss]
    out = []
    for s in SETTINGS:
        label = "default {}x{}".format(*_distill.config(x.shape[1], x.element_size())) if s is None else f"{s[0]}x{s[1]}"
        out.append((label, _under(module, s, fn)))
    if loss == "tvd" and peer is not None:
        out.append(("liger", lambda: peer(x, y, None, "batchmean", -100, False)))
    return out


def _under(module, s, fn) -> Callable[[], object]:
    def call():
        with setting(module, s):
            return fn()

    return call


if __name__ == "__main__":
    main()
