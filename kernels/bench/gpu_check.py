"""The kernels' correctness tests on the GPU at full Qwen3.5 GDN shapes (issue 5).

Runs ``tests/test_kernels_quantize.py``, ``tests/test_kernels_decode.py`` and ``tests/test_kernels_pool_step.py`` with
``PACE_KERNEL_TESTS=cuda``: the compiled Triton kernels on CUDA tensors against the pace_core reference
(on the same GPU) and a float64 plain recurrence, at B = 8, 16 key heads, 32 and 48 value heads
(γ = 2 and 3), K = V = 128, dP = 8, P = 128 (see ``tests/kernels_support.py``). The tests' conftest is
not loaded (it builds tiny transformers checkpoints the kernels do not need).

Where pytest-xdist is installed the tests run in up to 8 processes: Triton's compilation, which takes most of the
run, is spread over the host's cores (the GPU work is small).

Usage (on the GPU machine, from the repository root): ``python3 kernels/bench/gpu_check.py``; exit status
is pytest's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ("tests/test_kernels_quantize.py", "tests/test_kernels_decode.py", "tests/test_kernels_pool_step.py",
         "tests/test_kernels_step_inputs.py")


def main() -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run this on the GPU machine", file=sys.stderr)
        return 2
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    env = {**os.environ, "PACE_KERNEL_TESTS": "cuda",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    workers = min(8, os.cpu_count() or 1)
    spread = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-rfE",
           "--durations=5", *spread, *TESTS]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
