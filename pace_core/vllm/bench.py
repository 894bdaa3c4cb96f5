"""Serving benchmark: vLLM's own state against the plugin, through ``vllm serve`` and its OpenAI API, at one
state and cache memory budget.

    python -m pace_core.vllm.bench [--model data/models/pace-tiny-qwen35] [--configs vllm-own fp32 ... FILE]
                                   [--memory-mib 64] [--concurrency 1 8 32 64] [--shapes 24x32 512x256]
                                   [--runs 2] [--out data/bench/vllm_serve_cpu.json]

(in the vLLM environment: ``make vllm-env``). Each run serves every configuration in turn (even runs in the reverse
order, :func:`serving_order`; by default vLLM's own state, ``vllm-own``, and each named configuration a pool row
holds, PACE-4/8 with the embedded model's exported heads) with the documented command
(:func:`pace_core.vllm.settings.serve_command`; ``vllm-own``: the same engine settings without a configuration),
``--kv-cache-memory-bytes`` of ``--memory-mib`` and ``--max-model-len`` of the longest shape (at least
:data:`pace_core.vllm.check.MAX_MODEL_LEN`). Per shape ``PxT`` of ``--shapes`` (short prompts and outputs, 24x32;
long ones, 512x256, where prefill and the buffer's flushes weigh differently) and each concurrency ``c`` it sends
``max(c, 8)`` requests, at most ``c`` in flight, and more until the level has run :data:`MIN_WALL_S` seconds
(except the highest ``c``, the burst: exactly its requests), of ``T`` greedy tokens each (``ignore_eos``) on the
``P``-token prompts of :func:`pace_core.vllm.check.prompts` in turn (the text has 8 lines of 512 tokens; prefix
caching is off), and measures: output tokens per second (all output tokens over the wall time; one request before
the first level warms the server up), mean and 99th-percentile latency of a request, peak running sequences (vLLM's
``vllm:num_requests_running`` on ``/metrics``, polled every 0.1 s), the requests vLLM preempted (freed their
blocks to admit others and computed their tokens again on resuming; :data:`PREEMPTIONS`) and the wall time;
``c = 64`` is the burst of 64 requests. ``ratios``: each plugin row over ``vllm-own``'s row of the same run, shape
and concurrency. The machine may be shared: the one-minute load average is recorded beside each level, and the
ratios within one run are the figures to read.

What the memory allows, beside what the servers did: each row carries what its server reported at start-up
(:func:`engine_report`: the most requests of the longest shape vLLM can hold at once, the padding of each state
page to whole attention blocks, :mod:`pace_core.vllm.pages`), and ``memory`` (:func:`request_bytes`) gives, per
configuration and shape, the bytes one request holds at its full length: its recurrent state (the plugin's pool
rows, or vLLM's own float32 state) and the full-attention layers' bf16 KV cache, with the most sequences the state
format can fit over vLLM's own at equal memory (``sequences_bound``) and that bound for a state of no bytes at all
(``zero_state_bound``): where the KV cache outweighs the state, no state format reaches a given multiple.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pace_core.accounting import state_bytes_per_sequence
from pace_core.config import NAMED_CONFIGS
from pace_core.provenance import cpu_model
from pace_core.shapes import shape_from_hf_config
from pace_core.vllm.check import EMBEDDED, MAX_MODEL_LEN, REPO_ROOT, VLLM_OWN, _label, served_configs
from pace_core.vllm.settings import serve_command, served_for

CONFIGS = (VLLM_OWN, *served_configs("pool"))
"""vLLM's own state and the named configurations served from a pool row (tag ``pool``; PACE-4/8 as the embedded
model's export)."""
SHIPPED = REPO_ROOT / "data" / "bench" / "vllm_serve_cpu.json"
"""The figures this project measured (``python -m pace_core.vllm.bench``), shown on the Benchmarks and Export pages."""
READY_S = 300
"""How long a server may take to answer ``/health`` (about 40 s on two shared cores)."""
MIN_REQUESTS = 8
MIN_WALL_S = 8.0
"""A level below the burst sends requests until it has run this long (the same prompts in turn): a level of 8
requests of 24+32 takes about 0.5 s, where two runs of one cell moved by 0.3 of vLLM's own speed."""
SHAPES = ("24x32", "512x256")
"""Prompt and output tokens of the measured requests, ``PxT``: short ones, and long prompts with long outputs."""


def shape(text: str) -> tuple[int, int]:
    """``(prompt tokens, output tokens)`` of a shape ``PxT`` (both positive); ValueError naming the allowed form."""
    try:
        p, t = (int(x) for x in text.split("x"))
    except ValueError:
        p = t = 0
    if p <= 0 or t <= 0:
        raise ValueError(f"shape {text!r} not allowed; allowed: PROMPTxOUTPUT tokens, both positive, e.g. 512x256")
    return p, t


@dataclass
class VllmServer:
    """A ``vllm serve`` subprocess (its own process group) on ``port`` of 127.0.0.1, its output in ``log``."""

    proc: subprocess.Popen
    port: int
    log: Path

    @classmethod
    def start(cls, model: str | os.PathLike, config: str | None, log: Path, args: Sequence[str] = (),
              env: Mapping[str, str | None] = {}) -> VllmServer:
        """:func:`serve_command` for ``model`` and ``config`` (None: vLLM's own state) with ``args`` on a free
        port, run by this environment's ``vllm``; ``env`` overrides the environment (None: removes a variable).
        vLLM runs its engine in its own processes, as for a user (``VLLM_ENABLE_V1_MULTIPROCESSING`` removed)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = shlex.split(serve_command(str(model), config)) + ["--port", str(port), *args]
        full = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
        for key, value in env.items():
            full.pop(key, None) if value is None else full.__setitem__(key, value)
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        return cls(proc, port, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> str:
        """The text of ``GET path`` (e.g. ``/metrics``)."""
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def wait_ready(self, timeout: float = READY_S) -> None:
        """Return once ``/health`` answers; RuntimeError with the log's end if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                self.get("/health")
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"vllm serve not ready after {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> int:
        """Ctrl-C to the server's process group, as a user stops it; its exit status (killed after 60 s)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


ENGINE_LINES = {
    "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    "state_page_padding_pct": re.compile(r"Padding mamba page size by ([\d.]+)%"),
    "attention_block_tokens": re.compile(r"Setting attention block size to (\d+) tokens"),
}
"""The start-up lines of vLLM 0.32 that say what its memory holds (:func:`engine_report`)."""


def engine_report(log_text: str) -> dict[str, float | None]:
    """What a server's start-up output says of its memory (None where a line is absent): ``max_concurrency``, the
    most requests of ``--max-model-len`` tokens it holds at once; ``state_page_padding_pct``, how much vLLM pads each
    state page to make it one attention block; ``attention_block_tokens``, that block."""
    found = {key: pattern.search(log_text) for key, pattern in ENGINE_LINES.items()}
    return {key: None if m is None else float(m.group(1)) for key, m in found.items()}


def request_bytes(hf_config_json: str, configs: Sequence[str],
                  shapes: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per configuration and shape ``(P, T)``: the bytes one request holds at its full length ``P + T`` on the model
    of ``hf_config_json`` (its ``config.json`` text): ``state_bytes``, its recurrent states over the GDN layers (the
    plugin's pool rows, :class:`~pace_core.vllm.slots.SlotLayout`, before vLLM pads them to pages; ``vllm-own``:
    vLLM's float32 state), and ``kv_bytes``, the full-attention layers' bf16 KV cache
    (:attr:`~pace_core.shapes.ModelShape.kv_bytes_per_token`); the convolution state is the same in both and left
    out. ``sequences_bound``: vLLM's own bytes per request over these, the most sequences the format fits over vLLM's
    own at equal memory; ``zero_state_bound``: the same for a state of no bytes."""
    shape = shape_from_hf_config(json.loads(hf_config_json))
    own = state_bytes_per_sequence(NAMED_CONFIGS["fp32"], shape)  # vLLM's own state: float32, as fp32's
    rows = []
    for config in configs:
        state = own if config == VLLM_OWN else sum(
            layout.nbytes for layout in served_for(config, hf_config_json).layouts.values())
        for p, t in shapes:
            kv = shape.kv_bytes_per_token * (p + t)
            rows.append({"config": _label(config), "prompt_tokens": p, "tokens": t, "state_bytes": state,
                         "kv_bytes": kv, "sequences_bound": (own + kv) / (state + kv),
                         "zero_state_bound": (own + kv) / kv})
    return rows


def serving_order(configs: Sequence[str], run: int) -> list[str]:
    """The configurations in the order run ``run`` (from 1) serves them: as given in odd runs, reversed in even ones,
    so that a shared machine's drift over a run weighs on every configuration alike over two runs."""
    return list(configs) if run % 2 else list(reversed(configs))


def metric(text: str, name: str) -> float | None:
    """The value of the first sample of metric ``name`` in a Prometheus text (None when absent)."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


PREEMPTIONS = "vllm:num_preemptions_total"
"""vLLM's count of requests it preempted (their KV blocks freed, their tokens computed again when resumed)."""


def preemptions(text: str) -> int:
    """The requests a server has preempted since it started, from its ``/metrics`` text (:data:`PREEMPTIONS`; 0
    before its first)."""
    return int(metric(text, PREEMPTIONS) or 0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between the closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def _level(server: VllmServer, model: str, prompt_ids: Sequence[Sequence[int]], concurrency: int,
                 tokens: int, requests: int | None = None, min_wall_s: float = 0.0) -> dict[str, Any]:
    """One concurrency level's measurements (module docstring): at least ``requests`` (default ``max(concurrency,
    MIN_REQUESTS)``) requests, at most ``concurrency`` in flight, more until ``min_wall_s`` seconds have passed."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    latencies, outputs, peak, done, sent = [], [], 0, asyncio.Event(), 0
    least = requests or max(concurrency, MIN_REQUESTS)

    async def client_loop() -> None:  # one of ``concurrency`` clients, each sending its next request when answered
        nonlocal sent
        while sent < least or time.perf_counter() - start < min_wall_s:
            ids, sent = prompt_ids[sent % len(prompt_ids)], sent + 1
            begin = time.perf_counter()
            r = await client.completions.create(model=model, prompt=list(ids), max_tokens=tokens, temperature=0.0,
                                                extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - begin)
            outputs.append(r.usage.completion_tokens)

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            text = await asyncio.to_thread(server.get, "/metrics")
            peak = max(peak, int(metric(text, "vllm:num_requests_running") or 0))
            await asyncio.sleep(0.1)

    preempted = preemptions(server.get("/metrics"))
    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, least))))
    n = len(latencies)
    wall = time.perf_counter() - start
    done.set()
    await watcher
    await client.close()
    return {"concurrency": concurrency, "requests": n, "output_tokens": sum(outputs),
            "output_tokens_per_s": sum(outputs) / wall, "latency_mean_s": sum(latencies) / n,
            "latency_p99_s": percentile(latencies, 99), "peak_running": peak, "wall_s": wall,
            "preemptions": preemptions(server.get("/metrics")) - preempted}


def measure(model: str, config: str, prompt_sets: Mapping[tuple[int, int], Sequence[Sequence[int]]],
            concurrency: Sequence[int], memory_bytes: int, log: Path) -> list[dict[str, Any]]:
    """Rows of one configuration (``vllm-own``: vLLM's own state) served by one ``vllm serve``, one per shape
    ``(P, T)`` of ``prompt_sets`` (its prompts) and level."""
    longest = max(MAX_MODEL_LEN, *(p + t for p, t in prompt_sets))
    args = ["--kv-cache-memory-bytes", str(memory_bytes), "--max-model-len", str(longest)]
    server = VllmServer.start(model, None if config == VLLM_OWN else config, log, args,
                              env={"VLLM_CPU_KVCACHE_SPACE": None})  # it would override the budget
    try:
        server.wait_ready()
        served = json.loads(server.get("/v1/models"))["data"][0]["id"]
        blocks = re.search(r'num_gpu_blocks="(\d+)"', server.get("/metrics"))
        engine = engine_report(log.read_text(errors="replace"))
        rows = []
        for (p, t), prompt_ids in prompt_sets.items():
            asyncio.run(_level(server, served, prompt_ids[:1], 1, t, requests=1))  # warm-up, not counted
            for c in concurrency:
                load = os.getloadavg()[0]
                row = asyncio.run(_level(server, served, prompt_ids, c, t,
                                         min_wall_s=0.0 if c == max(concurrency) else MIN_WALL_S))
                rows.append({"config": _label(config), "prompt_tokens": p, "tokens": t, **row,
                             "blocks": int(blocks.group(1)) if blocks else None, **engine, "load_avg_1m": load})
    finally:
        server.stop()
    return rows


def ratios(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each plugin row over ``vllm-own``'s of the same run, shape and concurrency: output tokens/s, peak running
    sequences and wall time."""
    def key(r: Mapping[str, Any]) -> tuple:
        return r["run"], r.get("prompt_tokens"), r.get("tokens"), r["concurrency"]

    own = {key(r): r for r in rows if r["config"] == VLLM_OWN}
    out = []
    for r in rows:
        base = own.get(key(r))
        if r["config"] == VLLM_OWN or base is None:
            continue
        out.append({"run": r["run"], "config": r["config"], "prompt_tokens": r.get("prompt_tokens"),
                    "tokens": r.get("tokens"), "concurrency": r["concurrency"],
                    "tokens_per_s_ratio": r["output_tokens_per_s"] / base["output_tokens_per_s"],
                    "peak_running_ratio": r["peak_running"] / max(base["peak_running"], 1),
                    "wall_ratio": r["wall_s"] / base["wall_s"],
                    "max_concurrency_ratio": None if not (r.get("max_concurrency") and base.get("max_concurrency"))
                    else r["max_concurrency"] / base["max_concurrency"]})
    return out


def shipped_table(path: Path = SHIPPED, concurrency: int = 64) -> list[dict[str, Any]] | None:
    """The stored ratios at ``concurrency`` (the burst), one row per configuration, shape and run: tokens/s, peak
    running and wall time over vLLM's own, and, where the file has ``memory``, the most sequences the state format
    fits at the requests' full length over vLLM's own (None when the file is missing or unreadable)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        bound = {(m["config"], m["prompt_tokens"], m["tokens"]): m["sequences_bound"] for m in doc.get("memory", [])}
        rows = []
        for r in doc["ratios"]:
            if r["concurrency"] != concurrency:
                continue
            p, t = r.get("prompt_tokens", doc.get("prompt_tokens")), r.get("tokens", doc.get("tokens"))
            row = {"configuration": Path(r["config"]).stem.removeprefix("config-"), "run": r["run"],
                   "prompt + output tokens": f"{p} + {t}", "output tok/s ×": round(r["tokens_per_s_ratio"], 2),
                   "peak running ×": round(r["peak_running_ratio"], 2), "burst wall time ×": round(r["wall_ratio"], 2)}
            if (r["config"], p, t) in bound:
                row["fits at full length ×"] = round(bound[r["config"], p, t], 2)
            rows.append(row)
        return rows
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EMBEDDED))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--memory-mib", dest="memory_mib", type=int, default=64)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--shapes", nargs="+", type=shape, default=[shape(s) for s in SHAPES],
                        help="PROMPTxOUTPUT tokens of the requests, e.g. 24x32 512x256")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts per shape (fewer where the text "
                        "has fewer lines that long)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=SHIPPED)
    parser.add_argument("--logs", type=Path, default=None, help="folder for the servers' output (default: a new "
                        "temporary folder, printed)")
    args = parser.parse_args(argv)
    import vllm
    from transformers import AutoConfig, AutoTokenizer

    from pace_core.model.reference import portable_reference
    from pace_core.results import atomic_write, make_provenance
    from pace_core.vllm.check import prompts

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_sets = {(p, t): prompts(tokenizer, args.prompts, p, fewer=True) for p, t in args.shapes}
    memory = request_bytes(AutoConfig.from_pretrained(args.model).to_json_string(use_diff=False), args.configs,
                           args.shapes)
    for m in memory:
        print(f"{m['config']:<48} {m['prompt_tokens']:>3}+{m['tokens']:<3} state {m['state_bytes'] / 1024:8.1f} KiB "
              f"KV {m['kv_bytes'] / 1024:8.1f} KiB per request: at most {m['sequences_bound']:.2f}x vLLM's own "
              f"sequences (a state of no bytes: {m['zero_state_bound']:.2f}x)", flush=True)
    load_start, rows = os.getloadavg(), []
    logs = args.logs or Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"servers' output in {logs}", flush=True)
    for run in range(1, args.runs + 1):
        for config in serving_order(args.configs, run):
            log = logs / f"run{run}-{Path(_label(config)).stem}.log"
            for row in measure(args.model, config, prompt_sets, args.concurrency, args.memory_mib << 20, log):
                rows.append({"run": run, **row})
                print(
                    f"run {run} {row['config']:<48} {row['prompt_tokens']:>3}+{row['tokens']:<3} "
                    f"c={row['concurrency']:<3} {row['output_tokens_per_s']:8.1f} tok/s "
                    f"mean {row['latency_mean_s']:6.2f} s p99 {row['latency_p99_s']:6.2f} s peak "
                    f"{row['peak_running']:3d} wall {row['wall_s']:6.1f} s load {row['load_avg_1m']:.2f}",
                    flush=True,
                )
    doc = {"kind": "vllm-serve-bench", "memory_mib": args.memory_mib,
           "shapes": [{"prompt_tokens": p, "tokens": t, "prompts": len(ids)} for (p, t), ids in prompt_sets.items()],
           "device": f"CPU {cpu_model() or platform.machine()}, {os.cpu_count()} cores",
           "memory": memory, "rows": rows, "ratios": ratios(rows),
           "provenance": make_provenance(portable_reference(str(args.model)),
                                         extra={"vllm": vllm.__version__, "platform": platform.platform(),
                                                "load_avg_start": load_start, "load_avg_end": os.getloadavg()})}
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write(args.out, lambda p: p.write_text(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
