"""app_state.warmup: what is compiled ahead for the sidebar's configuration, that the warm-up runs the views'
computations, and that it starts once per model and configuration, on a GPU only."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
import torch

from app_state import warmup
from pace_core.config import get_config
from pace_core.model import DEFAULT_MODEL_DIR


def test_the_plan_is_the_drift_pages_curves_and_the_neighbouring_widths():
    assert [(c.bits, c.decode_period) for c in warmup.plan(get_config("pace-4"))] == [
        (4, 1), (4, 8), (4, 16), (3, 8), (5, 8)]
    assert [(c.bits, c.decode_period) for c in warmup.plan(get_config("rtn-int8"))] == [(8, 1), (8, 2), (7, 1)]
    assert all(c.method == "pace" and c.group_axis == "key" for c in warmup.plan(get_config("pace-4")))
    assert warmup.plan(get_config("fp32")) == []


@pytest.fixture(scope="module")
def embedded():
    from pace_core.model.loading import load_model

    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        pytest.skip("no embedded model")
    return load_model(None)


def test_the_warm_up_runs_the_views_computations(embedded, monkeypatch):
    """Drift with captures, generation and the fp32 reference's states, each on every configuration of the plan
    (PACE-4/8's calibrated first), here on the CPU at a few tokens."""
    calls = []
    for name in ("drift", "generate_side_by_side", "run_with_states"):
        original = getattr(warmup, name)

        def spy(*args, name=name, original=original, **kwargs):
            calls.append((name, args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(warmup, name, spy)
    cfgs = warmup.plan(get_config("pace-4-8"))[:2]
    warmup.warm(embedded, cfgs, prefill=16, steps=8, new_tokens=2)
    assert [c[0] for c in calls] == ["drift", "generate_side_by_side", "run_with_states"]
    drifted = calls[0][1][1]
    assert [c.decode_period for c in drifted] == [1, 8] and all(c.high_heads is not None for c in drifted)
    assert list(calls[1][1][1]) == [c.name for c in cfgs]


def test_it_starts_once_per_model_and_configuration_on_a_gpu_only(embedded, monkeypatch):
    assert warmup.ahead(embedded, get_config("pace-4"), "pace-4") is None  # the CPU: nothing compiles
    on_gpu = dataclasses.replace(embedded, device=torch.device("cuda", 0))
    ran, done = [], threading.Event()
    monkeypatch.setattr(warmup, "warm", lambda loaded, cfgs: (ran.append([c.name for c in cfgs]), done.set()))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    thread = warmup.ahead(on_gpu, get_config("pace-4"), "pace-4")
    assert thread is not None and thread.daemon
    thread.join(10)
    assert done.is_set() and ran == [[c.name for c in warmup.plan(get_config("pace-4"))]]
    assert warmup.ahead(on_gpu, get_config("pace-4"), "pace-4") is None  # once
    assert warmup.ahead(on_gpu, get_config("fp32"), "fp32") is None  # nothing to warm


def test_a_failed_warm_up_is_logged_and_changes_nothing(embedded, monkeypatch, caplog):
    on_gpu = dataclasses.replace(embedded, device=torch.device("cuda", 0))

    def fail(loaded, cfgs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(warmup, "warm", fail)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    with caplog.at_level("WARNING", logger=warmup.LOG.name):
        thread = warmup.ahead(on_gpu, get_config("rtn-int4"), "rtn-int4 fails")
        thread.join(10)
    assert "kernel warm-up" in caplog.text and "out of memory" in caplog.text
