"""``polykernel demo``: what runs on this machine, then the same Llama trained with plain PyTorch,
polykernel, Liger-Kernel and torch.compile, side by side.

1. The platform, and every op with each impl's verdict here (``polykernel.explain``).
2. A Llama trained for ``--steps`` steps on a synthetic but learnable token stream (a fixed random
   Markov chain: the loss falls from ``ln(vocab)`` towards the chain's entropy), once per
   contender, from the same seed, initial weights and batches. The model is a ``transformers``
   ``LlamaForCausalLM`` built from a config (random init, nothing downloaded) when transformers
   is installed, the built-in :mod:`polykernel.tools.models.llama` otherwise.
3. Per run: tokens/s (median step of steps 4-15), median step time, peak memory, the largest
   loss difference from plain PyTorch, and which impl polykernel used for each op and why.

``--size tiny`` (the CPU default) takes well under a minute on two cores; ``--size medium`` (the
default on a GPU with 60 GiB or more) is the issue's reference: a Llama-3.2-1B-shaped model
(hidden 2048, 16 layers, 32/8 heads, vocab 128256, tied embeddings), bf16, fused AdamW, batch
4 x 2048.

    $ polykernel demo                                  # or: python -m polykernel.tools.demo
    $ polykernel demo --size medium --isolate --json demo.json --plot demo.png
    $ polykernel demo --compare torch,polykernel,compile

Modules: :mod:`.data` (sizes, the token stream), :mod:`.models` (the contenders), :mod:`.runs`
(training, measuring), :mod:`.report` (tables), :mod:`.plots` (the picture), :mod:`.command`.
"""

from .command import build_parser, main
from .data import LOSS_TOL, SETUPS, DemoSetup, markov_stream
from .models import VARIANTS
from .runs import DemoResult, RunResult, run_demo, train, used_impls

__all__ = [
    "LOSS_TOL",
    "SETUPS",
    "VARIANTS",
    "DemoResult",
    "DemoSetup",
    "RunResult",
    "build_parser",
    "main",
    "markov_stream",
    "run_demo",
    "train",
    "used_impls",
]
