"""Triton kernels for packed PACE recurrent states, one file per algorithm (as flash-linear-attention's
``fla/ops``), each beside its pure-PyTorch reference in pace_core:

- ``quantize``: quantise + pack and unpack + dequantise (pace_core.quant's format, per-head bit widths);
- ``packed_step`` and ``flush``: the buffered decode step of packed key-axis checkpoints and its flush;
- ``fused_step``: the buffered decode step of dense and value-axis checkpoints, flush included;
- ``recurrent_step``: the per-token recurrence (dP = 1), a run of tokens per launch on a dense or packed state;
- ``chunk``: a prefill segment (fla's chunk kernel where installed);
- ``primitives`` and ``records``: the shared device functions; ``plan``: launch planning (the typed arguments of
  each launch); ``settings``: the launch settings, one frozen dataclass per kernel family;
- ``backend``: these kernels as a pace_core backend (pace_core.backend).

GPU correctness checks and benchmarks are in ``kernels/bench/`` (not part of the runtime package);
measurements in kernels/bench/NOTES.md, results in data/bench/."""
