"""Kernels compiled before the user's first click (issue 43.5).

On a fresh GPU host each live view's first run compiles the Triton kernels it launches (seconds each, tens of
seconds for a view: a 4B model's Drift page took 29 s the first time and 3 s the next). Once a model is loaded on a
GPU, :func:`ahead` starts one background thread that runs, through the library, what the live views run first for
the sidebar's configuration and its neighbours (:func:`plan`): the Drift page's default curves (teacher-forced
decode with captures), a few tokens of generation (the one-token decode path), the heatmaps' fp32 reference (a
prefill with captures). Their results are dropped; what stays is the compiled kernels and their launch plans (Triton's
caches, per process and on disk), so the views' first runs find them. The thread runs once per loaded model and
configuration, never on the CPU (nothing there compiles); its failure is logged and changes nothing else. Each of
its steps holds the model's turn in the background (:mod:`app_state.turns`): it never computes beside a page, stops
at its next progress unit when a page asks for the model, and runs again once the pages are done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from app_state import turns
from pace_core.analysis.calibration import calibrate
from pace_core.analysis.drift import drift
from pace_core.analysis.generation import generate_side_by_side
from pace_core.analysis.text import CALIBRATION_TEXT, tokenize
from pace_core.config import PaceConfig, get_config
from pace_core.model.capture import run_with_states
from pace_core.model.loading import LoadedModel
from pace_core.quant import BITS_RANGE

LOG = logging.getLogger(__name__)

DRIFT_PREFILL, DRIFT_STEPS, DRIFT_CAPTURES = 256, 256, 32
"""The Drift page's defaults (pages/drift.py, app_state.compute.DRIFT_CAPTURES): the same token counts launch the
same kernel specialisations."""
GENERATED_TOKENS = 4
WARM_TEXT = "The history of the city begins in the year when the river was first crossed by a bridge of stone. " * 40
"""Text for the warm-up's runs (its words do not matter, its token counts do)."""

_STARTED: set[tuple[int, str]] = set()
_LOCK = threading.Lock()
T = TypeVar("T")


def plan(cfg: PaceConfig) -> list[PaceConfig]:
    """The configurations warmed for ``cfg``: the Drift page's default curves (dP 1, the sidebar's dP and twice it,
    at its bits) and the neighbouring bit widths at its dP (a slider step away), each once; nothing for a
    configuration that does not quantise."""
    if not cfg.quantized:
        return []
    dps = sorted({1, cfg.decode_period, 2 * cfg.decode_period})
    bits = [b for b in (cfg.bits - 1, cfg.bits + 1) if b in BITS_RANGE]
    found = {}
    for b, p in [(cfg.bits, p) for p in dps] + [(b, cfg.decode_period) for b in bits]:
        variant = cfg.replace(name=f"{b}-bit dP{p}", bits=b, decode_period=p)
        found.setdefault((b, p), variant)
    return list(found.values())


def warm(loaded: LoadedModel, cfgs: list[PaceConfig], *, prefill: int = DRIFT_PREFILL, steps: int = DRIFT_STEPS,
         new_tokens: int = GENERATED_TOKENS) -> None:
    """Run what the live views run first for ``cfgs`` on ``loaded`` (module docstring), results dropped. A
    configuration that needs a calibration on the model is calibrated on a short text first."""
    turn = turns.of(loaded.model)
    ready = [_step(turn, lambda p, c=c: calibrate(loaded, c, str(CALIBRATION_TEXT), tokens=256, sample_every=32,
                                                  progress=p).config)
             if c.needs_calibration else c for c in cfgs]
    ids = tokenize(loaded.tokenizer, WARM_TEXT, max_tokens=prefill + steps + 1, min_tokens=prefill + 3)
    every = -(-steps // DRIFT_CAPTURES)
    _step(turn, lambda p: drift(loaded, ready, ids, prefill, every=every, progress=p))
    _step(turn, lambda p: generate_side_by_side(loaded, {c.name: c for c in ready}, WARM_TEXT[:48],
                                                max_new_tokens=new_tokens, modes=("greedy",), progress=p))
    _step(turn, lambda p: run_with_states(loaded, get_config("fp32"), ids[:, :prefill],
                                          capture_steps=[prefill // 2, prefill]))  # one prefill: no progress


def _step(turn: turns.Turn, run: Callable[[Callable[[int], None]], T]) -> T:
    """``run(progress)`` holding the model's turn in the background (:meth:`app_state.turns.Turn.background`),
    again from its start each time a page made it yield."""
    while True:
        with turn.background():
            try:
                return run(turn.yield_to_pages)
            except turns.Yielded:
                continue


def ahead(loaded: LoadedModel, cfg: PaceConfig, key: str) -> threading.Thread | None:
    """Start :func:`warm` for :func:`plan` of ``cfg`` (``key``: the configuration's identity, e.g. its JSON) in a
    background thread, once per loaded model and configuration, on a GPU only; returns the thread (None when
    nothing starts)."""
    if loaded.device.type != "cuda":
        return None
    with _LOCK:
        if (id(loaded), key) in _STARTED:
            return None
        _STARTED.add((id(loaded), key))
    cfgs = plan(cfg)
    if not cfgs:
        return None

    def run() -> None:
        try:
            with torch.cuda.device(loaded.device):
                warm(loaded, cfgs)
        except Exception:  # the views run and report their own failures; a warm-up only saves them time
            LOG.warning("kernel warm-up of %s failed", [c.name for c in cfgs], exc_info=True)

    thread = threading.Thread(target=run, name="pace-warmup", daemon=True)
    thread.start()
    return thread
