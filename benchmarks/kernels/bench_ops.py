"""Side-by-side GPU benchmark (the code lives in polykernel.tools.bench; see ``polykernel bench --help``).

PYTHONPATH=src python benchmarks/kernels/bench_ops.py [--ops rms_norm,softmax] [--graph] [--out DIR]
"""

from polykernel.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
