"""What the Triton distillation losses share: the generalized JSD's per-element math (a
``@triton.jit`` helper inlined into the jsd and fused_linear_jsd kernels) and the row-chunk
launch settings.

The math is the op file's (``polykernel.ops._distill.jsd_terms``), in closed form: per element
of student log-probs x and teacher log-probs y, the term and its derivative in x.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rows import next_pow2

BLOCK = 4096  # elements of one input row a chunk, any dtype
ELEMS_PER_THREAD = 8  # warps = chunk / (32 * 8): 16 for a full chunk


def config(v: int, elt: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program per row walking V in chunks of 4096 elements on 16
    warps, 8 elements a thread, whatever the dtype (``elt`` is unused): faster than 16 KB chunks on
    8 warps for kl_div, jsd and tvd in bf16 and fp32 at V 32000 and 128256, most for jsd in bf16
    (benchmarks/results/h100-2026-12-07-thirtieth/distill_config/)."""
    block = max(16, min(next_pow2(max(v, 1)), BLOCK))
    warps = max(4, min(16, block // (32 * ELEMS_PER_THREAD)))
    return block, warps


@triton.jit
def jsd_elem(x, y, beta, BETA_MODE: tl.constexpr):
    """(term, d term / dx) in fp32 for student log-probs ``x`` and teacher log-probs ``y``.

    BETA_MODE 0: KL(P‖Q) = P·(y - x); 1: KL(Q‖P) = Q·(x - y); 2: the generalized JSD with
    log M = m + log(β·e^(y-m) + (1-β)·e^(x-m)), m = max(x, y), where one of the two exps is 1 and
    the other e^(-|x - y|) (no underflow of M to 0 where P or Q is not 0; one exp fewer). A
    probability of exactly 0 contributes 0 (0·log 0 = 0; the NaN of log M where both are 0 is
    never selected); NaN stays NaN.
    """
    if BETA_MODE == 0:
        p = tl.exp(y)
        term = tl.where(p == 0.0, 0.0, p * (y - x))
        dx = -p
    elif BETA_MODE == 1:
        q = tl.exp(x)
        term = tl.where(q == 0.0, 0.0, q * (x - y))
        dx = tl.where(q == 0.0, 0.0, term + q)
    else:
        p = tl.exp(y)
        q = tl.exp(x)
        e = tl.exp(-tl.abs(x - y))
        mix = tl.where(x >= y, beta * e + (1.0 - beta), beta + (1.0 - beta) * e)
        log_m = tl.maximum(x, y) + tl.log(mix)
        tq = tl.where(q == 0.0, 0.0, (1.0 - beta) * q * (x - log_m))
        term = tl.where(p == 0.0, 0.0, beta * p * (y - log_m)) + tq
        dx = tq
    return term, dx
