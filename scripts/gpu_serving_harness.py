"""The vLLM plugin's state step on the GPU kernels without vLLM (issue 44.2): a continuous-batching harness.

    python3 scripts/gpu_serving_harness.py --out DIR [--configs pace-4 pace-4-8 bf16] [--batch 128] [--steps 48]
                                           [--heads 16 --v-heads 32 --dim 128] [--device cuda]
                                           [--launch JSON] [--profile N] [--ncu]

vLLM's CUDA wheel does not reach the GPU host, so this drives what the plugin's custom operator
(``torch.ops.vllm.pace_gdn_state``, :mod:`pace_core.vllm.layer`) runs after vLLM's conv: ``StatePool.decode_projected``
on the batch's decode rows, then ``StatePool.prefill_projected`` on its prompts, on a pool of ``--batch`` slots whose
backend is the project's Triton kernels. The step is registered as a custom operator of its own
(``pace_harness::state_step``, opaque to torch.compile as the plugin's is) over one GDN layer of Qwen3.5's shape
(``--heads`` key heads, ``--v-heads`` value heads, ``--dim`` = K = V), bfloat16 projections in and out.

Per configuration (``--configs``; bf16 is the dense bfloat16 state the targets compare with):

1. ``continuous``: ``--steps`` forwards of a scheduler as vLLM's: requests join free slots at random (prompts of 1 to
   ``--prompt`` tokens, a prompt longer than ``--chunk`` split over forwards as a chunked prefill, its next part
   continued from the stored state), decode ``--min-out``..``--max-out`` tokens, and leave (their slots reused);
   every forward mixes decode rows and prompt rows, slots in random order. Before each forward the reference pool
   (``backend="reference"``, the definition of correct) is given the kernel pool's stored state; both run the
   forward; outputs must agree within ``LIMIT`` (relative Frobenius norm, tests/test_vllm_slots.py's bound for the
   kernels against the reference) and every stored state entry by entry within one rounding (:func:`state_apart`).
   Tokens per second of the kernel pool's forwards (decode and prompt tokens over the operator's time).
2. ``compiled``: ``torch.compile`` of a layer around the operator (in projection, the operator, out projection; dynamic
   in the row count) against the same layer eager, from the same stored state, over mixed forwards: outputs and
   states as in 1.
3. ``graph`` (after every configuration's other stages): one decode forward of every slot captured in one CUDA
   graph (``torch.cuda.CUDAGraph``) and replayed against the eager forward from the same stored state; a capture the
   step cannot take (a device-to-host read inside the pool's step) is recorded with its error.
4. ``decode``: the state step alone at B = ``--batch`` (every slot decoding, rows at staggered buffer positions so
   about one in dP flushes per step): the median time of a forward over ``--timed`` forwards (CUDA events), tokens
   per second; ``ratio_over_bf16``: that of bf16 over this configuration's time (the target: PACE-4 >= 2.5); where
   stage 3 captured, the same step captured in a CUDA graph and replayed (``graph_median_s``, as vLLM replays its
   decode forwards; every replay a step, each row flushing at its own count) and ``graph_ratio_over_bf16``.

5. ``profile`` (``--profile N``, CUDA): the state step's device time by kernel (``torch.profiler``), eager and as the
   graph's replays, N steps each: where a step's time goes, launch by launch.
6. ``ncu`` (``--ncu``, CUDA, Nsight Compute on the PATH): each kernel of one eager state step at B = ``--batch`` under
   ``ncu --clock-control none`` (:func:`kernels.bench.ncu_profile.run_ncu`): duration, DRAM bytes and bandwidth,
   occupancy, stalls. The harness runs itself under ncu with ``--ncu-child CONFIG`` (the setup of stage 4, the step
   twice to compile, then once inside the profiler's range); the raw page goes to ``ncu_<config>.csv``.

JSON (``harness.json``) and the log (``harness_log.txt``) under ``--out``; exit status 1 when a check fails. On a
CPU (``--device cpu``, Triton under ``TRITON_INTERPRET=1``) it runs at small sizes as its test
(tests/test_gpu_serving_harness.py); there the graph stage is skipped (no CUDA) and times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels.bench.ncu_profile import in_range, run_ncu, summarise  # noqa: E402
from kernels.chunk import AGREEMENT, runs_fla  # noqa: E402
from kernels.settings import FusedSettings, Launch, RecurrentSettings, SplitSettings  # noqa: E402
from pace_core import quant  # noqa: E402
from pace_core.checkpoint import checkpoint_tensors, with_tensors  # noqa: E402
from pace_core.config import get_config  # noqa: E402
from pace_core.pool import StatePool  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402
from pace_core.results import atomic_write  # noqa: E402

LIMIT = 1e-2
"""Relative Frobenius bound of the outputs, kernels against reference (tests/test_vllm_slots.py: their float32 rounding
may move a code by one step where a value lies at a rounding boundary; a row given another's state or flush point is
off by several 1e-2). The stored states are compared entry by entry (:func:`state_apart`)."""
POOLS: dict[int, StatePool] = {}
"""The pools the operator steps, by the id it is given (the plugin's operator finds its layer by name)."""


@torch.library.custom_op("pace_harness::state_step", mutates_args=("out",))
def state_step(pool: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
               initial: torch.Tensor, decodes: int, out: torch.Tensor) -> None:
    """The plugin's state step after the conv (:meth:`pace_core.vllm.layer.PaceGatedDeltaNetAttention.state_step`):
    rows ``[0, decodes)`` decode tokens of ``slots[:decodes]``; then prompt ``p`` is rows ``decodes + starts[p] ..
    decodes + starts[p + 1]`` of slot ``slots[decodes + p]``, continued where ``initial[p]``. ``q, k [T, H, K]``,
    ``v [T, HV, V]``, ``a, b [T, HV]`` projections; ``out [T, HV, V]`` written."""
    p = POOLS[pool]
    if decodes:
        p.decode_projected(slots[:decodes], q[:decodes], k[:decodes], v[:decodes], a[:decodes], b[:decodes], A_log,
                           dt_bias, out[:decodes])
    if slots.shape[0] > decodes:
        p.prefill_projected(slots[decodes:], starts, initial, q[decodes:], k[decodes:], v[decodes:], a[decodes:],
                            b[decodes:], A_log, dt_bias, out[decodes:])


@state_step.register_fake
def _(pool, q, k, v, a, b, A_log, dt_bias, slots, starts, initial, decodes, out) -> None:
    return None


class Layer(torch.nn.Module):
    """A GDN layer's state path around the operator: ``x [T, D]`` -> projections -> state step -> ``[T, D]``."""

    def __init__(self, dims: tuple[int, int, int, int], gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        H, HV, K, V = dims
        self.dims, self.split = dims, [H * K, H * K, HV * V, HV, HV]
        D = HV * V
        self.inp = torch.nn.Parameter((torch.randn(D, sum(self.split), generator=gen) / D**0.5).bfloat16().to(device))
        self.outp = torch.nn.Parameter((torch.randn(D, D, generator=gen) / D**0.5).bfloat16().to(device))
        self.A_log = (torch.rand(HV, generator=gen) - 2.0).bfloat16().to(device)
        self.dt_bias = torch.rand(HV, generator=gen).bfloat16().to(device)

    def forward(self, pool: int, x: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, initial: torch.Tensor,
                decodes: int) -> torch.Tensor:
        H, HV, K, V = self.dims
        q, k, v, a, b = (x @ self.inp).split(self.split, dim=-1)
        out = torch.empty(x.shape[0], HV, V, dtype=x.dtype, device=x.device)
        torch.ops.pace_harness.state_step(pool, q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)),
                                          v.unflatten(-1, (HV, V)), a, b, self.A_log, self.dt_bias, slots, starts,
                                          initial, decodes, out)
        return out.flatten(1) @ self.outp


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


def config(name: str, HV: int):
    cfg = get_config(name)
    if cfg.high_share:  # an export's 8-bit heads: every fourth value head, as the tests choose them
        cfg = cfg.replace(high_heads=(tuple(h for h in range(HV) if h % 4 == 1),))
    return cfg


def copy_state(src: StatePool, dst: StatePool) -> None:
    for name, t in src.tensors.items():
        dst.tensors[name].copy_(t)


def stored_parts(pool: StatePool, slots: torch.Tensor) -> list:
    """What ``pool`` stores for ``slots``: the checkpoint (a dense tensor, or a packed tensor per bit width), then at
    dP >= 2 the key and value records (packed or float) and their log decays."""
    def rows(x):  # packed records, or a tensor, at those slots
        return with_tensors(x, {n: t.index_select(0, slots) for n, t in checkpoint_tensors(x).items()})

    c = with_tensors(pool.template, {n: pool.tensors[n].index_select(0, slots) for n in pool.checkpoint_names})
    parts = [c] if isinstance(c, (torch.Tensor, quant.PackedTensor)) else [c.parts[b] for b in sorted(c.parts)]
    if pool.records is not None:
        parts += [rows(pool.records.stored("key")), rows(pool.records.stored("value")),
                  rows(pool.tensors["log_decays"])]
    return parts


def state_apart(a: StatePool, b: StatePool, slots: torch.Tensor, head_slack: float = 0.0) -> tuple[float, float]:
    """How far apart the two pools' stored states of ``slots`` are, in units of what rounding allows (1: at most one
    rounding apart), and the share of their packed entries that are equal. Packed codes (checkpoint and records):
    :func:`pace_core.quant.steps_apart` (float32 sums in another order may put a value on the other side of a rounding
    boundary: one step, rarely); float storage: the relative difference over its rounding (bfloat16 ``2^-8``; float32
    a first-order bound of dots of length K summed in another order, four per entry: tests/numerics.py's
    ``fp32_bound(4 K)``). ``head_slack``: the values themselves may differ by this share of their head's largest
    |value| (slots prefilled by fla's chunk: :data:`kernels.chunk.AGREEMENT`), which each entry's bound and the float
    bound add; a group's scale may then move and every entry with it, so equal entries are not counted (share 1)."""
    worst, equal, total = 0.0, 0, 0
    fp32 = 4 * a.dims[2] * 2.0**-24
    for got, ref in zip(stored_parts(a, slots), stored_parts(b, slots)):
        if isinstance(ref, torch.Tensor):
            bound = (2.0**-8 if ref.dtype == torch.bfloat16 else fp32) + head_slack
            worst = max(worst, rel(got.float(), ref.float()) / bound)
            continue
        slack = head_slack * quant.dequantize(ref).abs().amax((-2, -1), keepdim=True) if head_slack else 0.0
        apart = quant.steps_apart(got, ref, slack)
        worst = max(worst, float(apart.max()))
        if not head_slack:
            equal, total = equal + int((apart == 0).sum()), total + apart.numel()
    return worst, equal / total if total else 1.0


def forward_apart(a: StatePool, b: StatePool, slots: torch.Tensor, decodes: int) -> tuple[float, float]:
    """:func:`state_apart` of a forward's slots: its decode rows' (the step under test) within rounding, its prompts'
    with fla's agreement where fla's chunk ran them (:func:`kernels.chunk.runs_fla`: the reference pool's prefill is
    the float32 segment)."""
    slots = slots.long()
    apart = state_apart(a, b, slots[:decodes]) if decodes else (0.0, 1.0)
    if slots.shape[0] > decodes:
        slack = AGREEMENT if runs_fla(slots) else 0.0
        apart = worse(apart, state_apart(a, b, slots[decodes:], slack))
    return apart


def worse(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """The worse of two :func:`state_apart` results."""
    return max(a[0], b[0]), min(a[1], b[1])


def states_agree(apart: tuple[float, float]) -> bool:
    """:func:`state_apart`'s verdict: every entry within one rounding (the bound's own rounding: 1 %), > 98 % of the
    packed entries equal."""
    return apart[0] <= 1.01 and apart[1] > 0.98


class Scheduler:
    """Requests joining free slots, decoding and leaving (module docstring, stage 1), one forward at a time."""

    def __init__(self, slots: int, args: argparse.Namespace, gen: torch.Generator) -> None:
        self.free = list(range(slots))
        self.decoding: dict[int, int] = {}  # slot -> tokens left to decode
        self.prompting: dict[int, int] = {}  # slot -> prompt tokens left (a chunked prefill in progress)
        self.args, self.gen = args, gen

    def _draw(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def forward(self) -> tuple[list[int], list[tuple[int, int, bool]]]:
        """The next forward: decode slots, and prompts as ``(slot, tokens, continued)``."""
        a = self.args
        joining = min(len(self.free), self._draw(0, a.join))
        order = torch.randperm(len(self.free), generator=self.gen).tolist()
        for i in sorted(order[:joining], reverse=True):
            self.prompting[self.free.pop(i)] = -self._draw(1, a.prompt)  # negative: not started
        prompts = []
        for slot in list(self.prompting):
            left = self.prompting[slot]
            continued, left = left > 0, abs(left)
            take = min(left, a.chunk)
            prompts.append((slot, take, continued))
            if take == left:
                del self.prompting[slot]
                self.decoding[slot] = self._draw(a.min_out, a.max_out)
            else:
                self.prompting[slot] = left - take
        decodes = [s for s in self.decoding if not any(p[0] == s for p in prompts)]
        decodes = [decodes[i] for i in torch.randperm(len(decodes), generator=self.gen).tolist()]
        for slot in decodes:
            self.decoding[slot] -= 1
            if self.decoding[slot] == 0:
                del self.decoding[slot]
                self.free.append(slot)
        return decodes, prompts


def batch_inputs(decodes: list[int], prompts: list[tuple[int, int, bool]], device: torch.device):
    slots = torch.tensor(decodes + [p[0] for p in prompts], dtype=torch.int32, device=device)
    bounds = [0]
    for _, n, _ in prompts:
        bounds.append(bounds[-1] + n)
    starts = torch.tensor(bounds, dtype=torch.int32, device=device)
    initial = torch.tensor([p[2] for p in prompts], dtype=torch.bool, device=device)
    return slots, starts, initial, len(decodes) + bounds[-1]


def forwards(sched: Scheduler, n: int, gen: torch.Generator, D: int, device: torch.device):
    """The non-empty ones of ``n`` scheduled forwards: ``(decodes, prompts, slots, starts, initial, T, x)`` with
    the batch's inputs (:func:`batch_inputs`) and random bfloat16 hidden states ``x [T, D]``."""
    for _ in range(n):
        decodes, prompts = sched.forward()
        if decodes or prompts:
            slots, starts, initial, T = batch_inputs(decodes, prompts, device)
            x = (torch.randn(T, D, generator=gen) * 0.5).bfloat16().to(device)
            yield decodes, prompts, slots, starts, initial, T, x


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launch_of(args: argparse.Namespace) -> Launch:
    """The kernel pool's launch settings: ``--launch``, a JSON object of kernel families (``split``, ``fused``,
    ``recurrent``: :mod:`kernels.settings`) and their fields, the defaults for the others."""
    given = json.loads(args.launch)
    families = {"split": SplitSettings, "fused": FusedSettings, "recurrent": RecurrentSettings}
    return Launch(**{name: families[name](**fields) for name, fields in given.items()})


def decode_setup(cfg, pool: StatePool, layer: Layer, args: argparse.Namespace, gen: torch.Generator):
    """Stage 4's inputs: every slot of ``pool`` holding a sequence, its rows at staggered buffer positions (each count
    of the decode period), a decode forward's ``x`` and slot order, and ``step``, the state step alone on them:
    ``(x, slots, starts0, none, step)``."""
    H, HV, K, V = layer.dims
    device = layer.A_log.device
    D = HV * V
    period = cfg.decode_period if cfg.buffered else 1
    every = torch.arange(args.batch, dtype=torch.int32, device=device)
    for count in range(period):
        rows = every[every % period >= count] if count else every
        T = rows.shape[0]
        x = (torch.randn(T, D, generator=gen) * 0.5).bfloat16().to(device)
        layer(0, x, rows, torch.zeros(1, dtype=torch.int32, device=device),
              torch.zeros(0, dtype=torch.bool, device=device), T)
    slots = every[torch.randperm(args.batch, generator=gen).to(device)]
    starts0 = torch.zeros(1, dtype=torch.int32, device=device)
    none = torch.zeros(0, dtype=torch.bool, device=device)
    x = (torch.randn(args.batch, D, generator=gen) * 0.5).bfloat16().to(device)
    q, k, v, a, b = (x @ layer.inp).split(layer.split, dim=-1)
    q, k, v = q.unflatten(-1, (H, K)).contiguous(), k.unflatten(-1, (H, K)).contiguous(), v.unflatten(-1, (HV, V))
    v, a, b = v.contiguous(), a.contiguous(), b.contiguous()
    out = torch.empty(args.batch, HV, V, dtype=torch.bfloat16, device=device)

    def step() -> None:
        pool.decode_projected(slots, q, k, v, a, b, layer.A_log, layer.dt_bias, out)

    return x, slots, starts0, none, step


def run_config(name: str, args: argparse.Namespace, layer: Layer, compiled, log) -> tuple[dict, dict]:
    """Stages 1, 2 and 4 (module docstring) of configuration ``name`` with ``layer`` (and ``compiled``, its
    torch.compile, shared by the configurations: one compilation): its result, and what stage 3 needs."""
    H, HV, K, V = dims = layer.dims
    device = layer.A_log.device
    cfg = config(name, HV)
    gen = torch.Generator().manual_seed(1)
    pool = StatePool(cfg, dims, args.batch, device, backend="triton", launch=launch_of(args))
    ref = StatePool(cfg, dims, args.batch, device, backend="reference")
    POOLS.clear()
    POOLS.update({0: pool, 1: ref})
    result = {"config": name, "backend": pool.steps.name, "launch": json.loads(args.launch), "checks": {}}
    log(f"{name}: backend {pool.steps.name}, {args.batch} slots, H {H} HV {HV} K {K} V {V}")
    D = HV * V

    # 1. continuous batching against the reference
    sched, worst_o, worst_s, tokens, op_time, mixed = Scheduler(args.batch, args, gen), 0.0, (0.0, 1.0), 0, 0.0, 0
    for decodes, prompts, slots, starts, initial, T, x in forwards(sched, args.steps, gen, D, device):
        copy_state(pool, ref)
        sync(device)
        t0 = time.perf_counter()
        o = layer(0, x, slots, starts, initial, len(decodes))
        sync(device)
        op_time += time.perf_counter() - t0
        o_ref = layer(1, x, slots, starts, initial, len(decodes))
        worst_o = max(worst_o, rel(o.float(), o_ref.float()))
        worst_s = worse(worst_s, forward_apart(pool, ref, slots, len(decodes)))
        tokens += T
        mixed += bool(decodes) and bool(prompts)
    ok = worst_o <= LIMIT and states_agree(worst_s) and mixed > 0
    result["continuous"] = {"forwards": args.steps, "mixed_forwards": mixed, "tokens": tokens,
                            "output_rel_max": worst_o, "state_roundings_max": worst_s[0],
                            "state_equal_min": worst_s[1], "limit": LIMIT,
                            "prefill": "fla chunk" if runs_fla(layer.A_log) else "float32 segment",
                            "tokens_per_s_with_projections": tokens / op_time, "ok": ok}
    result["checks"]["continuous"] = ok
    log(f"  continuous: {mixed}/{args.steps} mixed forwards, {tokens} tokens, output rel {worst_o:.2e}, states "
        f"{worst_s[0]:.2f} roundings apart, {worst_s[1]:.2%} equal {'ok' if ok else 'FAILED'}")

    # 2. torch.compile of the layer around the operator against the eager layer
    if compiled is not None:
        try:
            worst_o, worst_s = 0.0, (0.0, 1.0)
            t0 = time.perf_counter()
            for decodes, _, slots, starts, initial, _, x in forwards(sched, args.compile_steps, gen, D, device):
                copy_state(pool, ref)
                o = compiled(0, x, slots, starts, initial, len(decodes))
                o_eager = layer(1, x, slots, starts, initial, len(decodes))
                worst_o = max(worst_o, rel(o.float(), o_eager.float()))
                worst_s = worse(worst_s, forward_apart(pool, ref, slots, len(decodes)))
            ok = worst_o <= LIMIT and states_agree(worst_s)
            result["compiled"] = {"forwards": args.compile_steps, "output_rel_max": worst_o,
                                  "state_roundings_max": worst_s[0], "state_equal_min": worst_s[1],
                                  "seconds": time.perf_counter() - t0, "ok": ok}
        except Exception as err:  # recorded: a stage the step does not support yet is a result
            ok = False
            result["compiled"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                                  "traceback": traceback.format_exc()[-4000:]}
        result["checks"]["compiled"] = ok
        log(f"  compiled: {json.dumps({k: v for k, v in result['compiled'].items() if k != 'traceback'})[:400]}")

    x, slots, starts0, none, step = decode_setup(cfg, pool, layer, args, gen)
    times = timed(step, device, args)
    median = statistics.median(times)
    result["decode"] = {"batch": args.batch, "forwards": args.timed, "median_s": median, "min_s": min(times),
                        "tokens_per_s": args.batch / median}
    log(f"  decode B={args.batch}: median {median * 1e3:.3f} ms, {args.batch / median:,.0f} tokens/s")
    return result, {"pool": pool, "ref": ref, "layer": layer, "x": x, "slots": slots, "starts0": starts0,
                    "none": none, "device": device, "step": step, "args": args}


def timed(fn, device: torch.device, args: argparse.Namespace) -> list[float]:
    """Seconds of each of ``args.timed`` calls of ``fn`` after ``args.warmup`` (CUDA events on a GPU)."""
    times = []
    for i in range(args.warmup + args.timed):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(elapsed)
    return times


def graph_stage(result: dict, ctx: dict, log) -> None:
    """Stage 3 (module docstring): one CUDA graph of a decode forward of every slot, replayed against the eager
    forward from the same stored state. Run after every configuration's other stages, so that a capture the step
    cannot take leaves nothing behind for them."""
    pool, ref, layer, x, slots, starts0, none, device = (ctx[k] for k in (
        "pool", "ref", "layer", "x", "slots", "starts0", "none", "device"))
    POOLS.clear()
    POOLS.update({0: pool, 1: ref})
    batch = slots.shape[0]
    copy_state(pool, ref)
    saved = {n: t.clone() for n, t in pool.tensors.items()}
    try:
        layer(0, x, slots, starts0, none, batch)  # eager first: kernels compiled, workspaces allocated
        for n, t in pool.tensors.items():
            t.copy_(saved[n])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph = layer(0, x, slots, starts0, none, batch)
        for n, t in pool.tensors.items():
            t.copy_(saved[n])
        graph.replay()
        sync(device)
        o_ref = layer(1, x, slots, starts0, none, batch)
        r_o, r_s = rel(o_graph.float(), o_ref.float()), state_apart(pool, ref, slots.long())
        ok = r_o <= LIMIT and states_agree(r_s)
        result["graph"] = {"captured": True, "output_rel": r_o, "state_roundings": r_s[0], "state_equal": r_s[1],
                           "ok": ok}
        step_graph = torch.cuda.CUDAGraph()  # stage 4's state step alone, replayed as vLLM replays a decode
        with torch.cuda.graph(step_graph):
            ctx["step"]()
        times = timed(step_graph.replay, device, ctx["args"])
        result["decode"]["graph_median_s"] = statistics.median(times)
        if ctx["args"].profile:
            result["profile"] = {"eager": kernel_table(ctx["step"], ctx["args"].profile),
                                 "graph": kernel_table(step_graph.replay, ctx["args"].profile)}
            log("  " + profile_text(result["profile"]))
    except Exception as err:
        ok = False
        result["graph"] = {"captured": False, "error": f"{type(err).__name__}: {err}"[:2000],
                           "traceback": traceback.format_exc()[-4000:], "ok": False}
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as sticky:  # a capture's error the context keeps: later stages would fail with it
            result["graph"]["after"] = f"{type(sticky).__name__}: {sticky}"[:1000]
    for n, t in pool.tensors.items():
        t.copy_(saved[n])
    result["checks"]["graph"] = ok
    log(f"  graph: {json.dumps({k: v for k, v in result['graph'].items() if k != 'traceback'})[:400]}")


def kernel_table(fn, n: int) -> dict:
    """Stage 5: the device time of one call of ``fn`` (a state step, eager or a graph's replay) by kernel over ``n``
    calls (``torch.profiler``, CUDA activity): ``{"device_us": per call, "kernels": [{kernel, calls, us}, ...]}``,
    the longest first."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:160], "calls": e.count / n, "us": e.self_device_time_total / n}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r["us"])
    return {"device_us": sum(r["us"] for r in rows), "kernels": rows}


def profile_text(profile: dict) -> str:
    """Stage 5's figures in a few lines of the log."""
    lines = []
    for how, table in profile.items():
        lines.append(f"profile {how}: {table['device_us']:.1f} us of kernels per step, "
                     f"{sum(r['calls'] for r in table['kernels']):.0f} launches")
        lines += [f"    {r['us']:8.2f} us x{r['calls']:.0f} {r['kernel'][:90]}" for r in table["kernels"]]
    return "\n  ".join(lines)


def ncu_stage(name: str, args: argparse.Namespace, log) -> dict:
    """Stage 6 (module docstring) of configuration ``name``: ncu's figures of each kernel of one state step."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"ok": False, "error": "Nsight Compute (ncu) is not on the PATH"}
    child = [sys.executable, __file__, "--out", str(args.out), "--ncu-child", name, "--device", args.device,
             "--batch", str(args.batch), "--heads", str(args.heads), "--v-heads", str(args.v_heads),
             "--dim", str(args.dim), "--launch", args.launch]
    try:
        done, rows = run_ncu(ncu, child, args.ncu_timeout)
    except (subprocess.SubprocessError, OSError) as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    (args.out / f"ncu_{name}.csv").write_text(done.stdout + "\n# stderr\n" + done.stderr[-4000:])
    if done.returncode or not rows:
        return {"ok": False, "error": f"ncu rc {done.returncode}: {(done.stdout + done.stderr)[-600:]}"}
    kernels = [summarise(row) for row in rows]
    for k in kernels:
        log(f"  ncu {k['kernel'][:40]:40s} {k['seconds'] * 1e6:8.2f} us {(k['dram_bytes_per_second'] or 0) / 1e12:5.2f}"
            f" TB/s ({k['dram_pct_of_peak'] or 0:4.1f}% peak) occ {k['achieved_occupancy_pct'] or 0:4.1f}% stalls "
            + ", ".join(f"{s} {v:.1f}" for s, v in k["top_stalls"]))
    return {"ok": True, "kernels": kernels, "seconds": sum(k["seconds"] for k in kernels),
            "dram_bytes": sum(k["dram_bytes"] for k in kernels)}


def ncu_child(name: str, args: argparse.Namespace) -> None:
    """What ncu profiles for stage 6: stage 4's setup, the step twice (kernels compiled), once in the profiler's
    range."""
    device = torch.device(args.device)
    layer = Layer((args.heads, args.v_heads, args.dim, args.dim), torch.Generator().manual_seed(0), device)
    cfg = config(name, args.v_heads)
    pool = StatePool(cfg, layer.dims, args.batch, device, backend="triton", launch=launch_of(args))
    POOLS.clear()
    POOLS[0] = pool
    step = decode_setup(cfg, pool, layer, args, torch.Generator().manual_seed(1))[-1]
    for profiled in (False, False, True):
        in_range(step, profiled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=["bf16", "pace-4", "pace-4-8"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=128, help="slots of the pool, and the timed decode batch")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--v-heads", dest="v_heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48, help="continuous-batching forwards checked")
    parser.add_argument("--compile-steps", dest="compile_steps", type=int, default=8)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--join", type=int, default=6, help="most requests joining per forward")
    parser.add_argument("--prompt", type=int, default=300, help="longest prompt")
    parser.add_argument("--chunk", type=int, default=128, help="longest part of a prompt per forward")
    parser.add_argument("--min-out", dest="min_out", type=int, default=4)
    parser.add_argument("--max-out", dest="max_out", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timed", type=int, default=50)
    parser.add_argument("--profile", type=int, default=0, help="stage 5: steps profiled by kernel (0: none)")
    parser.add_argument("--ncu", action="store_true", help="stage 6: each kernel of a step under Nsight Compute")
    parser.add_argument("--ncu-timeout", dest="ncu_timeout", type=float, default=240.0)
    parser.add_argument("--launch", default="{}",
                        help='the kernels\' launch settings, e.g. \'{"split": {"flush_columns": 32}}\' (launch_of)')
    parser.add_argument("--ncu-child", dest="ncu_child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)  # serving: no autograd around the operator or the projections
    if args.ncu_child:
        ncu_child(args.ncu_child, args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (args.out / "harness_log.txt").write_text("\n".join(lines) + "\n")

    started = time.perf_counter()
    results = []
    layer = Layer((args.heads, args.v_heads, args.dim, args.dim), torch.Generator().manual_seed(0), device)
    compiled = torch.compile(layer, dynamic=True) if args.compile else None
    graphs = []
    for name in args.configs:
        try:
            result, ctx = run_config(name, args, layer, compiled, log)
            results.append(result)
            graphs.append((result, ctx))
        except Exception as err:
            log(f"{name}: FAILED {type(err).__name__}: {err}")
            results.append({"config": name, "checks": {"ran": False}, "error": f"{type(err).__name__}: {err}"[:2000],
                            "traceback": traceback.format_exc()[-4000:]})
    if device.type == "cuda":
        for result, ctx in graphs:
            log(f"{result['config']}:")
            graph_stage(result, ctx, log)
    if device.type == "cuda" and args.ncu:
        for r in results:
            if "decode" in r:
                log(f"{r['config']}: ncu")
                r["ncu"] = ncu_stage(r["config"], args, log)
    base = next((r for r in results if r["config"] == "bf16" and "decode" in r), None)
    for r in results:
        if base is not None and "decode" in r:
            d, b = r["decode"], base["decode"]
            d["ratio_over_bf16"] = b["median_s"] / d["median_s"]
            line = f"{r['config']}: state step {d['ratio_over_bf16']:.2f}x bf16's at B={args.batch} (eager)"
            if "graph_median_s" in d and "graph_median_s" in b:
                d["graph_ratio_over_bf16"] = b["graph_median_s"] / d["graph_median_s"]
                line += f", {d['graph_ratio_over_bf16']:.2f}x in CUDA graphs ({d['graph_median_s'] * 1e6:.0f} us)"
            log(line)
    doc = {"kind": "gpu-serving-harness", "device": str(device), "args": {k: str(v) for k, v in vars(args).items()},
           "limit": LIMIT, "results": results, "wall_s": time.perf_counter() - started,
           "provenance": {**measurement(), "triton_interpret": os.environ.get("TRITON_INTERPRET")}}
    atomic_write(args.out / "harness.json", lambda path: path.write_text(json.dumps(doc, indent=1) + "\n"))
    failed = [f"{r['config']}.{k}" for r in results for k, ok in r["checks"].items() if not ok]
    log(f"checks failed: {', '.join(failed)}" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
