"""Where the app's slow computations spend their time: each timed, the warm drift and generation also under
cProfile (tables by own and by cumulative time). A diagnostic for issue 16, not a benchmark
(``measure_app.py`` measures the pages themselves).

    python scripts/profile_views.py [--model PATH] [--device cuda] [--weights bfloat16] > profile.txt

The model's weights load in ``--weights`` (the app's sidebar choice: float32 by default, or bfloat16). "cold"
runs include Triton's first compilation of every kernel they launch.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from pace_core.analysis.calibration import calibrate, calibration_samples  # noqa: E402
from pace_core.analysis.drift import drift  # noqa: E402
from pace_core.analysis.generation import generate_side_by_side  # noqa: E402
from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize  # noqa: E402
from pace_core.config import get_config  # noqa: E402
from pace_core.model.loading import load_model  # noqa: E402

def timed(label: str, fn: Callable[[], Any], device: str) -> Any:
    """``fn()``, its wall time printed (synchronised on CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(f"TIME {label}: {time.perf_counter() - start:.2f} s", flush=True)
    return result


def profiled(label: str, fn: Callable[[], Any], device: str, rows: int = 45) -> Any:
    """:func:`timed` under cProfile, the ``rows`` heaviest functions printed by own and by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    result = timed(label, fn, device)
    profile.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(rows)
        print(text.getvalue())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local folder or hub id (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"],
                        help="the weights' dtype, as the app's sidebar offers (default float32)")
    args = parser.parse_args()
    dev = args.device
    model = timed("load", lambda: load_model(args.model, dtype=args.weights, device=dev), dev)
    ids = tokenize(model.tokenizer, read_text(CALIBRATION_TEXT), max_tokens=513, min_tokens=259)
    base = get_config("pace-4")
    periods = (1, 8, 16)
    four = {f"dP{p}": base.replace(name=f"4-bit dP{p}", decode_period=p) for p in periods}
    timed("drift cold", lambda: drift(model, four, ids, 256, every=8, keep_reference=True), dev)
    result = profiled("drift warm", lambda: drift(model, four, ids, 256, every=8, keep_reference=True), dev)
    three = {f"b3 dP{p}": base.replace(name=f"3-bit dP{p}", bits=3, decode_period=p) for p in periods}
    timed("drift recompute cold", lambda: drift(model, three, ids, 256, every=8, reference=result.reference), dev)
    for p in periods:
        one = {f"b3 dP{p}": three[f"b3 dP{p}"]}
        timed(f"drift one config dP{p}", lambda: drift(model, one, ids, 256, every=8, reference=result.reference), dev)
    samples = timed("calibration samples", lambda: calibration_samples(model, tokens=512, sample_every=32), dev)
    timed("calibrate", lambda: calibrate(model, get_config("pace-4-8"), samples=samples), dev)
    configs = {name: get_config(name) for name in ("pace-4", "rtn-int4", "rtn-int8")}
    prompt = " ".join(read_text(CALIBRATION_TEXT)[:2000].split())[:400]
    for label, run in (("generate cold", timed), ("generate warm", profiled)):
        run(label, lambda: generate_side_by_side(model, configs, prompt, max_new_tokens=64, modes=("greedy",),
                                                 seed=0), dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
