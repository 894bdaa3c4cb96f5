"""What a ``pace_core.apply`` user really holds: for every configuration apply takes, the model generates with
it and the recurrent state it keeps is measured, beside transformers' own fp32 state.

Per configuration: the bytes of every tensor reachable from the generation's state store
(``pace_core.memory.held_bytes``) against ``pace_core.accounting.state_bytes`` (they must be equal), the same for
the fp32 reference (the cache's own ``recurrent_states``), the whole cache (attention KV and conv states
included), and the largest workspace of one decode step of the state (``PeakBytes`` on the CPU;
``torch.cuda.max_memory_allocated`` of the whole generation on a GPU, against fp32's). Writes
``<out>/memory_<device>.json`` with provenance and prints a table.

    python scripts/measure_memory.py                      # the embedded model on the CPU
    python scripts/measure_memory.py --model DIR --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pace_core.provenance import measurement  # noqa: E402

CONFIGS = ("fp32", "bf16", "rtn-int8", "rtn-int4", "rtn-int3", "pace-4", "pace-3", "pace-4-8", "qmamba-dsq")
"""The named configurations ``pace_core.apply`` runs (DAMP needs its outlier rows passed to apply_pace)."""


def measure(loaded, name: str, batch: int, prompt_tokens: int, new_tokens: int) -> dict:
    """One configuration's row: generate ``new_tokens`` after a prompt of ``prompt_tokens`` for ``batch``
    sequences with the configuration applied, then count what the cache holds."""
    import torch

    from pace_core import apply
    from pace_core.accounting import resident_bits, state_bytes
    from pace_core.analysis.calibration import calibrate
    from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
    from pace_core.config import get_config
    from pace_core.memory import PeakBytes, held_bytes
    from pace_core.model.patch import get_state_store, remove_pace

    cfg = get_config(name)
    if cfg.high_share > 0:
        cfg = calibrate(loaded, cfg, str(CALIBRATION_TEXT), tokens=512, sample_every=32).config
    model, shape = loaded.model, loaded.shape
    ids = tokenize(loaded.tokenizer, read_text(CALIBRATION_TEXT), prompt_tokens).to(loaded.device).repeat(batch, 1)
    apply(model, cfg)
    try:
        cuda = loaded.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(loaded.device)
            before = torch.cuda.memory_allocated(loaded.device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True)
            cache = out.past_key_values
            store = get_state_store(cache)
            gpu_peak = torch.cuda.max_memory_allocated(loaded.device) - before if cuda else None
            # one more decode step of the state alone: its workspace
            step = out.sequences[:, -1:]
            with PeakBytes() as peak:
                model(step, past_key_values=cache, use_cache=True)
    finally:
        remove_pace(model)
    held = held_bytes(store) if store is not None else held_bytes(
        [cache.layers[i].recurrent_states for i in shape.gdn_layers])
    return {"config": name, "resident_bits": resident_bits(cfg, shape).resident_bits,
            "state_bytes_accounted": state_bytes(cfg, shape, batch), "state_bytes_held": held,
            "cache_bytes_held": held_bytes(cache), "decode_step_peak_bytes": peak.peak,
            "generate_peak_gpu_bytes": gpu_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4, help="sequences generated together (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(REPO_ROOT / "data" / "bench"))
    args = parser.parse_args()

    from pace_core.model.loading import load_model

    loaded = load_model(args.model, device=args.device)
    rows = [measure(loaded, name, args.batch, args.prompt_tokens, args.new_tokens) for name in CONFIGS]
    fp32 = rows[0]["state_bytes_held"]
    for row in rows:
        row["saving_vs_fp32"] = fp32 / row["state_bytes_held"]
    doc = {"kind": "apply_memory",
           "provenance": {**measurement(), "model": loaded.reference, "weights": loaded.fingerprint,
                          "device": str(loaded.device), "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens},
           "rows": rows}
    out = Path(args.out) / f"memory_{loaded.device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(out)
    print(f"{'config':12} {'bits':>7} {'accounted':>12} {'held':>12} {'x fp32':>7} {'cache':>12} {'step peak':>11}")
    for r in rows:
        print(
            f"{r['config']:12} {r['resident_bits']:7.3f} {r['state_bytes_accounted']:12,} {r['state_bytes_held']:12,} "
            f"{r['saving_vs_fp32']:7.2f} {r['cache_bytes_held']:12,} {r['decode_step_peak_bytes']:11,}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
