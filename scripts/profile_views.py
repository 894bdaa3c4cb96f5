"""Where the app's slow computations spend their time: each timed, the warm drift and generation also under
cProfile (tables by own and by cumulative time). A diagnostic for issue 16, not a benchmark
(``measure_app.py`` measures the pages themselves).

    python scripts/profile_views.py [--model PATH] [--device cuda] [--weights bfloat16] > profile.txt
    python scripts/profile_views.py --only generation ...           # the Generations page's computation alone
    python scripts/profile_views.py --page drift [--visits 3] ...   # one page's first visits, broken down

The model's weights load in ``--weights`` (the app's sidebar choice: float32 by default, or bfloat16). "cold"
runs include Triton's first compilation of every kernel they launch. ``--page NAME`` drives the app as
``measure_app.py`` does (AppTest, preset pace-4-8) and visits ``pages/NAME.py`` ``--visits`` times with every
computed result dropped in between, printing the time of each app_state / pace_core step the visit runs.
The generation part also times fewer configurations and transformers' own ``generate`` without PACE: what
each configuration adds, and the floor that every one shares.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


PAGE_STEPS = (("app_state.session", "loaded_model"), ("app_state.stored", "choose_stored"),
              ("app_state.compute", "calibration"), ("app_state.compute", "calibrate"),
              ("app_state.compute", "drift"), ("app_state.compute", "generations"),
              ("app_state.compute", "reference_states"), ("pace_core.analysis.calibration", "calibration_samples"),
              ("pace_core.analysis.drift", "drift"), ("pace_core.analysis.generation", "generate_side_by_side"))
"""The steps a page visit is broken down into (module, function): each wrapped to print its time."""


def generations(model, prompt: str, configs: dict, dev: str, tokens: int = 64) -> None:
    """Generation as the Generations page runs it (``measure_app``'s figure: these 4 configurations and the fp32
    reference, ``tokens`` greedy tokens): cold, warm, warm under cProfile; then warm with fewer configurations
    (the cost of one more) and transformers' own ``generate`` without PACE (what every configuration shares)."""
    def run(cfgs: dict) -> Any:
        return generate_side_by_side(model, cfgs, prompt, max_new_tokens=tokens, modes=("greedy",), seed=0)

    timed("generate cold", lambda: run(configs), dev)
    timed("generate warm", lambda: run(configs), dev)
    profiled("generate warm", lambda: run(configs), dev, rows=60)
    names = list(configs)
    for n in range(len(names) - 1, -1, -1):
        timed(
            f"generate warm, {n} configurations and the reference",
            lambda n=n: run({k: configs[k] for k in names[:n]}),
            dev,
        )
    ids = model.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    for rows in (1, 5):
        batch = ids.repeat(rows, 1)
        timed(f"transformers generate, no PACE, {rows} rows", lambda batch=batch: model.model.generate(
            input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=tokens, do_sample=False,
            min_new_tokens=tokens, pad_token_id=model.tokenizer.pad_token_id), dev)


def page_visits(args: argparse.Namespace) -> int:
    """``--page``: the page's first visits after the model is loaded, each step of :data:`PAGE_STEPS` timed."""
    import importlib

    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import measure_app

    for module_name, name in PAGE_STEPS:
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        label = f"{module_name}.{name}"
        setattr(module, name, lambda *a, _fn=fn, _label=label, **k: timed(_label, lambda: _fn(*a, **k), args.device))
    query = measure_app.app_query(args.device, args.weights, args.model)
    at = measure_app._app({**query, "preset": "pace-4-8"})
    measure_app._checked(at.run())
    timed("load", lambda: measure_app.app_model(query), args.device)
    for visit in range(1, args.visits + 1):
        measure_app._forget()
        timed(f"VISIT {visit} of pages/{args.page}.py",
              lambda: measure_app._checked(at.switch_page(f"pages/{args.page}.py").run()), args.device)
        at.switch_page("pages/overview.py").run()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local folder or hub id (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"],
                        help="the weights' dtype, as the app's sidebar offers (default float32)")
    parser.add_argument("--only", choices=["drift", "generation"], default=None,
                        help="profile only the drift or only the generation (default both)")
    parser.add_argument("--page", default=None, help="a page's stem (e.g. drift): its visits broken down instead")
    parser.add_argument("--visits", type=int, default=3, help="--page: visits, results dropped in between")
    args = parser.parse_args()
    if args.page is not None:
        return page_visits(args)
    dev = args.device
    model = timed("load", lambda: load_model(args.model, dtype=args.weights, device=dev), dev)
    if args.only != "generation":
        profile_drift(model, dev)
    if args.only != "drift":
        samples = timed("calibration samples", lambda: calibration_samples(model, tokens=512, sample_every=32), dev)
        high = timed("calibrate", lambda: calibrate(model, get_config("pace-4-8"), samples=samples), dev).config
        prompt = " ".join(read_text(CALIBRATION_TEXT)[:2000].split())[:400]
        generations(model, prompt, {"pace-4": get_config("pace-4"),
                                    **{n: get_config(n) for n in ("rtn-int4", "rtn-int8")}, "pace-4-8": high}, dev)
    return 0


def profile_drift(model, dev: str) -> None:
    """Drift of three decode periods (cold, warm under cProfile), a recompute and one configuration each."""
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
        timed(
            f"drift one config dP{p}",
            lambda one=one: drift(model, one, ids, 256, every=8, reference=result.reference),
            dev,
        )


if __name__ == "__main__":
    sys.exit(main())
