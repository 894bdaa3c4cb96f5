"""The fused CPU steps of a :class:`pace_core.pool.StatePool`: one compiled operator steps a batch of slots in
place, reading each checkpoint's codes where they lie in the pool and dequantising one head at a time in registers
and a per-thread buffer (``csrc/pool_cpu.cpp``), instead of the reference's gather, float32 checkpoint of every row,
PyTorch operators and scatter.

- **What it computes**: :meth:`StatePool.decode` of the reference (:func:`pace_core.recurrence.step_records`, the
  record written at each row's own position, :func:`~pace_core.recurrence.fold_records` and the format's store for
  the rows the token fills; at dP = 1 :func:`~pace_core.recurrence.gdn_recurrent` and the store), in another
  summation order: outputs agree to float32 rounding, codes wherever a value does not lie within float32 rounding
  of a rounding boundary (``tests/test_pool_cpu.py`` derives the bounds). With raw projections
  (:meth:`FusedPool.decode` given ``A_log, dt_bias``) it also prepares ``q, k`` (:func:`~pace_core.recurrence.
  prepare_qk`) and the gates (:func:`~pace_core.recurrence.gdn_gates`), and writes ``o`` in the output's dtype.
- **What it serves** (:func:`refusal`): every configuration a pool row holds (:mod:`pace_core.vllm.slots`): the
  float32 and bfloat16 references, RTN and PACE at any width 2..8 (codes and zero points packed densely, as
  :func:`pace_core.quant.pack_codes` stores them), group axis and size, symmetric or with zero points,
  a share of 8-bit heads, the key-axis Hadamard rotation and static scales, any dP and buffer precision, on
  float32 (or, raw, bfloat16 / float16) inputs with the exact current token. The rest runs on the reference.
- **Build**: the first use compiles ``csrc/pool_cpu.cpp`` with the machine's C++ compiler (``$CXX``, else
  ``c++``; ``-O3 -march=native -fopenmp``, against the running torch) into a cache folder (``$PACE_CPU_CACHE``, else
  ``$XDG_CACHE_HOME/pace-studio`` or ``~/.cache/pace-studio``) keyed by the source, torch and the CPU, and loads it
  as ``torch.ops.pace_cpu.decode`` and ``torch.ops.pace_cpu.prefill`` (10-30 s once;
  later processes load the cached library, with or without a
  compiler). Without a compiler, or if the build fails, the pool steps on the reference and the first pool to ask
  warns once, naming why (:func:`library`). Threads: torch's (``at::parallel_for`` over rows and heads).

Chosen by measurement over ``torch.compile`` of a step written for Inductor's C++ backend (README, "Serving with
vLLM": the numbers and ``scripts/bench_pool_cpu.py``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pace_core.buffer import BUFFER_LAYOUT
from pace_core.config import PaceConfig
from pace_core.methods.groups import GroupFormat
from pace_core.methods.none import DenseFormat

SOURCE = Path(__file__).resolve().parent / "csrc" / "pool_cpu.cpp"
CACHE_ENV = "PACE_CPU_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")
FAILURES = {1: "input", 2: "slot", 3: "state", 4: "record"}
"""What the operator reports in ``info[0]`` when a step cannot be completed (``csrc/pool_cpu.cpp``)."""

_LOADED: dict[str, str | None] = {}
_WARNED: set[str] = set()


def cache_dir() -> Path:
    """Where built libraries are kept (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pace-studio"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _command(compiler: str, source: Path, target: Path) -> list[str]:
    """The compiler's command line: the running torch's headers and libraries (as torch.utils.cpp_extension
    finds them)."""
    root = Path(torch.__file__).resolve().parent
    include, lib = root / "include", root / "lib"
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-I{include}",
            f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(source), "-o", str(target), f"-L{lib}",
            "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def library() -> str | None:
    """Load the compiled operator into this process, building it first when the cache has none (module
    docstring): None once it is loaded, else why it cannot be, in one line (the same answer for the process)."""
    key = "pool_cpu"
    if key in _LOADED:
        return _LOADED[key]
    digest = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, torch.__file__, " ".join(FLAGS),
                                       platform.machine(), _cpu_flags()]).encode()).hexdigest()[:20]
    target = cache_dir() / f"pool_cpu-{digest}.so"
    try:
        if not target.exists():
            reason = _build(target)
            if reason is not None:
                _LOADED[key] = reason
                return reason
        torch.ops.load_library(str(target))
        _LOADED[key] = None
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _LOADED[key] = f"the C++ step could not be loaded ({type(err).__name__}: {str(err)[:200]})"
    return _LOADED[key]


def _build(target: Path) -> str | None:
    """Compile the operator into ``target`` (atomically: a concurrent build of the same key writes the same
    library); None when built, else why not."""
    compiler = shutil.which(os.environ.get("CXX") or "c++")
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found; set CXX or install g++)"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run = subprocess.run(_command(compiler, SOURCE, built), capture_output=True, text=True, timeout=900)
        if run.returncode:
            first = next((line for line in run.stderr.splitlines() if "error" in line), run.stderr.strip())
            return f"the C++ build failed ({compiler}: {first[:200]})"
        os.replace(built, target)
    return None


def warn_once(reason: str) -> None:
    """Warn (once per process and reason) that pools step on the reference because of ``reason``."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"PACE: the state pool's fused CPU step is unavailable: {reason}; the pool steps on the "
                      "PyTorch reference (the same results, about half the serving speed)", RuntimeWarning,
                      stacklevel=3)


def refusal(cfg: PaceConfig, fmt, dims: tuple[int, int, int, int]) -> str | None:
    """Why the fused step does not serve a pool of ``cfg`` in format ``fmt`` (None: it does)."""
    H, HV, K, V = dims
    if not isinstance(fmt, (DenseFormat, GroupFormat)):
        return f"method {cfg.method!r} is stepped by the reference"
    if isinstance(fmt, DenseFormat) and fmt.dtype not in (torch.float32, torch.bfloat16):
        return f"reference dtype {fmt.dtype} is stepped by the reference"
    if not cfg.exact_current_token:
        return "exact_current_token=False is stepped by the reference"
    if cfg.rounding != "nearest":
        return f"rounding={cfg.rounding!r} is stepped by the reference"
    if cfg.buffered and cfg.buffer_format.precision not in ("fp32", "bf16", "int8", "mixed"):
        return f"buffer precision {cfg.buffer_format.precision!r} is stepped by the reference"
    if cfg.key_hadamard and K & (K - 1):
        return f"a key rotation of d_k={K} (not a power of two)"
    if isinstance(fmt, GroupFormat) and len(fmt.widths) > 2:
        return "more than two head widths"
    return None


@dataclass(frozen=True)
class Failure:
    """A step the operator could not complete (``kind`` of :data:`FAILURES`): its row ``row`` of the batch, value
    head ``head`` and record count ``count``, with the state ``S [K, V]`` or the delta value ``u [V]`` it could not
    store (in the format's basis: key-rotated with ``key_hadamard``)."""

    kind: str
    row: int
    head: int
    count: int
    S: torch.Tensor | None
    u: torch.Tensor | None


class FusedPool:
    """The fused decode step of one pool (module docstring): ``cfg``, ``fmt`` the pool's checkpoint format, ``dims =
    (H, HV, K, V)``, ``tensors`` its per-slot tensors (by :func:`pace_core.pool.pool_fields` name; each slot's
    part contiguous), ``checkpoint_names`` those of the checkpoint. Make it with :meth:`for_pool`."""

    def __init__(self, cfg: PaceConfig, fmt, dims: tuple[int, int, int, int], tensors: dict[str, torch.Tensor],
                 checkpoint_names: tuple[str, ...]) -> None:
        H, HV, K, V = dims
        self.fmt, self.dims = fmt, dims
        slots = next(iter(tensors.values())).shape[0]
        state, consts = [], []
        empty = torch.empty(0)
        head_part, head_index = [0] * HV, list(range(HV))
        if isinstance(fmt, DenseFormat):
            kind, axis, group, symmetric, widths = (0 if fmt.dtype == torch.float32 else 1), 0, 0, 1, []
            state.append(tensors["state"])
        else:
            static = cfg.scales == "static"
            kind, axis, group, symmetric = 3 if static else 2, int(cfg.group_axis == "value"), cfg.group_size, \
                int(cfg.symmetric)
            widths = list(fmt.widths)
            mixed = len(widths) > 1
            for p, b in enumerate(widths):
                heads = [h for h, hb in enumerate(fmt.bits_per_head) if hb == b]
                for i, h in enumerate(heads):
                    head_part[h], head_index[h] = p, i
                suffix = f"@{b}" if mixed or static else ""
                state.append(tensors["codes" + suffix])
                if static:
                    spec = cfg.quant_spec(b)
                    scale, zero = fmt._scales(spec, fmt._heads(b))
                    consts += [scale.float().contiguous(), empty if zero is None else zero.float().contiguous()]
                else:
                    state += [tensors["scale" + suffix], tensors.get("zero" + suffix, empty)]
        buffer = [0] * 8
        if cfg.buffered:
            layout = BUFFER_LAYOUT[cfg.buffer_format.precision]
            for part, (name, length) in enumerate((("key", K), ("value", V))):
                kind_of = layout[part]
                spec = cfg.buffer_format.spec(name, length)
                code = 2 if spec is not None else (0 if kind_of == torch.float32 else 1)
                buffer[4 * part:4 * part + 4] = [code, spec.bits if spec else 0, spec.group_size if spec else 0,
                                                 int(spec.symmetric) if spec else 1]
                plural = name + "s"
                state += [tensors[plural], tensors.get(f"{name}_scale", empty), tensors.get(f"{name}_zero", empty)]
            state.append(tensors["log_decays"])
        self.meta = [H, HV, K, V, cfg.decode_period if cfg.buffered else 1, kind, axis, group, symmetric,
                     len(widths), *(widths + [0, 0])[:2], int(cfg.key_hadamard), *buffer, cfg.prefill_period,
                     int(cfg.prefill_after_decode == "carry"), *head_part, *head_index, slots]
        self.state, self.consts = state, consts
        self.static = cfg.scales == "static" and not isinstance(fmt, DenseFormat)
        self.info = torch.zeros(8, dtype=torch.long)
        self.fail = torch.zeros(K * V + V)

    @classmethod
    def for_pool(cls, cfg: PaceConfig, fmt, dims: tuple[int, int, int, int], tensors: dict[str, torch.Tensor],
                 checkpoint_names: tuple[str, ...]) -> tuple[FusedPool | None, str | None]:
        """The fused step of a CPU pool, or None and why not (:func:`refusal`, :func:`library`; a missing library
        warns once)."""
        reason = refusal(cfg, fmt, dims)
        if reason is None and not all(t.device.type == "cpu" and t[0].is_contiguous() for t in tensors.values()):
            reason = "the pool's tensors are not on the CPU, or a slot's part is not contiguous"
        if reason is not None:
            return None, reason
        missing = library()
        if missing is not None:
            warn_once(missing)
            return None, missing
        return cls(cfg, fmt, dims, tensors, checkpoint_names), None

    def decode(self, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, out: torch.Tensor, gates: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> Failure | None:
        """One decode token per slot of ``slots [B]`` (int32 or int64) into ``out [B, HV, V]`` (float32 or
        bfloat16): ``q, k [B, H, K]`` prepared, ``v [B, HV, V]``, ``g, beta [B, HV]`` float32; with ``gates =
        (A_log, dt_bias)`` instead the raw projections (``q, k, v`` float32 / bfloat16 / float16 with the last axis
        contiguous, ``g`` the raw ``a`` and ``beta`` the raw ``b``). None when every row stepped, else the
        :class:`Failure` (nothing of that row and head written)."""
        A_log, dt_bias = gates if gates is not None else (None, None)
        torch.ops.pace_cpu.decode(slots, q, k, v, g, beta, A_log, dt_bias, out, self.state, self.consts, self.meta,
                                  self.info, self.fail)
        return self._outcome()

    def prefill(self, slots: torch.Tensor, starts: torch.Tensor, initial: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor,
                gates: tuple[torch.Tensor, torch.Tensor] | None = None) -> Failure | None:
        """Prompts in ``slots [n]``: prompt ``p`` is rows ``starts[p] .. starts[p + 1]`` (``starts [n + 1]``,
        non-empty prompts) of the inputs (as :meth:`decode`'s, one row per token), from its slot's stored state where
        ``initial[p]`` (bool) else from zero; ``o`` into the same rows of ``out``."""
        A_log, dt_bias = gates if gates is not None else (None, None)
        torch.ops.pace_cpu.prefill(slots, starts, initial, q, k, v, g, beta, A_log, dt_bias, out, self.state,
                                   self.consts, self.meta, self.info, self.fail)
        return self._outcome()

    def _outcome(self) -> Failure | None:
        info = self.info.tolist()
        if self.static:  # as GroupFormat counts its stores: values stored, and those saturated
            self.fmt.count(info[4], info[5] * self.dims[2] * self.dims[3])
        if not info[0]:
            return None
        K, V = self.dims[2], self.dims[3]
        kind = FAILURES[info[0]]
        return Failure(kind, info[1], info[2], info[3],
                       self.fail[:K * V].view(K, V).clone() if kind == "state" else None,
                       self.fail[K * V:].clone() if kind == "record" else None)
