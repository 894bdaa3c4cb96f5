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
configurations (:func:`configs`, the same number for the baselines) and reports its fastest. The state does not depend on the context
length (512 tokens in the issue), so none is built.

Bytes per token: see ``BYTES_MODEL``. Achieved bandwidth over the device-to-device copy bandwidth
measured in the same run (bytes read + written) gives the fraction of HBM bandwidth.

Usage (on the GPU machine): ``python3 kernels/bench/bench.py --out DIR``; writes ``DIR/bench.json`` and
``DIR/bench.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.backend import TritonSteps  # noqa: E402
from kernels.flush import launch_flush  # noqa: E402
from kernels.packed_step import launch_dots, launch_packed_step, launch_records  # noqa: E402
from kernels.recurrent_step import dense_recurrent_step  # noqa: E402
from pace_core.buffer import record_bytes  # noqa: E402
from pace_core.checkpoint import state_format  # noqa: E402
from pace_core.config import get_config  # noqa: E402
from pace_core.recurrence import prepare_qk  # noqa: E402
from pace_core.schedule import PeriodicState  # noqa: E402

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


def configs(variant: str) -> list[dict]:
    """Launch configurations tried for ``variant`` (the fastest is reported; all are kept in the JSON):
    per-token kernels: columns per program and warps; the fused buffered kernel: rows per tile and
    warps; the split path: warps of the step and flush kernels and columns per flush program."""
    if variant == FLA:
        return [{}]  # fla picks its own launch configuration
    if variant.endswith("per-token") or variant == DP1:
        return [{"block_v": 32, "num_warps": 4}, {"block_v": 64, "num_warps": 4}, {"block_v": 64, "num_warps": 8}]
    if variant in SPLIT_VARIANTS:  # each kernel's options side by side; time_variant also combines the best
        step = [(True, 4), (True, 8), (False, 4), (False, 4), (True, 2)]
        dots = [(128, 4), (64, 4), (128, 8), (32, 2), (128, 2)]
        records = [1, 1, 2, 4, 1]
        flush = [(4, 128), (1, 32), (2, 64), (4, 64), (4, 128)]
        parts = [(False, True), (True, False), (False, False), (True, True), (False, True)]  # dots, flush per part
        gluon = [(True, True, True), (True, False, False), (False, False, False), (True, False, True),
                 (False, False, False)]  # Gluon dots, flush, step
        return [{"fused_step": fs, "step_warps": sw, "dots_columns": dc, "dots_warps": dw, "record_warps": rw,
                 "flush_warps": fw, "flush_columns": fc, "dots_per_part": dp, "per_part": fp, "gluon_dots": gd,
                 "gluon_flush": gf, "gluon_step": gs}
                for (fs, sw), (dc, dw), rw, (fw, fc), (dp, fp), (gd, gf, gs) in zip(step, dots, records, flush, parts,
                                                                                    gluon)]
    return [{"BK": 64, "num_warps": 4}, {"BK": 64, "num_warps": 8}, {"BK": 128, "num_warps": 8}]


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


def run_period(layers: list, config: dict) -> None:
    """dP tokens over all layers with one launch configuration."""
    for _ in range(PERIOD):
        for kind, state, (q, k, v, g, beta), out in layers:
            if kind == "dense":
                dense_recurrent_step(state, q, k, v, g, beta, out=out, **config)
            elif kind == "fla":  # a new fp32 state each token, as transformers keeps it
                o, state[0] = fla_recurrent(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state[0],
                                            output_final_state=True)  # q prepared: already scaled
                out.copy_(o[:, 0])
            else:
                if state.steps.launch != config:
                    state.steps = TritonSteps(config)
                if state.buffer is None:  # dP = 1: the schedule's per-token run, its output copied
                    out.copy_(state.decode(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])[:, 0])
                else:  # the schedule's token (the flush after the one that fills the buffer) into the layer's output
                    state.steps.step(state, q, k, v, g, beta, flush=state.fills_buffer(1), out=out)


def time_graph(work, reps: int) -> list[float]:
    """Seconds of each of ``reps`` CUDA-graph replays of ``work()`` (captured after a warm-up run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del graph
    return times


def time_config(layers: list, config: dict, reps: int) -> list[float]:
    """Seconds per token of ``reps`` CUDA-graph replays of one period."""
    return [t / PERIOD for t in time_graph(lambda: run_period(layers, config), reps)]


def fill_buffers(layers: list, n: int) -> None:
    """Each buffered layer's buffer holds ``n`` records (of its own inputs), the ones before dropped."""
    for _, st, (_, k, v, g, _), _ in layers:
        st.buffer.clear()
        for _ in range(n):
            st.buffer.append(k, v * 0.1, g)


def split_breakdown(layers: list, config: dict, reps: int) -> dict:
    """The split path's kernels timed alone over all layers (median seconds): the one-kernel step, the
    dots kernel and the record kernel with dP / 2 records buffered (the token's record written into
    the free slot, not counted), and the flush kernel with dP records. The one-kernel step is None
    where the heads are too narrow for it (``plan.meta["fusable"]``)."""
    # one launch plan per layer and setting, made before any capture (a plan reads the head map off the GPU)
    tuned = [TritonSteps(config).plan(st) for _, st, _, _ in layers]
    fused = [TritonSteps({**config, "fused_step": True}).plan(st) for _, st, _, _ in layers]

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

    fill_buffers(layers, PERIOD // 2)
    fusable = all(plan.meta["fusable"] for plan in tuned)
    out = {"step_seconds": statistics.median(time_graph(step, reps)) if fusable else None,
           "dots_seconds": statistics.median(time_graph(dots, reps)),
           "records_seconds": statistics.median(time_graph(records, reps))}
    fill_buffers(layers, PERIOD)
    out["flush_seconds"] = statistics.median(time_graph(flushes, reps))
    fill_buffers(layers, 0)
    return {**out, "records_at_step": PERIOD // 2}


SPLIT_KERNEL_KEYS = {"step_seconds": ("step_warps", "gluon_step"),
                     "dots_seconds": ("dots_columns", "dots_warps", "dots_per_part", "gluon_dots"),
                     "records_seconds": ("record_warps",),
                     "flush_seconds": ("flush_warps", "flush_columns", "per_part", "gluon_flush")}


def best_split_combination(tried: list[dict]) -> dict:
    """The split path's launch settings with each kernel's own fastest options (every kernel is timed
    alone in every configuration tried, :func:`split_breakdown`), and the step as one kernel where
    the fastest one-kernel step beats the fastest dots and record kernels together."""
    config, fastest = {}, {}
    for seconds, keys in SPLIT_KERNEL_KEYS.items():
        timed = [r for r in tried if r["split_breakdown"][seconds] is not None]
        best = min(timed, key=lambda r: r["split_breakdown"][seconds]) if timed else tried[0]
        config.update({key: best["config"][key] for key in keys})
        fastest[seconds] = best["split_breakdown"][seconds]
    step = fastest["step_seconds"]
    config["fused_step"] = step is not None and step < fastest["dots_seconds"] + fastest["records_seconds"]
    return config


def time_variant(variant: str, B: int, device: torch.device, reps: int) -> dict:
    layers, nbytes = build(variant, B, device)
    tried = []
    for config in configs(variant):
        times = time_config(layers, config, reps)
        tried.append({"config": config, "seconds_per_token": statistics.median(times),
                      "spread": (min(times), max(times)),
                      "split_breakdown": split_breakdown(layers, config, reps) if variant in SPLIT_VARIANTS else None})
    if variant in SPLIT_VARIANTS:
        config = best_split_combination(tried)
        if all(r["config"] != config for r in tried):
            times = time_config(layers, config, reps)
            tried.append({"config": config, "seconds_per_token": statistics.median(times),
                          "spread": (min(times), max(times)), "split_breakdown": split_breakdown(layers, config, reps)})
    finite = all(bool(torch.isfinite(out).all()) for _, _, _, out in layers)
    best = min(tried, key=lambda r: r["seconds_per_token"])
    breakdown = best["split_breakdown"]
    del layers
    torch.cuda.empty_cache()
    t = best["seconds_per_token"]
    return {"variant": variant, "batch": B, "seconds_per_token": t, "spread": best["spread"],
            "config": best["config"], "tried": tried, "bytes_per_token": nbytes,
            "bytes_per_second": nbytes / t, "outputs_finite": finite, "split_breakdown": breakdown}


GLUON = ("gluon_dots", "gluon_flush", "gluon_step")


def _triton_only(row: dict) -> float:
    """The fastest time per token of a row's configurations that turn every Gluon kernel off."""
    return min(t["seconds_per_token"] for t in row["tried"] if not any(t["config"].get(g) for g in GLUON))


def vs_pace4(three: dict, four: dict) -> dict:
    """PACE-3's row against PACE-4's at one batch (same card, same run): the ratio of their fastest times, of the
    fastest on the Triton kernels alone (PACE-3 has no Gluon kernel, kernels.plan: every one of its configurations
    runs the Triton kernels; PACE-4's with the Gluon ones off: the same kernels, 3-bit against 4-bit codes) and of
    the bytes moved per token (``BYTES_MODEL``)."""
    return {"time_ratio": three["seconds_per_token"] / four["seconds_per_token"],
            "triton_time_ratio": three["seconds_per_token"] / _triton_only(four),
            "bytes_ratio": three["bytes_per_token"] / four["bytes_per_token"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in results["variants"]:
        rows = [r for r in results["rows"] if r["variant"] == variant]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of: " + ", ".join(VARIANTS) + " (default: all available)")
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS) if args.variants else set()
    if unknown:
        print(f"bench: --variants {', '.join(sorted(unknown))} not known; allowed: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench: no CUDA device; this benchmark runs on the GPU machine only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    bw = copy_bandwidth(device)
    chosen = args.variants.split(",") if args.variants else VARIANTS
    variants = [v for v in available_variants() if v in chosen or v == "bf16 per-token"]  # the speed-up's base
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": triton.__version__, "python": platform.python_version(),
               "fla": _fla_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "shape": {"gdn_layers": LAYERS, "key_heads": H, "value_heads": HV, "d_k": K, "d_v": V,
                         "decode_period": PERIOD},
               "copy_bandwidth": bw, "bytes_model": BYTES_MODEL, "variants": variants, "rows": []}
    print(f"device {results['device']}  copy bandwidth {bw / 1e12:.3f} TB/s (read + write)  fla {results['fla']}",
          flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        for variant in variants:
            row = time_variant(variant, B, device, args.reps)
            row["hbm_fraction"] = row["bytes_per_second"] / bw
            results["rows"].append(row)
            split = row["split_breakdown"]
            step = "-" if split is None or split["step_seconds"] is None else f"{split['step_seconds'] * 1e6:.1f}"
            parts = "" if split is None else (f" step {step} us, dots "
                                              f"{split['dots_seconds'] * 1e6:.1f} us, records "
                                              f"{split['records_seconds'] * 1e6:.1f} us, flush "
                                              f"{split['flush_seconds'] * 1e6:.1f} us")
            print(f"B={B:4d} {variant:20s} {row['seconds_per_token'] * 1e6:9.1f} us/token "
                  f"{row['bytes_per_token'] / 1e6:9.2f} MB {row['hbm_fraction'] * 100:5.1f}% HBM {row['config']} "
                  f"finite={row['outputs_finite']}{parts}", flush=True)
        (args.out / "bench.json").write_text(json.dumps(results, indent=1))  # partial results survive a timeout
    by = {(r["variant"], r["batch"]): r for r in results["rows"]}
    batches = sorted({r["batch"] for r in results["rows"]})
    for B in batches:
        base = by[("bf16 per-token", B)]["seconds_per_token"]
        for variant in variants:
            by[(variant, B)]["speedup_vs_bf16_per_token"] = base / by[(variant, B)]["seconds_per_token"]
        if (PACE3, B) in by and ("PACE-4 dP=8", B) in by:  # 3 bits against 4 on the same card, same run
            three, four = by[(PACE3, B)], by[("PACE-4 dP=8", B)]
            three["vs_pace4"] = vs_pace4(three, four)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "bench.png")
    header = f"{'batch':>5} " + " ".join(f"{v:>20}" for v in variants) + f" {'PACE-4 vs bf16':>15}"
    print("\nµs per token (24 GDN layers) [% of HBM copy bandwidth]")
    print(header)
    for B in batches:
        cells = " ".join(f"{by[(v, B)]['seconds_per_token'] * 1e6:11.1f} [{by[(v, B)]['hbm_fraction'] * 100:4.0f}%]"
                         for v in variants)
        speed = by.get(("PACE-4 dP=8", B), {}).get("speedup_vs_bf16_per_token")
        print(f"{B:5d} {cells} " + (f"{speed:14.2f}x" if speed else f"{'-':>15}"))
    three = [(B, by[(PACE3, B)]["vs_pace4"]) for B in batches if "vs_pace4" in by.get((PACE3, B), {})]
    if three:
        print("\nPACE-3 against PACE-4 (time with each one's fastest kernels, time on the Triton kernels alone, bytes "
              "per token): " + ", ".join(f"B={B} {r['time_ratio']:.2f}x / {r['triton_time_ratio']:.2f}x / "
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
