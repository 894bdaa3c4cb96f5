"""GDN decode-step benchmark on the GPU (issue 5): Qwen3.5-4B GDN shapes (24 GDN layers, 16 key heads,
32 value heads, K = V = 128), batch 1..128, one decode token summed over the layers, for

- per-token fp32 state and per-token bf16 state (:func:`kernels.recurrent_step.dense_recurrent_step`:
  the whole state read and written every token),
- buffered bf16 (dense bf16 checkpoint, bf16 buffer, dP = 8),
- PACE-4 (4-bit key-axis g 64 symmetric checkpoint, int8 buffer, dP = 8),
- PACE-4/8 (key-axis g 32 zero point, a quarter of the heads at 8 bits, mixed buffer with its 4-bit keys in
  groups of 16 with zero points, dP = 8),
- PACE-3 (PACE-4 at 3 bits, issue 48: its codes packed densely, 8 in 3 bytes, read as three byte planes and
  unpacked in registers; the checkpoint's code bytes are 3/4 of PACE-4's, the scales and the buffer the same),
- PACE-4 dP = 1 (its checkpoint format rounded every token, no buffer: the one-launch per-token recurrence
  :func:`kernels.recurrent_step.recurrent_run` that a dP = 1 decode runs)
  (each layer a :class:`pace_core.schedule.PeriodicState` on :class:`kernels.backend.TritonSteps`),
- when flash-linear-attention is installed (carry the ``fla-core`` wheel), its
  ``fused_recurrent_gated_delta_rule`` per token, as transformers calls it for decode: its state is
  fp32 whatever the input (it allocates the final state in fp32), so it is the fla baseline for
  the per-token states.

Timing: each layer has its own state, buffer and inputs; one dP = 8 token period over all layers
(8 x 24 launches) is captured in a CUDA graph, replayed ``--reps`` times after a warm-up, timed by
CUDA events; the median replay / 8 is the time per token. Each variant tries a few launch
configurations (:func:`configs`: typed settings of :mod:`kernels.settings`, the same number for the baselines) and
reports its fastest among those whose outputs and states after a period agree with its first configuration's
(:func:`outputs_agree`: a configuration that computes or stores something else is never reported as the fastest).
The state does not depend on the context length (512 tokens in the issue), so none is built.

Bytes per token: see ``BYTES_MODEL``. Achieved bandwidth over the device-to-device copy bandwidth
measured in the same run (bytes read + written) gives the fraction of HBM bandwidth.

Usage (on the GPU machine): ``python3 kernels/bench/bench.py --out DIR``; writes ``DIR/bench.json`` and
``DIR/bench.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.backend import TritonSteps
from kernels.flush import launch_flush
from kernels.packed_step import launch_dots, launch_packed_step, launch_records
from kernels.recurrent_step import dense_recurrent_step
from kernels.settings import FusedSettings, Launch, RecurrentSettings, Settings, SplitSettings
from pace_core.buffer import record_bytes
from pace_core.config import get_config
from pace_core.memory import reachable_tensors
from pace_core.methods import state_format
from pace_core.provenance import measurement
from pace_core.recurrence import prepare_qk
from pace_core.schedule import PeriodicState

LAYERS, H, HV, K, V, PERIOD = 24, 16, 32, 128, 128, 8
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
BYTES_MODEL = (
    "a lower bound, each byte counted once: per-token states (and PACE-4 dP=1's checkpoint) read + write the "
    "whole state; buffered "
    "variants read the checkpoint every token, write it once per dP, write one record per non-flush token "
    "and read the (dP - 1) / 2 records held on average; all variants read q, k, v, g, beta and write o "
    "(float32). The flush token's second pass over the checkpoint (an L2 hit) is not counted."
)
FLA = "fla fused_recurrent (fp32 state)"
DP1 = "PACE-4 dP=1"
PACE3 = "PACE-3 dP=8"
VARIANTS = ("fp32 per-token", "bf16 per-token", "bf16 buffered dP=8", "PACE-4 dP=8", "PACE-4/8 dP=8", PACE3, DP1, FLA)
try:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
except ImportError:  # the fla baseline is optional
    fla_recurrent = None


def available_variants() -> list[str]:
    """The variants this machine can run (the fla baseline only with flash-linear-attention)."""
    return [v for v in VARIANTS if v != FLA or fla_recurrent is not None]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``reps``."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * nbytes / statistics.median(times)


def _inputs(B: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    q, k = prepare_qk(torch.randn(B, H, K, device=device), torch.randn(B, H, K, device=device))
    v = torch.randn(B, HV, V, device=device)
    g = -torch.rand(B, HV, device=device) * 0.3
    beta = torch.rand(B, HV, device=device)
    return q, k, v, g, beta


def _io_bytes(B: int) -> int:
    """q, k, v, g, beta read and o written, float32."""
    return 4 * B * (2 * H * K + HV * V + 2 * HV + HV * V)


def buffered_config(variant: str):
    """The configuration of a variant kept in a checkpoint format (PACE-4/8: every fourth head at 8 bits)."""
    if variant == DP1:
        return get_config("pace-4").replace(name=DP1, decode_period=1)
    if variant == "bf16 buffered dP=8":
        return get_config("bf16").replace(name="bf16 buffered", decode_period=PERIOD, buffer="bf16")
    if variant == "PACE-4 dP=8":
        return get_config("pace-4")
    if variant == PACE3:
        return get_config("pace-3")
    return get_config("pace-4-8").replace(high_heads=(tuple(range(0, HV, 4)),))


def _layer_state(variant: str, S: torch.Tensor, steps=None) -> PeriodicState:
    """One layer's state of a checkpointed variant on ``steps`` (default: the Triton backend): ``S`` stored in its
    format, an empty buffer of dP records (none at dP = 1)."""
    cfg = buffered_config(variant)
    fmt = state_format(cfg, cfg.head_bits(0, HV) if cfg.quantized else (cfg.bits,) * HV)
    steps = steps or TritonSteps()
    st = PeriodicState(fmt, steps, (S.shape[0], H, HV, K, V), S.device, prefill_period=256,
                       decode_period=cfg.decode_period,
                       buffer=cfg.buffer_format, exact_current=cfg.exact_current_token)
    st.set_checkpoint(steps.store(fmt, S)[0])
    return st


def _ckpt_bytes(ckpt) -> int:
    return ckpt.numel() * ckpt.element_size() if isinstance(ckpt, torch.Tensor) else ckpt.nbytes()


SPLIT_VARIANTS = ("PACE-4 dP=8", "PACE-4/8 dP=8", PACE3)  # packed key-axis checkpoints: step + flush kernels


def configs(variant: str) -> list[Settings | None]:
    """Launch settings tried for ``variant`` (the fastest is reported; all are kept in the JSON): per-token kernels:
    columns per program and warps; the fused buffered kernel: rows per tile and warps; the split path: each kernel's
    options side by side (:class:`kernels.settings.SplitSettings`; :func:`time_variant` also times the combination of
    each kernel's fastest): the step as one kernel or two, warps, columns, launches per bit width, the Gluon kernels
    on or off, and (issue 43) the Gluon step over 2 or 4 warps per head and the Gluon flush over several key-row
    blocks per head for small batches, register caps for occupancy at large ones. The first is the defaults, which the
    others' outputs are checked against."""
    if variant == FLA:
        return [None]  # fla picks its own launch configuration
    if variant.endswith("per-token") or variant == DP1:
        return [RecurrentSettings(block_v=32, num_warps=4), RecurrentSettings(block_v=64, num_warps=4),
                RecurrentSettings(block_v=64, num_warps=8)]
    if variant in SPLIT_VARIANTS:
        S = SplitSettings
        return [S(),
                S(fused_step=True, step_warps=8, dots_columns=64, flush_warps=1, flush_columns=32, dots_per_part=True,
                  per_part=False, gluon_flush=False, gluon_step=False),
                S(fused_step=False, dots_warps=8, record_warps=2, flush_warps=2, flush_columns=64, dots_per_part=False,
                  per_part=False, gluon_dots=False, gluon_flush=False, gluon_step=False),
                S(fused_step=False, dots_columns=32, dots_warps=2, record_warps=4, flush_columns=64, dots_per_part=True,
                  per_part=True, gluon_flush=False),
                S(fused_step=True, step_warps=2, dots_warps=2, dots_per_part=False, per_part=True, gluon_dots=False,
                  gluon_flush=False, gluon_step=False),
                S(fused_step=True, dots_per_part=True, per_part=True, gluon_step_warps=4, flush_row_blocks=2),
                S(fused_step=True, dots_per_part=True, per_part=True, dots_ahead=4, step_maxnreg=112,
                  dots_maxnreg=112, flush_maxnreg=112),
                S(fused_step=True, dots_per_part=True, per_part=True, gluon_step_warps=2, flush_row_blocks=4)]
    return [FusedSettings(rows=64, num_warps=4), FusedSettings(rows=64, num_warps=8),
            FusedSettings(rows=128, num_warps=8)]


def build(variant: str, B: int, device: torch.device):
    """Each layer's state, inputs and output, and the bytes moved per token (all layers)."""
    layers = []
    bytes_per_token = 0
    for _ in range(LAYERS):
        S = torch.randn(B, HV, K, V, device=device) * 0.05
        inputs = _inputs(B, device)
        out = torch.empty(B, HV, V, device=device)
        if variant == FLA:
            layers.append(("fla", [S], tuple(x[:, None] for x in inputs), out))  # [B, T=1, ...] inputs
            bytes_per_token += 2 * S.numel() * S.element_size() + _io_bytes(B)
        elif variant.endswith("per-token"):
            state = S if variant.startswith("fp32") else S.to(torch.bfloat16)
            layers.append(("dense", state, inputs, out))
            bytes_per_token += 2 * state.numel() * state.element_size() + _io_bytes(B)
        else:
            st = _layer_state(variant, S)
            layers.append(("buffered", st, inputs, out))
            if st.buffer is None:  # dP = 1: the checkpoint read and a new one written every token
                bytes_per_token += 2 * _ckpt_bytes(st.checkpoint) + _io_bytes(B)
                continue
            rec = B * record_bytes(st.buffer.format, H, HV, K, V)
            cb = _ckpt_bytes(st.checkpoint)
            bytes_per_token += (cb + cb / PERIOD + rec * ((PERIOD - 1) / PERIOD + (PERIOD - 1) / 2)
                                + _io_bytes(B))
    return layers, bytes_per_token


def run_period(layers: list, config: Settings | None) -> None:
    """dP tokens over all layers with one launch configuration."""
    launch = Launch.of(config)
    for _ in range(PERIOD):
        for kind, state, (q, k, v, g, beta), out in layers:
            if kind == "dense":
                dense_recurrent_step(state, q, k, v, g, beta, config, out=out)
            elif kind == "fla":  # a new fp32 state each token, as transformers keeps it
                o, state[0] = fla_recurrent(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state[0],
                                            output_final_state=True)  # q prepared: already scaled
                out.copy_(o[:, 0])
            else:
                if state.steps.launch != launch:
                    state.steps = TritonSteps(launch)
                if state.buffer is None:  # dP = 1: the schedule's per-token run, its output copied
                    out.copy_(state.decode(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])[:, 0])
                else:  # the schedule's token (the flush after the one that fills the buffer) into the layer's output
                    state.steps.step(state, *(q, k, v, g, beta), flush=state.fills_buffer(1), out=out)


AGREEMENT = 1e-2
"""How far a configuration's outputs may be from the first configuration's (relative Frobenius norm over every
layer's output of a period's last token, from the same state), and its states after the period likewise: the
kernels of two configurations sum in other orders (float32 rounding) and may store a buffered record one code apart
where a value lies within that of a rounding boundary (a step of an int8 record is under 1 % of its largest value,
and it weighs in one token's part of the output), or a flushed checkpoint's entry one code apart there (rarely);
a configuration that computes something else is off by the size of the output, and a wrong flush (PACE-4/8's narrow
Triton flush on an H100, 2026-12-07: every entry 20 codes apart) by far more than 1 % of the state."""


def period_outputs(layers: list, config: Settings | None, restore: Callable[[], None]) -> list[torch.Tensor]:
    """Every layer's output of one period's last token with ``config``, then every layer's state after the period (a
    buffered layer's checkpoint as it stores it, dequantised: the period's flush), from the state ``restore`` puts
    back (before and after)."""
    restore()
    run_period(layers, config)
    out = torch.cat([o.reshape(-1).double() for _, _, _, o in layers])
    held = {"dense": lambda st: st, "fla": lambda st: st[0], "buffered": lambda st: st.loaded()}
    states = torch.cat([held[kind](st).reshape(-1).double() for kind, st, _, _ in layers])
    restore()
    return [out, states]


def outputs_agree(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether each of ``got`` (:func:`period_outputs`: outputs, states) is within :data:`AGREEMENT` of ``ref``'s
    (finite, relative Frobenius norm), and the largest distance."""
    err = max(float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref))
    return all(bool(torch.isfinite(g).all()) for g in got) and err <= AGREEMENT, err


def keep_memory(layers: list) -> Callable[[], None]:
    """What the ``layers``' states, checkpoints and buffers hold now, kept: the returned function writes it back
    in place. Each timed replay decodes one period from the same state, as a real decode's state stays in its
    range: replayed over and over on one period's inputs, a state rounded every token random-walks its rounding
    noise in the directions no key erases (a head whose decay is near 1) until a scale overflows."""
    held = [t for _, state, _, _ in layers for t in reachable_tensors(state)]
    saved = [t.clone() for t in held]
    lists = [(state, list(state)) for kind, state, _, _ in layers if kind == "fla"]  # fla returns a new state

    def restore() -> None:
        for states, first in lists:
            states[:] = first
        for t, s in zip(held, saved):
            t.copy_(s)

    return restore


def time_graph(work, reps: int, layers: list) -> list[float]:
    """Seconds of each of ``reps`` CUDA-graph replays of ``work()`` (captured after a warm-up run), the
    ``layers``' memory restored to what it held at the call (:func:`keep_memory`) before the warm-up, the
    capture and every replay."""
    restore = keep_memory(layers)
    restore()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        restore()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del graph
    restore()
    return times


def time_config(layers: list, config: Settings | None, reps: int) -> list[float]:
    """Seconds per token of ``reps`` CUDA-graph replays of one period."""
    return [t / PERIOD for t in time_graph(lambda: run_period(layers, config), reps, layers)]


def fill_buffers(layers: list, n: int) -> None:
    """Each buffered layer's buffer holds ``n`` records (of its own inputs), the ones before dropped."""
    for _, st, (_, k, v, g, _), _ in layers:
        st.buffer.clear()
        for _ in range(n):
            st.buffer.append(k, v * 0.1, g)


def split_kernels(layers: list, config: SplitSettings) -> dict[str, Callable[[], None] | None]:
    """The split path's kernels over all layers, each a function launching it alone (:func:`split_breakdown`): the
    one-kernel step (None where the heads are too narrow for it, ``plan.split.fusable``), the dots kernel, the record
    kernel and the flush. One launch plan per layer and setting, made here, before any capture (a plan reads the head
    map off the GPU)."""
    tuned = [TritonSteps(Launch.of(config)).plan(st) for _, st, _, _ in layers]
    fused = [TritonSteps(Launch.of(dataclasses.replace(config, fused_step=True))).plan(st) for _, st, _, _ in layers]

    def dots() -> None:
        for plan, (_, _, (q, k, _, _, _), _) in zip(tuned, layers):
            launch_dots(plan, q, k)

    def records() -> None:
        for plan, (_, st, (q, k, v, g, beta), out) in zip(tuned, layers):
            launch_records(plan, st.buffer, q, k, v, g, beta, out)

    def step() -> None:
        for plan, (_, st, (q, k, v, g, beta), out) in zip(fused, layers):
            launch_packed_step(plan, st.buffer, q, k, v, g, beta, out)

    def flushes() -> None:
        for plan, (_, st, _, _) in zip(tuned, layers):
            launch_flush(plan, st.buffer)

    return {"step": step if all(plan.split.fusable for plan in tuned) else None, "dots": dots, "records": records,
            "flush": flushes}


def split_breakdown(layers: list, config: SplitSettings, reps: int) -> dict:
    """The split path's kernels timed alone over all layers (median seconds, :func:`split_kernels`): the one-kernel
    step, the dots kernel and the record kernel with dP / 2 records buffered (the token's record written into the free
    slot, not counted), and the flush kernel with dP records. The one-kernel step is None where the heads are too
    narrow for it."""
    work = split_kernels(layers, config)
    fill_buffers(layers, PERIOD // 2)
    out = {"step_seconds": statistics.median(time_graph(work["step"], reps, layers)) if work["step"] else None,
           "dots_seconds": statistics.median(time_graph(work["dots"], reps, layers)),
           "records_seconds": statistics.median(time_graph(work["records"], reps, layers))}
    fill_buffers(layers, PERIOD)
    out["flush_seconds"] = statistics.median(time_graph(work["flush"], reps, layers))
    fill_buffers(layers, 0)
    return {**out, "records_at_step": PERIOD // 2}


WARM_BATCHES = (1, 8)
"""The batches :func:`warm` compiles at: one wave of programs and several (the launch settings' "auto" choose other
kernels in each, e.g. PACE-4/8's launches per bit width); a kernel's compilation does not depend on the batch
otherwise (its pointers are aligned alike, the record count is not specialised)."""


def warm(variant: str, index: int, device: torch.device) -> None:
    """Compile into Triton's cache every kernel that timing ``variant`` with configuration ``index`` of
    :func:`configs` launches (one eager period, and the split path's kernels alone), at :data:`WARM_BATCHES`: run in
    parallel processes before the timing (``--warm-workers``), the compilations (minutes on a fresh machine) overlap."""
    config = configs(variant)[index]
    for B in WARM_BATCHES:
        layers, _ = build(variant, B, device)
        period_outputs(layers, config, keep_memory(layers))
        if variant in SPLIT_VARIANTS:
            for name, work in split_kernels(layers, config).items():
                if work is not None:
                    fill_buffers(layers, PERIOD if name == "flush" else PERIOD // 2)
                    work()
        torch.cuda.synchronize()


WARM_TIMEOUT_S = 240.0
"""The longest one warm-up process may take (then it is stopped and its compilations left to the timing)."""


def warm_all(variants: list[str], workers: int) -> list[str]:
    """:func:`warm` of every configuration of ``variants``, ``workers`` processes at a time; returns the failures
    (a failed or stopped warm-up only leaves the compilation to the timing)."""
    jobs = [(v, i) for v in variants for i in range(len(configs(v)))]
    running, failed = {}, []
    while jobs or running:
        while jobs and len(running) < workers:
            v, i = job = jobs.pop(0)
            log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a child's warnings never block it
            running[job] = (subprocess.Popen([sys.executable, __file__, "--warm-only", v, str(i)],
                                             stdout=subprocess.DEVNULL, stderr=log, text=True), log, time.monotonic())
        for proc, _, started in running.values():
            if proc.poll() is None and time.monotonic() - started > WARM_TIMEOUT_S:
                proc.kill()
        done = [job for job, (proc, _, _) in running.items() if proc.poll() is not None]
        for job in done:
            proc, log, _ = running.pop(job)
            log.seek(0)
            err = log.read().strip()
            log.close()
            if proc.returncode:
                failed.append(f"{job[0]} #{job[1]}: {err.splitlines()[-1] if err else proc.returncode}")
        if not done:
            time.sleep(0.2)
    return failed


SPLIT_KERNEL_KEYS = {"step_seconds": ("step_warps", "gluon_step", "gluon_step_warps", "dots_ahead", "step_maxnreg"),
                     "dots_seconds": ("dots_columns", "dots_warps", "dots_per_part", "gluon_dots", "dots_maxnreg"),
                     "records_seconds": ("record_warps",),
                     "flush_seconds": ("flush_warps", "flush_columns", "per_part", "gluon_flush", "flush_maxnreg",
                                       "flush_row_blocks")}


def best_split_combination(tried: list[dict]) -> SplitSettings:
    """The split path's launch settings with each kernel's own fastest options (every kernel is timed alone in every
    configuration tried, :func:`split_breakdown`; configurations whose outputs disagree left out), and the step as
    one kernel where the fastest one-kernel step beats the fastest dots and record kernels together."""
    tried = [r for r in tried if r.get("agrees", True) and "error" not in r] or tried[:1]
    changes, fastest = {}, {}
    for seconds, keys in SPLIT_KERNEL_KEYS.items():
        timed = [r for r in tried if r["split_breakdown"][seconds] is not None]
        best = min(timed, key=lambda r: r["split_breakdown"][seconds]) if timed else tried[0]
        changes.update({key: getattr(best["config"], key) for key in keys})
        fastest[seconds] = best["split_breakdown"][seconds]
    step = fastest["step_seconds"]
    changes["fused_step"] = step is not None and step < fastest["dots_seconds"] + fastest["records_seconds"]
    return dataclasses.replace(tried[0]["config"], **changes)


def time_variant(variant: str, B: int, device: torch.device, reps: int) -> dict:
    """Every configuration of ``variant`` at batch ``B`` timed (and, for the split path, each kernel alone and the
    combination of each kernel's fastest), its outputs checked against the first configuration's
    (:func:`outputs_agree`); the fastest that agrees is the row's. A configuration that fails (a kernel that does not
    compile on this Triton, a launch refused) is kept in the row with its error and left out."""
    layers, nbytes = build(variant, B, device)
    restore = keep_memory(layers)
    tried = []

    def attempt(config: Settings | None) -> None:
        try:
            agrees, err = outputs_agree(period_outputs(layers, config, restore), reference)
            times = time_config(layers, config, reps)
            breakdown = split_breakdown(layers, config, reps) if variant in SPLIT_VARIANTS else None
        except Exception as exc:
            restore()
            tried.append({"config": config, "error": f"{type(exc).__name__}: {exc}", "agrees": False})
            return
        tried.append({"config": config, "seconds_per_token": statistics.median(times),
                      "spread": (min(times), max(times)), "agrees": agrees, "distance": err,
                      "split_breakdown": breakdown})

    every = configs(variant)
    reference = period_outputs(layers, every[0], restore)
    for config in every:
        attempt(config)
    if variant in SPLIT_VARIANTS:  # unless a configuration tried is the combination once its "auto" are decided
        config = best_split_combination(tried)
        resolved = lambda c: TritonSteps(Launch.of(c)).plan(layers[0][1]).split.settings  # noqa: E731
        if all(resolved(r["config"]) != resolved(config) for r in tried):
            attempt(config)
    finite = all(bool(torch.isfinite(out).all()) for _, _, _, out in layers)
    agreeing = [r for r in tried if r["agrees"]]
    if not agreeing:
        raise RuntimeError("no configuration ran with outputs that are finite and agree: "
                           + "; ".join(r.get("error", f"distance {r.get('distance')}") for r in tried))
    best = min(agreeing, key=lambda r: r["seconds_per_token"])
    breakdown = best["split_breakdown"]
    t = best["seconds_per_token"]
    return {"variant": variant, "batch": B, "seconds_per_token": t, "spread": best["spread"],
            "config": best["config"], "tried": tried, "bytes_per_token": nbytes,
            "bytes_per_second": nbytes / t, "outputs_finite": finite, "split_breakdown": breakdown,
            "disagreeing": [r["config"] for r in tried if not r["agrees"] and "error" not in r],
            "failed": [r["config"] for r in tried if "error" in r]}


def measure(variant: str, B: int, device: torch.device, reps: int, bandwidth: float) -> dict:
    """:func:`time_variant`'s row with its share of the copy ``bandwidth``; a variant that cannot run at this
    batch (out of memory, a refusal of the library, a launch that fails) gets a row that says why instead."""
    try:
        row = time_variant(variant, B, device, reps)
    except Exception as err:
        return {"variant": variant, "batch": B, "error": f"{type(err).__name__}: {err}"}
    finally:  # the variant's layers are gone with time_variant's frame
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**row, "hbm_fraction": row["bytes_per_second"] / bandwidth}


def jsonable(x: object) -> object:
    """``json.dumps``' fallback: launch settings as their fields."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def settings_text(config: Settings | None) -> str:
    """The fields of ``config`` that differ from its family's defaults (``defaults`` where none do)."""
    if config is None:
        return "-"
    base = type(config)()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(base, f.name)}
    return " ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"


def row_line(row: dict) -> str:
    """One printed line of a row."""
    if "error" in row:
        return f"B={row['batch']:4d} {row['variant']:20s} did not run: {row['error']}"
    split = row["split_breakdown"]
    step = "-" if split is None or split["step_seconds"] is None else f"{split['step_seconds'] * 1e6:.1f}"
    parts = "" if split is None else (f" step {step} us, dots {split['dots_seconds'] * 1e6:.1f} us, records "
                                      f"{split['records_seconds'] * 1e6:.1f} us, flush "
                                      f"{split['flush_seconds'] * 1e6:.1f} us")
    return (f"B={row['batch']:4d} {row['variant']:20s} {row['seconds_per_token'] * 1e6:9.1f} us/token "
            f"{row['bytes_per_token'] / 1e6:9.2f} MB {row['hbm_fraction'] * 100:5.1f}% HBM "
            f"[{settings_text(row['config'])}] finite={row['outputs_finite']}{parts}"
            + (f"; {len(row['disagreeing'])} configuration(s) disagree, left out" if row.get("disagreeing") else "")
            + (f"; {len(row['failed'])} configuration(s) failed, left out" if row.get("failed") else ""))


GLUON = ("gluon_dots", "gluon_flush", "gluon_step")


def _triton_only(row: dict) -> float | None:
    """The fastest time per token of a row's configurations that turn every Gluon kernel off (of those that ran and
    agree, :func:`time_variant`; a row as timed or as read back from bench.json), or None where none did."""
    fields = lambda config: config if isinstance(config, dict) else dataclasses.asdict(config)  # noqa: E731
    times = [t["seconds_per_token"] for t in row["tried"]
             if "error" not in t and t["agrees"] and not any(fields(t["config"])[g] for g in GLUON)]
    return min(times) if times else None


def vs_pace4(three: dict, four: dict) -> dict:
    """PACE-3's row against PACE-4's at one batch (same card, same run): the ratio of their fastest times, of the
    fastest on the Triton kernels alone (PACE-3 has no Gluon kernel, kernels.plan: every one of its configurations
    runs the Triton kernels; PACE-4's with the Gluon ones off: the same kernels, 3-bit against 4-bit codes; None where
    no such configuration of PACE-4 ran) and of the bytes moved per token (``BYTES_MODEL``)."""
    triton = _triton_only(four)
    return {"time_ratio": three["seconds_per_token"] / four["seconds_per_token"],
            "triton_time_ratio": None if triton is None else three["seconds_per_token"] / triton,
            "bytes_ratio": three["bytes_per_token"] / four["bytes_per_token"]}


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in results["variants"]:
        rows = [r for r in results["rows"] if r["variant"] == variant and "error" not in r]
        xs = [r["batch"] for r in rows]
        ax1.plot(xs, [r["seconds_per_token"] * 1e6 for r in rows], marker="o", label=variant)
        ax2.plot(xs, [r["hbm_fraction"] * 100 for r in rows], marker="o", label=variant)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("GDN decode step, µs per token (24 layers)")
    ax2.set_ylabel("% of measured HBM copy bandwidth")
    ax2.axhline(80, color="grey", ls="--", lw=1)
    ax1.legend(fontsize=8)
    fig.suptitle(f"Qwen3.5-4B GDN decode step on {results['device']} "
                 f"(copy {results['copy_bandwidth'] / 1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None, device: torch.device | None = None) -> int:
    """The command line (module docstring); ``device``: another device than CUDA (the CPU tests, under the Triton
    interpreter with the timer replaced)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of: " + ", ".join(VARIANTS) + " (default: all available)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no batch after the first past this many seconds (the rows so far are kept, the "
                         "batches left named)")
    ap.add_argument("--warm-workers", type=int, default=0,
                    help="compile every configuration's kernels first in this many parallel processes")
    ap.add_argument("--warm-only", nargs=2, metavar=("VARIANT", "INDEX"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.warm_only:
        warm(args.warm_only[0], int(args.warm_only[1]), device or torch.device("cuda"))
        return 0
    unknown = set(args.variants.split(",")) - set(VARIANTS) if args.variants else set()
    if unknown:
        print(f"bench: --variants {', '.join(sorted(unknown))} not known; allowed: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if device is None and not torch.cuda.is_available():
        print("bench: no CUDA device; this benchmark runs on the GPU machine only", file=sys.stderr)
        return 2
    device = device or torch.device("cuda")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    bw = copy_bandwidth(device)
    chosen = args.variants.split(",") if args.variants else VARIANTS
    variants = [v for v in available_variants() if v in chosen or v == "bf16 per-token"]  # the speed-up's base
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
               **measurement(), "triton": triton.__version__, "fla": _fla_version(),
               "shape": {"gdn_layers": LAYERS, "key_heads": H, "value_heads": HV, "d_k": K, "d_v": V,
                         "decode_period": PERIOD},
               "copy_bandwidth": bw, "bytes_model": BYTES_MODEL, "variants": variants, "rows": []}
    print(f"device {results['device']}  copy bandwidth {bw / 1e12:.3f} TB/s (read + write)  fla {results['fla']}",
          flush=True)
    if args.warm_workers:
        t0 = time.monotonic()
        results["warm_failures"] = warm_all(variants, args.warm_workers)
        results["warm_seconds"] = time.monotonic() - t0
        print(f"compiled in {results['warm_seconds']:.0f} s by {args.warm_workers} processes"
              + "".join(f"\n  warm-up failed: {f}" for f in results["warm_failures"]), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    for i, B in enumerate(batches):
        if i and args.deadline_s is not None and time.monotonic() - started > args.deadline_s:
            results["not_run_batches"] = batches[i:]
            print(f"bench: past the deadline of {args.deadline_s:.0f} s; batches {batches[i:]} not run", flush=True)
            break
        for variant in variants:
            row = measure(variant, B, device, args.reps, bw)
            results["rows"].append(row)
            print(row_line(row), flush=True)
        # partial results survive a timeout
        (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=jsonable))
    by = {(r["variant"], r["batch"]): r for r in results["rows"] if "error" not in r}
    done = sorted({r["batch"] for r in results["rows"]})
    for (_, B), row in by.items():
        base = by.get(("bf16 per-token", B))
        if base is not None:
            row["speedup_vs_bf16_per_token"] = base["seconds_per_token"] / row["seconds_per_token"]
    for B in done:  # 3 bits against 4 on the same card, same run
        if (PACE3, B) in by and ("PACE-4 dP=8", B) in by:
            by[(PACE3, B)]["vs_pace4"] = vs_pace4(by[(PACE3, B)], by[("PACE-4 dP=8", B)])
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=jsonable))
    plot(results, args.out / "bench.png")
    header = (f"{'batch':>5} " + " ".join(f"{v:>20}" for v in variants)
              + "".join(f" {v.split()[0] + ' vs bf16':>17}" for v in SPLIT_VARIANTS if v in variants))
    print("\nµs per token (24 GDN layers) [% of HBM copy bandwidth]; - : the variant did not run (its row says why)")
    print(header)
    for B in done:
        cells = " ".join(f"{by[(v, B)]['seconds_per_token'] * 1e6:11.1f} [{by[(v, B)]['hbm_fraction'] * 100:4.0f}%]"
                         if (v, B) in by else f"{'-':>20}" for v in variants)
        speeds = [by.get((v, B), {}).get("speedup_vs_bf16_per_token") for v in SPLIT_VARIANTS if v in variants]
        print(f"{B:5d} {cells}" + "".join(f" {x:16.2f}x" if x else f" {'-':>17}" for x in speeds))
    three = [(B, by[(PACE3, B)]["vs_pace4"]) for B in done if "vs_pace4" in by.get((PACE3, B), {})]
    if three:
        print("\nPACE-3 against PACE-4 (time with each one's fastest kernels, time on the Triton kernels alone, bytes "
              "per token): " + ", ".join(f"B={B} {r['time_ratio']:.2f}x / {_ratio(r['triton_time_ratio'])} / "
                                         f"{r['bytes_ratio']:.2f}x" for B, r in three))
    return 0


def _fla_version() -> str:
    if fla_recurrent is None:
        return "not installed"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return "installed (version unknown)"


if __name__ == "__main__":
    raise SystemExit(main())
