"""``python -m pace_core all`` on a published shape spread over the visible GPUs (issue 20), timed and placed.

    python scripts/multigpu_run.py --shape qwen3.5-27b [--model /tmp/pace-qwen3.5-27b] [--dtype bfloat16]
                                   [--device-map auto] [--json data/bench/multigpu/<label>-<n>gpu.json]

Unless ``--model`` already exists, a random-initialised checkpoint of ``--shape`` is written there first
(:func:`random_checkpoint.save_random_checkpoint`, initialised on ``--init-device``). Then the ``all``
command runs in this process on that folder with ``--device-map`` (``auto``: transformers spreads the layers
over every visible GPU) and modest token counts (the ``--*-tokens`` options below), exactly as
``python -m pace_core all --model <folder> --device-map auto ...`` would; each step (the model load, then
calibrate, export, structure, sweep, drift, perplexity, generate, claims) is timed, with every GPU's peak
allocated memory (``torch.cuda.max_memory_allocated``, reset before the step) and free/total memory
(``torch.cuda.mem_get_info``) after it. The JSON also records where the layers went: for each Gated
DeltaNet (linear-attention) layer, the devices of its parameters, and the ``hf_device_map``. It is written
after every step, so a run stopped part way keeps what it measured. Random weights: the numbers say
nothing about quality, only about time, memory and placement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from pace_core.provenance import measurement  # noqa: E402
from pace_core.shapes import PUBLISHED_CONFIGS  # noqa: E402

MODEST: dict[str, int] = {"calibration-tokens": 256, "sweep-tokens": 256, "sweep-decode-tokens": 16,
                          "drift-tokens": 64, "drift-every": 8, "ppl-tokens": 512, "ppl-window": 256,
                          "ppl-batch": 0, "max-new-tokens": 8}
"""Default token counts (options of ``all``). On one H200 with a 27B bf16 checkpoint and three configurations
every step up to generate took under 75 s; claims (its own window of 512 and its own configurations) took
over 270 s and did not finish in one 10-minute call (data/bench/multigpu/qwen3.5-27b-1gpu.json)."""


def gpu_memory() -> list[dict[str, Any]]:
    """Per visible GPU: name, peak allocated since the last reset, allocated now, free and total (GiB)."""
    import torch

    rows = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        rows.append({"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
                     "max_allocated_gib": round(torch.cuda.max_memory_allocated(i) / 2**30, 3),
                     "allocated_gib": round(torch.cuda.memory_allocated(i) / 2**30, 3),
                     "free_gib": round(free / 2**30, 3), "total_gib": round(total / 2**30, 3)})
    return rows


def reset_peaks() -> None:
    import torch

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.reset_peak_memory_stats(i)


def placement(loaded: Any) -> dict[str, Any]:
    """Where the model went: each GDN layer's parameter devices, the devices' parameter GiB, hf_device_map."""
    decoder = loaded.model.get_decoder()
    gdn = {str(i): sorted({str(p.device) for p in decoder.layers[i].linear_attn.parameters()})
           for i in loaded.gdn_layers}
    per_device: dict[str, float] = {}
    for p in loaded.model.parameters():
        per_device[str(p.device)] = per_device.get(str(p.device), 0.0) + p.numel() * p.element_size() / 2**30
    by_device: dict[str, list[int]] = {}
    for i, devices in gdn.items():
        for d in devices:
            by_device.setdefault(d, []).append(int(i))
    device_map = getattr(loaded.model, "hf_device_map", None)
    return {"input_device": str(loaded.device), "gdn_layer_devices": gdn, "gdn_layers_by_device": by_device,
            "parameter_gib_by_device": {d: round(v, 3) for d, v in sorted(per_device.items())},
            "hf_device_map": {k: str(v) for k, v in device_map.items()} if device_map else None}


def all_argv(args: argparse.Namespace) -> list[str]:
    """The ``python -m pace_core all`` arguments this run uses."""
    argv = ["all", "--model", str(args.model), "--device-map", args.device_map, "--dtype", args.dtype,
            "--out", str(args.results), "--quiet"]
    for option in MODEST:
        argv += [f"--{option}", str(getattr(args, option.replace("-", "_")))]
    if args.configs:
        argv += ["--configs", *args.configs]
    if args.force:
        argv.append("--force")
    return argv


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Make the checkpoint if needed, run ``all`` step by step and write ``args.json`` after each step."""
    import torch

    from pace_core.cli import build_parser, context, study
    from pace_core.results import atomic_write

    doc: dict[str, Any] = {"kind": "multigpu_run", "status": "running", "label": args.label, "shape": args.shape,
                           "model": str(args.model), "dtype": args.dtype, "device_map": args.device_map,
                           "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                           "provenance": measurement(), "steps": []}
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        text = json.dumps(doc, indent=2) + "\n"
        atomic_write(args.json, lambda p: p.write_text(text))
        print(f"[multigpu_run] wrote {args.json}", flush=True)

    def step(name: str, action: Callable[[], int]) -> int:
        reset_peaks()
        print(f"[multigpu_run] {name} ...", flush=True)
        start = time.perf_counter()
        code, error = 1, None
        try:
            code = action()
        except BaseException as err:  # also a time limit's SIGINT: recorded, then raised again once saved
            error = f"{type(err).__name__}: {err}"
            raise
        finally:
            for index in range(torch.cuda.device_count()):  # every GPU's queued work, not the current one's
                torch.cuda.synchronize(index)
            seconds = time.perf_counter() - start
            doc["steps"].append({"step": name, "seconds": round(seconds, 3), "exit_code": code, "error": error,
                                 "gpu_memory": gpu_memory()})
            doc["total_s"] = round(sum(s["seconds"] for s in doc["steps"]), 3)
            if error:
                doc["status"] = f"failed in {name}: {error}"
            save()
            print(f"[multigpu_run] {name}: {seconds:.1f} s (exit {code})", flush=True)
        return code

    if not args.model.exists():
        if args.shape is None:
            raise SystemExit(f"--model {args.model} does not exist and no --shape was given to create it")
        from random_checkpoint import save_random_checkpoint

        def make() -> int:
            save_random_checkpoint(args.shape, args.model, args.init_device)
            return 0

        step("checkpoint", make)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    else:
        doc["checkpoint_reused"] = True

    pace_args = build_parser().parse_args(all_argv(args))
    doc["pace_core_command"] = "python -m pace_core " + " ".join(all_argv(args))

    def load() -> int:
        ctx = context._context(pace_args)  # the Context every step of ``all`` reuses (one load)
        doc["placement"] = placement(ctx.loaded)
        doc["summary"] = {k: v for k, v in ctx.loaded.summary().items() if k != "gdn_layer_indices"}
        return 0

    step("load", load)
    code = 0
    for name, action in study.all_steps(pace_args):
        code = step(name, action)
        if code:
            break
    doc["status"] = "done" if code == 0 else f"exit code {code}"
    save()
    return doc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(PUBLISHED_CONFIGS), default=None,
                        help="published shape of the random checkpoint (needed unless --model exists)")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder; created from --shape if missing (default /tmp/pace-<shape>)")
    parser.add_argument("--init-device", default="cuda", help="where the random weights are initialised (default cuda)")
    parser.add_argument("--device-map", default="auto", help="transformers device_map (default auto)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "auto"],
                        help="weight dtype of the run (default bfloat16, as published)")
    parser.add_argument("--configs", nargs="+", default=None, help="configurations (default: those of all)")
    parser.add_argument("--results", type=Path, default=None,
                        help="results root of pace_core (default /tmp/pace-results-<label>)")
    parser.add_argument("--json", type=Path, default=None,
                        help="output JSON (default data/bench/multigpu/<label>-<n>gpu.json)")
    parser.add_argument("--force", action="store_true", help="recompute stored results")
    for option, value in MODEST.items():
        parser.add_argument(f"--{option}", type=int, default=value, help=f"of all (default {value})")
    args = parser.parse_args(argv)
    if args.model is None:
        if args.shape is None:
            parser.error("give --shape or --model")
        args.model = Path(f"/tmp/pace-{args.shape}")
    args.label = args.shape or args.model.resolve().name
    if args.results is None:
        args.results = Path(f"/tmp/pace-results-{args.label}")
    if args.json is None:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.json = REPO_ROOT / "data" / "bench" / "multigpu" / f"{args.label}-{n}gpu.json"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    doc = run(args)
    print(json.dumps({"status": doc["status"], "total_s": doc.get("total_s"),
                      "steps": {s["step"]: s["seconds"] for s in doc["steps"]}}))
    return 0 if doc["status"] == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())
