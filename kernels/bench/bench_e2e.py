"""End-to-end time per output token (issue 5): a random-initialised Qwen3.5-4B-sized model in bf16 on
the GPU, per-token bf16 state against PACE-4, the same harness for both.

The model is ``Qwen3_5ForCausalLM`` built from the published Qwen/Qwen3.5-4B text config
(:data:`pace_core.shapes.PUBLISHED_CONFIGS`: 32 layers, 24 GDN layers of 16 key / 32 value heads of
128 x 128, 8 attention layers, hidden 2560, vocab 248,320) with random weights (they do not matter
for time). Variants, both through :func:`pace_core.model.patch.apply_pace` and
:class:`pace_core.state_store.StateStore`:

- ``bf16 per-token``: the named config ``bf16`` (dense bf16 state, read and written every token by
  :func:`kernels.recurrent_step.dense_recurrent_step`);
- ``PACE-4 dP=8``: the named config ``pace-4`` (4-bit key-axis checkpoint, int8 buffer, the split
  step + flush kernels).

Per batch: random prompt ids ``[B, context]`` and one prefill into transformers' ``StaticCache``
(fixed-address attention keys / values and conv states, for both variants), ``WARMUP`` untimed eager
decode steps (two periods: every specialisation of the kernels, e.g. for 0, 1 and more buffered
records, and the flush, is compiled before timing), then ``--tokens`` decode steps (a multiple of
dP, so the flushes are counted in proportion), each the whole model with the greedy next token fed
back on the GPU, timed one by one with CUDA events. TPOT = the mean over the timed steps (the median
is kept too; for PACE-4 it leaves out the flush, one step in dP). The static cache has the same
length for both variants (:func:`cache_length`). The attention layers decode with :func:`gqa_decode_attention` (no
repeat of the
key / value heads over the static length), for both variants alike.

**CUDA graphs** (the default on a GPU; ``--eager`` turns them off): PACE's decode keeps host-side
control (the buffer's record count picks the kernels' arguments; a flush every dP), so each variant
is captured as one graph per buffer position (dP graphs for PACE-4, one for per-token bf16), in
order on one memory pool, and the timed steps replay them in turn. Under capture the state store
skips its per-token input finiteness check (a device sync); each row checks its logits instead.
Before timing, one period is run eagerly, the whole decoding state is put back and the period is
replayed from the graphs; the row records the logit, token and state differences
(:func:`_check_graphs`). Eager steps (``--eager``, and always on a CPU) pay Python and launch
overhead per layer, which dominates at every batch. ``--profile`` also profiles one eager period per
row: the GPU's busy time per token (the sum of the kernels' durations) and the table of operators by
GPU time, i.e. where a graph's step spends its time, plus the store's finiteness check that eager
steps run and graphs skip (about 0.3 ms per token at B = 128).

**torch.compile** (``--compile``): the same steps through ``torch.compile(model, fullgraph=True,
dynamic=False)`` (inductor by default, ``--compile-backend``), each GDN layer's state one
``pace::gdn_state`` node of the graph (:mod:`pace_core.model.state_op`, for both variants alike), the
prompt eager; the CUDA graphs are captured per buffer position around the compiled step as above (the
compiler's own CUDA graphs, ``mode="reduce-overhead"``, would freeze the state's host-side schedule).
Rows then record ``compile_s`` (the first compiled step) and the JSON / PNG are
``bench_e2e_compiled.*``. With ``--profile`` every row also records ``state_share``: the share of the
GPU's busy time in the state's kernels (the Triton kernels of ``kernels/``, :func:`state_kernel_names`).

Usage (on the GPU machine): ``python3 kernels/bench/bench_e2e.py --out DIR``; writes ``DIR/bench_e2e.json``
and ``DIR/bench_e2e.png`` and prints a table. ``--tiny --device cpu`` runs a small model on a CPU
(a smoke run of the harness; the tests use it).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pace_core.config import get_config
from pace_core.model.patch import pace
from pace_core.provenance import cpu_model, measurement
from pace_core.results import atomic_write
from pace_core.shapes import PUBLISHED_CONFIGS

VARIANTS = {"bf16 per-token": "bf16", "PACE-4 dP=8": "pace-4"}
WARMUP = 16  # untimed decode steps: two periods of dP = 8
CACHE_ALIGN = 64  # static cache lengths are a multiple of this, the same for both variants
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


def gqa_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one new token per sequence over a static cache, without repeating the key / value
    heads: ``query [B, H, 1, D]``, ``key, value [B, KVH, L, D]`` (query head ``h`` reads key / value
    head ``h // (H / KVH)``, as transformers' ``repeat_kv`` does), ``attention_mask [B, 1, 1, L]``
    bool (True: attend; transformers' ``sdpa_mask``) or None. Scores in the model's dtype, softmax
    in float32. Returns ``(o [B, 1, H, D], None)``. Prompts (more than one query token) go to
    transformers' SDPA path, which the decode step would also take: there it repeats the heads and
    runs a prefill kernel over the whole static length (about 14 of 25 ms per token at B = 128).
    Registered as :data:`ATTENTION` by :func:`build_model`, for both variants alike."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, H, _, D = query.shape
    kvh = key.shape[1]
    scores = torch.matmul(query.view(B, kvh, H // kvh, D), key.transpose(-1, -2)).float() * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # [B, KVH, H / KVH, D]
    return out.reshape(B, 1, H, D), None


ATTENTION = "pace_bench_gqa_decode"
"""The attention implementation :func:`build_model` registers and sets: :func:`gqa_decode_attention`
with transformers' SDPA masks."""


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype):
    """A random-initialised model of :func:`model_config` in ``dtype`` on ``device``, in eval mode,
    its attention layers on :data:`ATTENTION`."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, gqa_decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(tiny), dtype=dtype, attn_implementation=ATTENTION)
    return model.to(device).eval()


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


class _Decoder:
    """Greedy decoding of prompt ``ids [B, T]`` into a static cache of ``cache_len`` positions (the
    prompt runs at construction, under the caller's PACE configuration). :meth:`step` runs the whole
    model on the static ``[B, 1]`` next-token tensor, writes the new greedy token into it and returns
    the logits ``[B, 1, vocab]``: every tensor it touches has a fixed address, so it can be captured."""

    def __init__(self, model, ids: torch.Tensor, cache_len: int) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.next_ids = model(input_ids=ids, past_key_values=self.cache, use_cache=True).logits[:, -1:].argmax(-1)

    def step(self) -> torch.Tensor:
        logits = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True).logits
        self.next_ids.copy_(logits[:, -1:].argmax(-1))
        return logits

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor, copy)`` of every tensor of the decoding state: the next tokens and whatever the
        cache holds (attention keys / values and lengths, conv states, the PACE state store with its
        checkpoints, buffers and launch workspaces); :func:`_restore` puts them back in place."""
        found, seen, todo = [self.next_ids], set(), [self.cache]
        while todo:
            obj = todo.pop()
            if id(obj) in seen or callable(obj) or isinstance(obj, (str, bytes, int, float, torch.nn.Module)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                view = (obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())
                if view not in seen:  # the same memory reached through two objects is one state tensor
                    seen.add(view)
                    found.append(obj)
            elif isinstance(obj, dict):
                todo.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                todo.extend(obj)
            elif hasattr(obj, "__dict__"):
                todo.extend(vars(obj).values())
        return [(t, t.clone()) for t in found]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for tensor, copy in saved:
        tensor.copy_(copy)


def _capture_period(step, period: int) -> list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """One CUDA graph of ``step`` per buffer position ``0 .. period-1`` (the flush is in the last),
    captured in order on one memory pool, each with its static logits. Capturing runs no kernel, but
    the host-side bookkeeping (the buffer's record count) goes round one whole period, so it ends
    where it started; replaying the graphs in order then decodes period after period."""
    graphs, pool = [], None
    for _ in range(period):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = step()
        pool = graph.pool()
        graphs.append((graph, logits))
    return graphs


def _check_graphs(decoder: _Decoder, captured: list) -> dict:
    """One period run eagerly, the decoding state put back (:meth:`_Decoder.snapshot`), and the same
    period replayed from the graphs. Returns the largest logit difference over the period, the
    number of (step, sequence) pairs whose greedy token differs, and the number of state tensors
    that differ after the period (attention cache, conv states, the PACE checkpoints as the period's
    flush left them, buffers, next tokens): all 0 when the graphs do what the eager steps do and the
    kernels are deterministic."""
    before = decoder.snapshot()
    eager = torch.stack([decoder.step()[:, -1] for _ in captured])
    after_eager = decoder.snapshot()
    _restore(before)
    replayed = []
    for graph, logits in captured:
        graph.replay()
        replayed.append(logits[:, -1].clone())
    replayed = torch.stack(replayed)
    return {"graph_vs_eager_max_abs_logit": float((replayed.float() - eager.float()).abs().max()),
            "graph_vs_eager_token_mismatches": int((replayed.argmax(-1) != eager.argmax(-1)).sum()),
            "graph_vs_eager_state_tensors_differing": sum(not torch.equal(t, c) for t, c in after_eager)}


def cache_length(context: int, tokens: int) -> int:
    """Static cache positions for a row: the prompt, the warm-up, two periods of the largest dP (the
    graphs' check, spare) and the timed tokens, rounded up to :data:`CACHE_ALIGN`. The same for
    every variant: the attention's matmuls then run the same kernels (at 562 positions, 1124 bytes
    per bf16 row, cuBLAS took slower ones than at 576)."""
    period = max(get_config(name).decode_period for name in VARIANTS.values())
    return -(-(context + WARMUP + 2 * period + tokens) // CACHE_ALIGN) * CACHE_ALIGN


def compile_model(model, backend: str = "inductor"):
    """``model`` under ``torch.compile`` for the decode steps (module docstring): one graph per batch
    size and variant, so the recompile limit is raised to allow every row of a run."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def state_kernel_names() -> set[str]:
    """Names of the Triton kernels of the ``kernels`` package: the GPU kernels of the recurrent state
    (a profile's kernels by these names are the state's share of a step)."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import kernels

    jitted = (JITFunction, InterpretedFunction)  # compiled, or run by TRITON_INTERPRET=1
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        for value in vars(importlib.import_module(f"kernels.{info.name}")).values():
            while not isinstance(value, jitted) and isinstance(getattr(value, "fn", None), jitted):
                value = value.fn  # an autotuner's or heuristics' kernel
            if isinstance(value, jitted):
                names.add(value.fn.__name__)
    return names


@torch.no_grad()
def time_decode(model, config_name: str, batch: int, context: int, tokens: int, device: torch.device,
                graphs: bool = False, profiler=None, compiled=None) -> dict:
    """Prefill ``[batch, context]`` random ids under ``config_name`` into a static cache, run
    ``WARMUP`` eager decode steps, then time ``tokens`` decode steps. ``graphs`` (CUDA only): the
    steps are replays of one CUDA graph per buffer position (:func:`_capture_period`, dP graphs for
    PACE-4, one for per-token bf16), checked first against the same period run eagerly
    (:func:`_check_graphs`). Else each step runs eagerly (``profiler``, a ``torch.profiler.profile``,
    records the timed steps only). ``compiled`` (:func:`compile_model` of ``model``): the decode steps
    run through it (the prompt does not); the first one's time, compilation included, is ``compile_s``."""
    cfg = get_config(config_name)
    period = cfg.decode_period
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    row = {"mode": ("torch.compile + " if compiled is not None else "") + ("cuda graphs" if graphs else "eager")}
    with pace(model, cfg):
        decoder = _Decoder(model, ids, cache_length(context, tokens))
        if compiled is not None:
            decoder.model = compiled
            with _Clock(device) as clock:
                decoder.step()
            row["compile_s"] = clock.seconds
        if graphs:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP):
                    decoder.step()
            torch.cuda.current_stream(device).wait_stream(stream)
            captured = _capture_period(decoder.step, period)
            row.update(_check_graphs(decoder, captured))
            events = [torch.cuda.Event(enable_timing=True) for _ in range(tokens + 1)]
            events[0].record()
            for t in range(tokens):
                captured[t % period][0].replay()
                events[t + 1].record()
            events[-1].synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
            last = captured[(tokens - 1) % period][1]
        else:
            times = []
            for t in range(WARMUP + tokens):
                if t == WARMUP and profiler is not None:
                    profiler.start()
                with _Clock(device) as clock:
                    last = decoder.step()
                if t >= WARMUP:
                    times.append(clock.seconds)
            if profiler is not None:
                profiler.stop()
        row["outputs_finite"] = bool(torch.isfinite(last).all())
    return {**row, "tpot_mean_s": statistics.fmean(times), "tpot_median_s": statistics.median(times),
            "spread": (min(times), max(times)), "tokens": tokens}


def profile_decode(model, config_name: str, batch: int, context: int, device: torch.device,
                   compiled=None) -> tuple[dict, str]:
    """One period of decode steps (dP = 8, after the prefill and warm-up of :func:`time_decode`, through
    ``compiled`` when given) under ``torch.profiler``. Returns the row's fields (per token: on a GPU its
    busy time, the sum of its kernels' durations, i.e. what a step would take with no host overhead,
    e.g. under a CUDA graph, that time's share of the wall time and the state kernels' share of it
    (:func:`state_kernel_names`); kernel launches and aten calls, host-side counts; the profiled wall
    time) and the table of operators by self GPU time (CPU time on a CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    tokens = 8
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    row = time_decode(model, config_name, batch, context, tokens, device, profiler=prof, compiled=compiled)
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                         row_limit=30, max_name_column_width=60)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    out = {"profiled_tpot_s": row["tpot_mean_s"], "launches_per_step": launches / tokens,
           "aten_calls_per_step": ops / tokens}
    if device.type == "cuda":
        state = state_kernel_names()
        state_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA and e.key in state)
        out["gpu_busy_time_per_token_s"] = busy_us / 1e6 / tokens
        out["gpu_busy_fraction"] = out["gpu_busy_time_per_token_s"] / row["tpot_mean_s"]
        out["state_share"] = state_us / busy_us if busy_us else None
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
    ax.set_title(f"{results['model']} (random weights, bf16, {results['mode']}) on {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _save(results: dict, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode (default 512)")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps, a multiple of dP = 8 (default 32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke run, e.g. on a CPU)")
    ap.add_argument("--eager", action="store_true",
                    help="time eager steps (no CUDA graphs; the default on a CPU): host-bound, for comparison")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager period of each row (tables in profile.txt; in the rows the GPU's "
                         "busy time per token and the host-side counts): where the time per token goes")
    ap.add_argument("--compile", action="store_true",
                    help="decode through torch.compile (the state one pace::gdn_state node per GDN layer); writes "
                         "bench_e2e_compiled.json / .png")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    graphs = device.type == "cuda" and not args.eager
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device; run this on the GPU machine (or --tiny --device cpu)", file=sys.stderr)
        return 2
    if args.tokens < 8 or args.tokens % 8:
        print(f"bench_e2e: --tokens {args.tokens} not allowed; allowed: a positive multiple of 8 (dP)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype)
    compiled = compile_model(model, args.compile_backend) if args.compile else None
    stem = "bench_e2e_compiled" if args.compile else "bench_e2e"
    results = {"model": "tiny Qwen3.5" if args.tiny else "Qwen3.5-4B-sized", "device": str(
        torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model() or "cpu"),
        **measurement(), "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()), "context": args.context,
        "mode": ("torch.compile + " if args.compile else "") + ("cuda graphs" if graphs else "eager"),
        "compile_backend": args.compile_backend if args.compile else None, "cache": "static", "rows": []}
    print(f"{results['model']} ({results['parameters'] / 1e9:.2f}B parameters, {results['dtype']}) on "
          f"{results['device']}, context {args.context}, {args.tokens} timed tokens, {results['mode']}", flush=True)
    save = functools.partial(_save, results, args.out / f"{stem}.json")
    for batch in (int(b) for b in args.batches.split(",")):
        for variant, config_name in VARIANTS.items():
            row = {"variant": variant, "config": config_name, "batch": batch}
            try:
                row.update(time_decode(model, config_name, batch, args.context, args.tokens, device, graphs,
                                       compiled=compiled))
                check = (f", graph vs eager: max |logit diff| {row['graph_vs_eager_max_abs_logit']:.3g}, "
                         f"{row['graph_vs_eager_token_mismatches']} tokens and "
                         f"{row['graph_vs_eager_state_tensors_differing']} state tensors differ" if graphs else "")
                print(f"B={batch:4d} {variant:16s} TPOT {row['tpot_mean_s'] * 1e3:8.2f} ms (median "
                      f"{row['tpot_median_s'] * 1e3:.2f}) finite={row['outputs_finite']}{check}", flush=True)
            except torch.cuda.OutOfMemoryError as err:
                row["error"] = f"out of memory: {err}".splitlines()[0]
                print(f"B={batch:4d} {variant:16s} {row['error']}", flush=True)
                torch.cuda.empty_cache()
            results["rows"].append(row)
        save()  # partial results survive a timeout
    if args.profile:
        tables = []
        for row in (r for r in results["rows"] if "tpot_mean_s" in r):
            counts, table = profile_decode(model, row["config"], row["batch"], args.context, device, compiled)
            row.update(counts)
            tables.append(f"=== {row['variant']}, batch {row['batch']}: {counts}\n{table}\n")
            busy = counts.get("gpu_busy_time_per_token_s")
            print(f"profile B={row['batch']:4d} {row['variant']:16s} {counts['launches_per_step']:.0f} kernel "
                  f"launches and {counts['aten_calls_per_step']:.0f} aten calls per step"
                  + (f", GPU busy {busy * 1e3:.2f} ms per token, {counts['state_share']:.0%} in the state's kernels"
                     if busy is not None else ""), flush=True)
            save()
        atomic_write(args.out / ("profile_compiled.txt" if args.compile else "profile.txt"),
                     lambda tmp: tmp.write_text("".join(tables)))
    by = {(r["variant"], r["batch"]): r for r in results["rows"]}
    for r in results["rows"]:
        base = by[("bf16 per-token", r["batch"])]
        if "tpot_mean_s" in r and "tpot_mean_s" in base:
            r["speedup_vs_bf16_per_token"] = base["tpot_mean_s"] / r["tpot_mean_s"]
    save()
    plot(results, args.out / f"{stem}.png")
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
