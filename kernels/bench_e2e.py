"""End-to-end time per output token (issue 5): a random-initialised Qwen3.5-4B-sized model in bf16 on
the GPU, per-token bf16 state against PACE-4, the same harness for both.

The model is ``Qwen3_5ForCausalLM`` built from the published Qwen/Qwen3.5-4B text config
(:data:`pace_core.shapes.PUBLISHED_CONFIGS`: 32 layers, 24 GDN layers of 16 key / 32 value heads of
128 x 128, 8 attention layers, hidden 2560, vocab 248,320) with random weights (they do not matter
for time). Variants, both through :func:`pace_core.model.patch.apply_pace` and
:class:`pace_core.state_store.StateStore`:

- ``bf16 per-token``: the named config ``bf16`` (dense bf16 state, read and written every token by
  :func:`kernels.decode_step.dense_recurrent_step`);
- ``PACE-4 dP=8``: the named config ``pace-4`` (4-bit key-axis checkpoint, int8 buffer, the split
  step + flush kernels).

Per batch: random prompt ids ``[B, context]``, one prefill, ``WARMUP`` untimed decode steps (two
periods: every specialisation of the kernels, e.g. for 0, 1 and more buffered records, and the
flush, is compiled before timing), then
``--tokens`` decode steps (a multiple of dP, so the flushes are counted in proportion), each the
whole model with the greedy next token fed back, timed one by one with CUDA events. TPOT = the mean
over the timed steps (the median is kept too). No CUDA graphs for either variant: PACE's decode
keeps host-side control (the buffer's record count, a flush every dP) and transformers' dynamic
cache grows, so neither path can be captured as it is. Both pay Python and launch overhead per
layer and one device sync per GDN layer and token (the input finiteness check of
:mod:`pace_core.state_store`'s kernel path), which dominate at small batch; PACE-4 launches one more
kernel every dP tokens (the flush). ``--profile`` therefore also reports, per row, the GPU's busy time
per token (the sum of the durations of the kernels of one profiled period of dP steps): the time a
step would take without the host's overhead, e.g. under CUDA graphs, which this harness does not
build (it would need a static attention cache and one graph per buffer position).

Usage (on the GPU machine): ``python3 kernels/bench_e2e.py --out DIR``; writes ``DIR/bench_e2e.json``
and ``DIR/bench_e2e.png`` and prints a table. ``--tiny --device cpu`` runs a small model on a CPU
(a smoke run of the harness; the tests use it).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pace_core.config import get_config  # noqa: E402
from pace_core.model.patch import pace  # noqa: E402
from pace_core.shapes import PUBLISHED_CONFIGS  # noqa: E402

VARIANTS = {"bf16 per-token": "bf16", "PACE-4 dP=8": "pace-4"}
WARMUP = 16  # untimed decode steps: two periods of dP = 8
BATCHES = (1, 8, 16, 32, 64, 128)
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "full_attention_interval": 4,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 32, "tie_word_embeddings": True}


def model_config(tiny: bool):
    """The ``Qwen3_5TextConfig`` of the published Qwen/Qwen3.5-4B text model, or a small one (``tiny``)."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    fields = TINY if tiny else {k: v for k, v in PUBLISHED_CONFIGS["qwen3.5-4b"].items()
                                if k not in ("model_type", "dtype")}
    return Qwen3_5TextConfig(**fields)


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype):
    """A random-initialised model of :func:`model_config` in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(tiny), dtype=dtype).to(device).eval()


class _Clock:
    """Seconds of one step: CUDA events on a GPU, ``perf_counter`` after a sync elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


@torch.no_grad()
def time_decode(model, config_name: str, batch: int, context: int, tokens: int, device: torch.device,
                profiler=None) -> dict:
    """Prefill ``[batch, context]`` random ids under ``config_name``, then time ``tokens`` decode steps
    (``profiler``, a ``torch.profiler.profile``, records the timed steps only)."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    with pace(model, get_config(config_name)):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for step in range(WARMUP + tokens):
            if step == WARMUP and profiler is not None:
                profiler.start()
            with _Clock(device) as clock:
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            if step >= WARMUP:
                times.append(clock.seconds)
        if profiler is not None:
            profiler.stop()
        finite = bool(torch.isfinite(out.logits).all())
    return {"tpot_mean_s": statistics.fmean(times), "tpot_median_s": statistics.median(times),
            "spread": (min(times), max(times)), "tokens": tokens, "outputs_finite": finite}


def profile_decode(model, config_name: str, batch: int, context: int, device: torch.device) -> tuple[dict, str]:
    """One period of decode steps (dP = 8, after the prefill and warm-up of :func:`time_decode`) under
    ``torch.profiler``. Returns the row's fields (per token: on a GPU its busy time, the sum of its
    kernels' durations, i.e. what a step would take with no host overhead, e.g. under a CUDA graph,
    and that time's share of the wall time; kernel launches and aten calls, host-side counts; the
    profiled wall time) and the table of operators by self CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    tokens = 8
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    row = time_decode(model, config_name, batch, context, tokens, device, profiler=prof)
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    out = {"profiled_tpot_s": row["tpot_mean_s"], "launches_per_step": launches / tokens,
           "aten_calls_per_step": ops / tokens}
    if device.type == "cuda":
        out["gpu_busy_time_per_token_s"] = busy_us / 1e6 / tokens
        out["gpu_busy_fraction"] = out["gpu_busy_time_per_token_s"] / row["tpot_mean_s"]
    return out, table


def plot(results: dict, path: Path) -> None:
    """TPOT against batch for both variants as a PNG (skipped, with a note, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print(f"bench_e2e: matplotlib is not installed, so no {path.name}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for variant in VARIANTS:
        rows = [r for r in results["rows"] if r["variant"] == variant and "tpot_mean_s" in r]
        line, = ax.plot([r["batch"] for r in rows], [r["tpot_mean_s"] * 1e3 for r in rows], marker="o", label=variant)
        busy = [r for r in rows if r.get("gpu_busy_time_per_token_s")]
        if busy:
            ax.plot([r["batch"] for r in busy], [r["gpu_busy_time_per_token_s"] * 1e3 for r in busy],
                    marker="s", ls="--", color=line.get_color(), label=f"{variant}: GPU busy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("time per output token, ms")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{results['model']} (random weights, bf16) on {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode (default 512)")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps, a multiple of dP = 8 (default 32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke run, e.g. on a CPU)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one period of each row (tables in profile.txt; in the rows the GPU's busy "
                         "time per token and the host-side counts): where the time per token goes")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device; run this on the GPU machine (or --tiny --device cpu)", file=sys.stderr)
        return 2
    if args.tokens < 8 or args.tokens % 8:
        print(f"bench_e2e: --tokens {args.tokens} not allowed; allowed: a positive multiple of 8 (dP)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype)
    import transformers

    results = {"model": "tiny Qwen3.5" if args.tiny else "Qwen3.5-4B-sized", "device": str(
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()), "context": args.context, "rows": []}
    print(f"{results['model']} ({results['parameters'] / 1e9:.2f}B parameters, {results['dtype']}) on "
          f"{results['device']}, context {args.context}, {args.tokens} timed tokens", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for batch in (int(b) for b in args.batches.split(",")):
        for variant, config_name in VARIANTS.items():
            row = {"variant": variant, "config": config_name, "batch": batch}
            try:
                row.update(time_decode(model, config_name, batch, args.context, args.tokens, device))
                print(f"B={batch:4d} {variant:16s} TPOT {row['tpot_mean_s'] * 1e3:8.2f} ms (median "
                      f"{row['tpot_median_s'] * 1e3:.2f}) finite={row['outputs_finite']}", flush=True)
            except torch.cuda.OutOfMemoryError as err:
                row["error"] = f"out of memory: {err}".splitlines()[0]
                print(f"B={batch:4d} {variant:16s} {row['error']}", flush=True)
                torch.cuda.empty_cache()
            results["rows"].append(row)
        (args.out / "bench_e2e.json").write_text(json.dumps(results, indent=1))  # partial results survive
    if args.profile:
        tables = []
        for row in (r for r in results["rows"] if "tpot_mean_s" in r):
            counts, table = profile_decode(model, row["config"], row["batch"], args.context, device)
            row.update(counts)
            tables.append(f"=== {row['variant']}, batch {row['batch']}: {counts}\n{table}\n")
            busy = counts.get("gpu_busy_time_per_token_s")
            print(f"profile B={row['batch']:4d} {row['variant']:16s} {counts['launches_per_step']:.0f} kernel "
                  f"launches and {counts['aten_calls_per_step']:.0f} aten calls per step"
                  + (f", GPU busy {busy * 1e3:.2f} ms per token" if busy is not None else ""), flush=True)
            (args.out / "bench_e2e.json").write_text(json.dumps(results, indent=1))
        (args.out / "profile.txt").write_text("".join(tables))
    by = {(r["variant"], r["batch"]): r for r in results["rows"]}
    for r in results["rows"]:
        base = by[("bf16 per-token", r["batch"])]
        if "tpot_mean_s" in r and "tpot_mean_s" in base:
            r["speedup_vs_bf16_per_token"] = base["tpot_mean_s"] / r["tpot_mean_s"]
    (args.out / "bench_e2e.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "bench_e2e.png")
    print(f"\n{'batch':>5} " + " ".join(f"{v:>18}" for v in VARIANTS) + f" {'PACE-4 vs bf16':>15}"
          + (" GPU busy per token: " + " / ".join(VARIANTS) if args.profile else ""))
    for batch in sorted({r["batch"] for r in results["rows"]}):
        cells = [by[(v, batch)].get("tpot_mean_s") for v in VARIANTS]
        speed = by[("PACE-4 dP=8", batch)].get("speedup_vs_bf16_per_token")
        busy = [by[(v, batch)].get("gpu_busy_time_per_token_s") for v in VARIANTS]
        print(f"{batch:5d} " + " ".join(f"{'OOM' if c is None else f'{c * 1e3:.2f} ms':>18}" for c in cells)
              + (f" {speed:14.2f}x" if speed else "")
              + (" " + " / ".join(f"{b * 1e3:.2f} ms" for b in busy) if all(busy) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
