"""Where and at what size the kernels' tests run.

On CPU (CI) the kernels run under the Triton interpreter on tiny shapes. ``TRITON_INTERPRET`` is read
when a ``@triton.jit`` function is defined, Triton's own standard library included: if Triton was
imported before the variable was set (transformers imports it when the test session's conftest
loads), its standard library is reloaded once so that ``tl.max`` & co. are interpreted too; then the
kernels modules are (re)loaded in dependency order.

With ``PACE_KERNEL_TESTS=cuda`` (``kernels/gpu_check.py`` sets it) the same tests run the compiled
kernels on the GPU at full Qwen3.5 GDN shapes (B 8, 16 key heads, K = V = 128, dP 8).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

ON_GPU = os.environ.get("PACE_KERNEL_TESTS") == "cuda"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if ON_GPU:
    SIZES = dict(B=8, H=16, K=128, V=128, PERIOD=8, GROUP=32, T=300, P=128, CHUNK=64, QUANT_SHAPE=(8, 32, 128, 128))
else:
    SIZES = dict(B=2, H=2, K=16, V=16, PERIOD=4, GROUP=8, T=11, P=4, CHUNK=4, QUANT_SHAPE=(2, 3, 16, 32))


MODULES = ("primitives", "step_inputs", "records", "plan", "quantize", "packed_step", "flush", "fused_step",
           "recurrent_step", "chunk", "pool_step", "backend")
"""The kernels' modules, each after those it imports."""


def kernel_modules() -> dict[str, ModuleType]:
    """The kernels' modules by name (:data:`MODULES`): interpreted on CPU, compiled on the GPU (where new
    tensors then default to the GPU)."""
    names = MODULES
    if ON_GPU:
        torch.set_default_device(DEVICE)
        return {name: importlib.import_module(f"kernels.{name}") for name in names}
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.max, InterpretedFunction):
        importlib.reload(tl.standard)
        importlib.reload(tl)
    return {name: importlib.reload(importlib.import_module(f"kernels.{name}")) for name in names}
