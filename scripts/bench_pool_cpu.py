"""The state pool's decode step on the CPU: the reference against the fused step (pace_core.pool_cpu), beside vLLM's
own CPU step on its float32 state and torch.compile (Inductor's C++ backend) of steps written for it, per
configuration and batch size, on one GDN layer of the embedded model's shape (H = 2, HV = 4, K = V = 128).

    python scripts/bench_pool_cpu.py [--configs fp32 bf16 rtn-int4 pace-4 pace-4-8] [--batch 1 8 32 128]
                                     [--steps 40] [--threads 1] [--out data/bench/pool_cpu.json]

Rows sit at every position of their schedule (a pool's rows decoded in staggered groups first), so about one row in
dP flushes at each step, as in serving. Per configuration and batch size B (a pool of 2·B slots, the rows in random
order), the median time of a step over ``--steps`` steps (``--clock process``, the default: this process's CPU
time, which a shared machine's other work inflates less than the wall time; ``wall``) of:

- ``reference``: ``StatePool.decode`` on the PyTorch reference (``backend="reference"``);
- ``fused``: ``StatePool.decode`` on the fused step, prepared float32 inputs;
- ``fused_projected``: ``StatePool.decode_projected``: bfloat16 projections in, q, k and the gates prepared in the
  operator, bfloat16 out (what the vLLM plugin calls);
- ``vllm_own`` (when vLLM's CPU operators import: the vLLM environment): vLLM's
  ``fused_sigmoid_gating_delta_rule_update_cpu`` on its own float32 state ``[slots, HV, V, K]``, the same
  bfloat16 projections (the step vLLM serves its own state with);
- ``inductor`` (``--inductor``): ``torch.compile`` of the float32 step (gather, recurrence, scatter) and of PACE-4's
  checkpoint reads (gather, unpack, dequantise, both dots; no record or flush), dynamic in B: the candidate the fused
  step was chosen over, with its compile time.

Prompts (``--prompt-tokens``, default 24 and 512; one prompt from zero, per configuration): ``reference``
(``StatePool.prefill``), ``fused_projected`` (``StatePool.prefill_projected``) and ``vllm_own`` (vLLM's
``fused_gdn_gating_cpu`` and ``chunk_gated_delta_rule_cpu`` on its float32 state), rows with ``"prompt_tokens"``.

Ratios are each row's time over ``fused_projected`` (and ``vllm_own`` over it). The machine may be shared: the
one-minute load average is recorded per configuration. JSON with provenance to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pace_core.config import get_config  # noqa: E402
from pace_core.pool import StatePool  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402
from pace_core.recurrence import gdn_gates, prepare_qk  # noqa: E402
from pace_core.results import atomic_write  # noqa: E402

H, HV, K, V = 2, 4, 128, 128
CONFIGS = ("fp32", "bf16", "rtn-int4", "pace-4", "pace-4-8")

try:
    import vllm._custom_ops as vllm_ops  # the vLLM environment only
except ImportError:
    vllm_ops = None


def config(name: str):
    cfg = get_config(name)
    return cfg.replace(high_heads=((1,),)) if cfg.high_share else cfg


def projections(B: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Raw bfloat16 projections of B decode tokens, and the layer's gate parameters."""
    return {"q": torch.randn(B, H, K, generator=gen).bfloat16(), "k": torch.randn(B, H, K, generator=gen).bfloat16(),
            "v": torch.randn(B, HV, V, generator=gen).bfloat16(), "a": torch.randn(B, HV, generator=gen).bfloat16(),
            "b": torch.randn(B, HV, generator=gen).bfloat16(),
            "A_log": (torch.rand(HV, generator=gen) - 2.0).bfloat16(),
            "dt_bias": torch.rand(HV, generator=gen).bfloat16()}


def projected(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The projections in the order of ``StatePool.decode_projected`` / ``prefill_projected``."""
    return x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"]


def vllm_own_prefill(x: dict[str, torch.Tensor], state: torch.Tensor, idx: torch.Tensor, cu: torch.Tensor) -> None:
    """vLLM's CPU prefill of one prompt from zero on its float32 state (gates, then the chunked rule)."""
    g, beta = vllm_ops.fused_gdn_gating_cpu(A_log=x["A_log"], a=x["a"], b=x["b"], dt_bias=x["dt_bias"])
    state[idx.long()] = 0
    vllm_ops.chunk_gated_delta_rule_cpu(
        query=x["q"][None], key=x["k"][None], value=x["v"][None], g=g, beta=beta, initial_state=state,
        output_final_state=True, cu_seqlens=cu, head_first=False, use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx)


def prepared(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    q, k = prepare_qk(x["q"], x["k"])
    g, beta = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    return q, k, x["v"].float(), g, beta


CLOCK = {"process": time.process_time, "wall": time.perf_counter}
clock = time.process_time


def median_time(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t = clock()
        step()
        times.append(clock() - t)
    return statistics.median(times)


def staggered(pool: StatePool, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Decode the rows in growing groups so that their record counts differ (about one in dP flushes per step)."""
    period = pool.cfg.decode_period if pool.cfg.buffered else 1
    B = slots.shape[0]
    for i in range(period):
        rows = slots[: max(1, B * (i + 1) // period)]
        pool.decode(rows, *prepared(projections(rows.shape[0], gen)))


def inductor_candidates() -> dict:
    """Steps written for Inductor (module docstring), compiled dynamic in B."""
    def fp32_step(state, slots, q, k, v, g, beta):
        S = state.index_select(0, slots).view(-1, H, HV // H, K, V) * g.exp().view(-1, H, HV // H, 1, 1)
        read = torch.einsum("bhk,bhgkv->bhgv", k, S)
        u = beta.view(-1, H, HV // H, 1) * (v.view(-1, H, HV // H, V) - read)
        S = S + k[:, :, None, :, None] * u[:, :, :, None, :]
        state.index_copy_(0, slots, S.view(-1, HV, K, V))
        return torch.einsum("bhk,bhgkv->bhgv", q, S).reshape(-1, HV, V)

    def pace4_reads(codes, scale, slots, k, q):
        c = codes.index_select(0, slots)
        vals = torch.stack([(c & 15).float(), (c >> 4).float()], -1).flatten(-2) - 8.0
        S = vals * scale.index_select(0, slots).float().repeat_interleave(K // scale.shape[2], 2)
        S = S.view(-1, H, HV // H, K, V)
        return torch.einsum("bhk,bhgkv->bhgv", k, S), torch.einsum("bhk,bhgkv->bhgv", q, S)

    return {"fp32": torch.compile(fp32_step, dynamic=True), "pace-4": torch.compile(pace4_reads, dynamic=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-tokens", dest="prompt_tokens", nargs="*", type=int, default=[24, 512])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker serves with 1 here)")
    parser.add_argument("--clock", choices=list(CLOCK), default="process",
                        help="process: this process's CPU time (one thread: robust on a shared machine); wall")
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "data" / "bench" / "pool_cpu.json")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    compiled = inductor_candidates() if args.inductor else {}
    rows = []
    for name in args.configs:
        cfg = config(name)
        load = os.getloadavg()[0]
        for B in args.batch:
            gen = torch.Generator().manual_seed(B)
            slots = torch.randperm(2 * B, generator=gen)[:B]
            times = {}
            for label, backend in (("reference", "reference"), ("fused", None)):
                pool = StatePool(cfg, (H, HV, K, V), 2 * B, "cpu", backend=backend)
                staggered(pool, slots, gen)
                x = projections(B, gen)
                inputs = prepared(x)
                steps = args.steps if label != "reference" or B <= 32 else max(5, args.steps // 4)
                times[label] = median_time(partial(pool.decode, slots, *inputs), steps)
                if label == "fused":
                    out = torch.empty(B, HV, V, dtype=torch.bfloat16)
                    times["fused_projected"] = median_time(
                        partial(pool.decode_projected, slots, *projected(x), out), args.steps)
            if vllm_ops is not None:
                state = torch.zeros(2 * B, HV, V, K)
                idx = slots.int()
                cu = torch.arange(B + 1, dtype=torch.int32)
                x = projections(B, gen)
                times["vllm_own"] = median_time(partial(
                    vllm_ops.fused_sigmoid_gating_delta_rule_update_cpu, A_log=x["A_log"], dt_bias=x["dt_bias"],
                    q=x["q"][None], k=x["k"][None], v=x["v"][None], a=x["a"], b=x["b"], initial_state_source=state,
                    initial_state_indices=idx, cu_seqlens=cu, use_qk_l2norm_in_kernel=True), args.steps)
            if name in compiled:
                fn = compiled[name]
                q, k, v, g, beta = prepared(projections(B, gen))
                if name == "fp32":
                    state = torch.zeros(2 * B, HV, K, V)
                    call = partial(fn, state, slots, q, k, v, g, beta)
                else:
                    pool = StatePool(cfg, (H, HV, K, V), 2 * B, "cpu")
                    call = partial(fn, pool.tensors["codes"], pool.tensors["scale"], slots, k, q)
                t = time.perf_counter()
                call()
                times["inductor_compile_s"] = time.perf_counter() - t
                times["inductor"] = median_time(call, args.steps)
            row = {"config": name, "batch": B, "load_avg_1m": load, **{f"{k}_ms": v * 1e3 if not k.endswith("_s")
                                                                       else v for k, v in times.items()}}
            base = times["fused_projected"]
            row["ratios_over_fused_projected"] = {k: v / base for k, v in times.items() if not k.endswith("_s")}
            rows.append(row)
            print(f"{name:9s} B={B:4d} " + " ".join(f"{k} {v * 1e3:8.3f} ms" if not k.endswith("_s") else
                                                    f"{k} {v:.1f} s" for k, v in times.items())
                  + f"  load {load:.2f}", flush=True)
    for name in args.configs:
        cfg = config(name)
        load = os.getloadavg()[0]
        for T in args.prompt_tokens:
            gen = torch.Generator().manual_seed(T)
            x = {**projections(T, gen)}
            times = {}
            for label, backend in (("reference", "reference"), ("fused_projected", None)):
                pool = StatePool(cfg, (H, HV, K, V), 2, "cpu", backend=backend)
                out = torch.empty(T, HV, V, dtype=torch.bfloat16)
                starts, slot, initial = torch.tensor([0, T]), torch.tensor([1]), torch.tensor([False])
                times[label] = median_time(partial(pool.prefill_projected, slot, starts, initial, *projected(x), out),
                                           max(3, args.steps // 8))
            if vllm_ops is not None:
                state = torch.zeros(2, HV, K, V)
                idx, cu = torch.tensor([1], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
                times["vllm_own"] = median_time(partial(vllm_own_prefill, x, state, idx, cu), max(3, args.steps // 8))
            row = {"config": name, "prompt_tokens": T, "load_avg_1m": load,
                   **{f"{k}_ms": v * 1e3 for k, v in times.items()}}
            row["ratios_over_fused_projected"] = {k: v / times["fused_projected"] for k, v in times.items()}
            rows.append(row)
            print(f"{name:9s} T={T:4d} " + " ".join(f"{k} {v * 1e3:8.3f} ms" for k, v in times.items())
                  + f"  load {load:.2f}", flush=True)
    doc = {"kind": "pool-cpu-bench", "shape": {"H": H, "HV": HV, "K": K, "V": V}, "threads": args.threads,
           "clock": args.clock,
           "rows": rows, "provenance": {**measurement(), "vllm_own": vllm_ops is not None,
                                        "load_avg_end": os.getloadavg()}}
    atomic_write(args.out, lambda path: path.write_text(json.dumps(doc, indent=1) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
