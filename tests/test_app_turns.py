"""app_state.turns: one computation at a time on a loaded model, the pages' before the background warm-up; and the
Head ranking page computing its calibration while the warm-up runs on the same model (on a GPU the two computing
at once failed: "'NoneType' object is not a mapping", "lazy wrapper should be called at most once")."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from app_support import REPO_ROOT, tiny_checkpoint
from streamlit.testing.v1 import AppTest

from app_state import compute, turns, warmup
from app_state.controls import MODELS_DIR_ENV, Runtime
from app_state.session import _load_model
from pace_core.analysis.calibration import calibrate
from pace_core.analysis.text import CALIBRATION_TEXT
from pace_core.config import get_config
from pace_core.export import config_from_json

WAIT_S = 60


def _started(target, *args) -> tuple[threading.Thread, list[BaseException]]:
    """``target(*args)`` in a thread; the list gets its exception, if any."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            target(*args)
        except BaseException as err:  # reported by the test
            failures.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures


def _until(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_a_background_step_waits_for_a_page_and_yields_to_one():
    turn, events, lock = turns.Turn(), [], threading.Lock()
    holding, release = threading.Event(), threading.Event()

    def log(event: str) -> None:
        with lock:
            events.append(event)

    def page() -> None:
        with turn.page():
            log("page")
            holding.set()
            release.wait(WAIT_S)

    def step() -> None:
        """A background step of endless progress units, run again after it yielded once; it ends at its second."""
        yielded = 0
        while yielded < 2:
            with turn.background():
                log("step")
                try:
                    while True:
                        turn.yield_to_pages(1)
                        time.sleep(0.001)
                except turns.Yielded:
                    yielded += 1
                    log("yielded")

    first, failures = _started(page)
    assert holding.wait(WAIT_S)
    background, background_failures = _started(step)
    time.sleep(0.2)
    assert events == ["page"]  # a page holds the turn: the step waits
    release.set()
    first.join(WAIT_S)
    assert _until(lambda: events == ["page", "step"])
    holding.clear()
    release.clear()
    second, second_failures = _started(page)
    assert holding.wait(WAIT_S)  # the step gave the turn up at its next progress unit
    assert events == ["page", "step", "yielded", "page"]
    release.set()
    second.join(WAIT_S)
    assert _until(lambda: events.count("step") == 2)  # and ran again once the page was done
    third, third_failures = _started(page)
    third.join(WAIT_S)
    background.join(WAIT_S)
    assert not (failures or background_failures or second_failures or third_failures)
    assert events == ["page", "step", "yielded", "page", "step", "yielded", "page"]


def test_pages_compute_one_after_the_other_and_a_thread_takes_its_turn_again():
    turn, inside, most, lock = turns.Turn(), [0], [0], threading.Lock()

    def page() -> None:
        for _ in range(20):
            with turn.page():
                with turn.page():  # the same thread again: a calibration inside a drift run
                    with lock:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.001)
                    with lock:
                        inside[0] -= 1

    runs = [_started(page) for _ in range(3)]
    for thread, _ in runs:
        thread.join(WAIT_S)
    assert not any(failures for _, failures in runs) and not any(t.is_alive() for t, _ in runs)
    assert most[0] == 1


def test_every_model_has_one_turn():
    class Model:
        pass

    a, b = Model(), Model()
    assert turns.of(a) is turns.of(a) and turns.of(a) is not turns.of(b)


@pytest.fixture
def tiny_source(tmp_path_factory, monkeypatch) -> str:
    """A seeded random checkpoint in a fresh folder (no calibration stored for it), offered to the app."""
    folder = tiny_checkpoint(tmp_path_factory.mktemp("turns") / "tiny-qwen35").resolve()
    monkeypatch.setenv(MODELS_DIR_ENV, str(folder.parent))
    return str(folder)


def test_head_ranking_computes_alone_while_the_warm_up_runs(tiny_source):
    """The warm-up's first forward is held until the page asks for the model: the page waits for its turn (with the
    turns; without them both forwards ran at once), the warm-up yields, the page's calibration is the one computed
    alone, and the warm-up then runs to its end."""
    if not Path(CALIBRATION_TEXT).is_file():
        pytest.skip("no calibration text (the shared corpus)")
    where = Runtime("cpu", "float32")
    loaded = _load_model(tiny_source, where)  # the app's own cached load: the page computes on this model
    warm_thread = threading.current_thread()
    forwards, active, most, lock = [], set(), [0], threading.Lock()
    page_forward, warm_forward = threading.Event(), threading.Event()

    def page_waits() -> bool:
        try:
            turns.of(loaded.model).yield_to_pages()
        except turns.Yielded:
            return True
        return False

    def before(module, args) -> None:
        me = threading.current_thread()
        with lock:
            active.add(me)
            most[0] = max(most[0], len(active))
            forwards.append("warm-up" if me is warm_thread else "page")
        if me is not warm_thread:
            page_forward.set()
        elif not warm_forward.is_set():  # hold the warm-up's first forward until a page asks for the model
            warm_forward.set()
            deadline = time.monotonic() + WAIT_S
            while not (page_forward.is_set() or page_waits()) and time.monotonic() < deadline:
                time.sleep(0.005)

    def after(module, args, output) -> None:
        with lock:
            active.discard(threading.current_thread())

    hooks = [loaded.model.register_forward_pre_hook(before),
             loaded.model.register_forward_hook(after, always_call=True)]
    try:
        cfgs = warmup.plan(get_config("pace-4-8"))[:2]

        def warm() -> None:
            nonlocal warm_thread
            warm_thread = threading.current_thread()
            warmup.warm(loaded, cfgs, prefill=16, steps=8, new_tokens=2)

        thread, failures = _started(warm)
        assert warm_forward.wait(WAIT_S)
        at = AppTest.from_file(str(REPO_ROOT / "app.py"), default_timeout=180)
        for k, v in {"model": tiny_source, "device": where.device, "weights": where.weights,
                     "preset": "pace-4-8"}.items():
            at.query_params[k] = v
        at.run()
        at.switch_page("pages/head_ranking.py").run()
        thread.join(WAIT_S)
    finally:
        for hook in hooks:
            hook.remove()
    assert not [e.value for e in at.exception] and not [e.value for e in at.error]
    assert not thread.is_alive() and not failures, failures
    assert most[0] == 1, f"{most[0]} forwards ran at once"
    # the warm-up's held forward, the page's calibration, then the warm-up again from the step it yielded
    assert forwards[0] == "warm-up" and "page" in forwards and forwards[-1] == "warm-up"
    first_page, last_page = forwards.index("page"), len(forwards) - 1 - forwards[::-1].index("page")
    assert set(forwards[first_page:last_page + 1]) == {"page"}

    cfg = config_from_json(compute.calibration_key(get_config("pace-4-8")))
    alone = calibrate(loaded, cfg, tokens=compute.CALIBRATION_TOKENS, sample_every=compute.CALIBRATION_EVERY)
    table = at.dataframe[0].value.sort_values(["layer", "head"])
    # the same code on the same inputs; the intra-op threads may differ (a sum's order): float64 of float32 states
    np.testing.assert_allclose(table["a_h"].to_numpy(), alone.a.flatten().numpy(), rtol=1e-6)
    np.testing.assert_allclose(table["e_h"].to_numpy(), alone.e.flatten().numpy(), rtol=1e-6)
