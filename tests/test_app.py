"""The dashboard with streamlit's AppTest: every page renders without exception, and moving a
control changes what is shown (asserted on the shown values against pace_core computed here)."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from app_support import REPO_ROOT, app_model_param, plain
from conftest import BROKEN_CHECKPOINTS
from numerics import fp32_bound, rel
from streamlit.testing.v1 import AppTest

from app_state import compute, controls, exporting, frame, session, stored
from pace_core.accounting import capacity, resident_bits, state_bytes, state_bytes_per_sequence
from pace_core.analysis.structure import structure_stats
from pace_core.analysis.text import tokenize
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.export import config_to_json, document_from_json, used_settings
from pace_core.figures import MIB
from pace_core.heads import num_high_heads
from pace_core.methods import METHODS
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model
from pace_core.quant import QuantSpec, fake_quantize
from pace_core.shapes import BUILTIN_SHAPES

APP = str(REPO_ROOT / "app.py")


@pytest.fixture(scope="module")
def params(tmp_path_factory) -> dict[str, str]:
    return app_model_param(tmp_path_factory.mktemp("app_model"))


@pytest.fixture(scope="module")
def loaded(params):
    return load_model(params.get("model"))


@pytest.fixture
def bars(monkeypatch) -> list[list[int]]:
    """Every progress bar the app opens (app_state.work.progress), as ``[total, units done]``."""
    from app_state import work

    real, opened = work.progress, []

    @contextlib.contextmanager
    def counting(total: int, text: str, key):
        opened.append([total, 0])
        entry = opened[-1]
        with real(total, text, key) as advance:
            def count(n: int) -> None:
                entry[1] += n
                advance(n)

            yield count

    monkeypatch.setattr(work, "progress", counting)
    return opened


def filled(bars: list[list[int]]) -> None:
    """Each bar ended at its total: the total announced (and so the time left shown) was the work done."""
    assert bars and all(done == total for total, done in bars), bars


def start(params: dict[str, str], page: str | None = None, **query: str) -> AppTest:
    """A fresh session of the app with `query` in the URL, switched to pages/<page>.py, without an error."""
    at = opened(params, page, **query)
    check(at)
    return at


def opened(params: dict[str, str], page: str | None = None, **query: str) -> AppTest:
    """A fresh session of the app with `query` in the URL, switched to pages/<page>.py."""
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in {**params, **query}.items():
        at.query_params[k] = v
    at.run()
    if page is not None:
        at.switch_page(f"pages/{page}.py").run()
    return at


def check(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [plain(e.value) for e in at.error]


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if plain(m.label) == label]
    assert found, f"no metric {label!r}; have {[plain(m.label) for m in at.metric]}"
    return found[0]


def array(value) -> np.ndarray:
    """A plotly JSON array (a list or a typed array {dtype, bdata, shape}) as numpy."""
    if isinstance(value, dict):
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        return flat.reshape([int(n) for n in str(value.get("shape", len(flat))).split(",")])
    return np.asarray(value)


def chart(at: AppTest, key: str) -> dict:
    return json.loads(at.get("plotly_chart")[[c.key for c in at.get("plotly_chart")].index(key)].proto.spec)


def test_url_values_are_validated_and_fall_back(params):
    at = start(params, preset="pace-4", bits="11", dp="0", axis="diagonal", device="tpu", pad="later",
               weights="fp8")
    warnings = " ".join(plain(w.value) for w in at.warning)
    assert "allowed: flush, carry" in warnings and "allowed: float32, bfloat16" in warnings
    for name in ("'bits'", "'dp'", "'axis'", "'device'", "'pad'", "'weights'"):
        assert f"URL parameter {name}" in warnings
    assert "allowed: 2, 3, 4, 5, 6, 7, 8" in warnings
    assert at.sidebar.select_slider(key="w_bits").value == 4
    assert at.sidebar.selectbox(key="w_axis").value == "key"
    assert at.query_params["bits"] == ["4"] or at.query_params["bits"] == "4"


def test_combination_controls_follow_the_methods_that_take_them(params):
    """The combinations' controls (stochastic rounding, key rotation, static scales) are enabled for the methods
    that compose with them; a method that does not take one gets its default, so the sidebar stays valid."""
    takes = {"rnd": {"rtn", "pace", "dsq", "damp"}, "seed": {"rtn", "pace", "dsq", "damp"},
             "kh": {"rtn", "pace", "dsq"}, "sc": {"rtn", "pace"}, "mg": {"rtn", "pace"}}
    for key, methods in takes.items():
        assert {m for m in METHODS if controls.enabled(controls.CONTROL_BY_KEY[key], m)} == methods
    at = start(params, preset="pace-4-sr", kh="1", method="stepquant")
    assert at.sidebar.selectbox(key="w_rnd").value == "stochastic" and at.sidebar.toggle(key="w_kh").value
    active = next(c.value for c in at.sidebar.caption if c.value.startswith("Active:"))
    assert at.sidebar.selectbox(key="w_rnd").disabled and "**custom**" in active
    at.sidebar.select_slider(key="w_method").set_value("pace").run()
    check(at)
    assert str(at.query_params["rnd"]).strip("[]'") == "stochastic" and not at.sidebar.selectbox(key="w_rnd").disabled


def test_url_sets_the_controls_and_controls_write_the_url(params):
    at = start(params, page="export", preset="pace-4-8", bits="3", dp="16", sym="1", pad="carry")
    assert at.sidebar.select_slider(key="w_bits").value == 3
    assert at.sidebar.select_slider(key="w_dp").value == 16
    assert at.sidebar.selectbox(key="w_pad").value == "carry"
    doc = json.loads(at.code[0].value)
    assert doc["state_cache_scheme"]["num_bits"] == 3 and doc["pace"]["decode_period"] == 16
    assert doc["pace"]["prefill_after_decode"] == "carry"
    at.sidebar.select_slider(key="w_dp").set_value(32).run()
    check(at)
    assert str(at.query_params["dp"]).strip("[]'") == "32"
    assert json.loads(at.code[0].value)["pace"]["decode_period"] == 32


def test_weights_in_bfloat16_are_a_sidebar_choice_with_their_own_model_and_results(params):
    """weights=bfloat16 in the URL loads the model's weights in bfloat16 (a model of its own beside the
    float32 one), the pages compute on it, and the choice stays in the URL and the sidebar."""
    from app_state import controls

    at = start(params, page="state_heatmaps", weights="bfloat16")
    assert at.sidebar.selectbox(key="w_weights").value == "bfloat16"
    assert str(at.query_params["weights"]).strip("[]'") == "bfloat16"
    source = params.get("model", "")
    assert session._load_model(source, controls.Runtime("cpu", "bfloat16")).dtype == torch.bfloat16
    bf16_map = chart(at, "heat_chart")["data"][0]["z"]
    at.sidebar.selectbox(key="w_weights").set_value("float32").run()
    check(at)
    assert "weights" not in at.query_params
    assert session._load_model(source, controls.Runtime("cpu", "float32")).dtype == torch.float32
    assert not np.array_equal(array(chart(at, "heat_chart")["data"][0]["z"]), array(bf16_map))


def test_a_page_that_fails_says_so_and_the_log_keeps_where(caplog):
    """A page's own failure (not a PaceError) is shown with what to do, the app keeps running, and the server's log
    holds its traceback for the report the message asks for."""

    def page():
        from app_state.frame import run_page

        def body(cfg):
            raise ValueError(f"a failure of the page's own at {cfg.bits} bits")

        run_page(body)

    at = AppTest.from_function(page, default_timeout=180).run()
    assert not at.exception and "This page failed: ValueError: a failure of the page's own" in plain(at.error[0].value)
    logged = [r for r in caplog.records if r.name == "pace_studio" and r.exc_info]
    assert len(logged) == 1 and "a failure of the page's own at 4 bits" in str(logged[0].exc_info[1])
    assert "in body" in caplog.text


def test_a_model_that_failed_to_load_is_not_retried_on_every_change(tmp_path, monkeypatch):
    """A path or hub id that fails (offline, a hub id takes about 30 s to fail) is shown as failed on the
    next changes, tried again at once when its folder changes, and on "Try again"."""
    calls = []
    real = session._load_model
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(tmp_path))  # a link opens folders of the models folder
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["model"] = str(tmp_path / "nowhere")
    at.run()
    assert not at.exception and "Could not load model" in plain(at.error[0].value) and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    assert "Could not load model" in plain(at.error[0].value) and len(calls) == 1
    (tmp_path / "nowhere").mkdir()  # the folder changed: tried at once (still not a checkpoint)
    at.sidebar.select_slider(key="w_bits").set_value(5).run()
    assert "Could not load model" in plain(at.error[0].value) and len(calls) == 2
    (tmp_path / "nowhere" / "config.json").write_text("{")  # a file appears: tried again
    at.sidebar.select_slider(key="w_bits").set_value(6).run()
    assert "Could not load model" in plain(at.error[0].value) and len(calls) == 3
    at.button(key="load_try_again").click().run()
    assert not at.exception and len(calls) == 4


def test_a_load_failure_of_any_kind_is_remembered(params, monkeypatch):
    """Not only PaceErrors: whatever a load raises is shown and not retried on the next rerun."""
    calls = []

    def failing(source, where):
        calls.append(source)
        raise RuntimeError("the loader broke")

    monkeypatch.setattr(session, "_load_model", failing)
    at = AppTest.from_file(APP, default_timeout=180)
    for key, value in params.items():
        at.query_params[key] = value
    at.switch_page("pages/state_heatmaps.py").run()
    assert not at.exception and "RuntimeError: the loader broke" in plain(at.error[0].value) and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    assert "RuntimeError: the loader broke" in plain(at.error[0].value) and len(calls) == 1


@pytest.mark.parametrize("broken", list(BROKEN_CHECKPOINTS))
def test_a_broken_checkpoint_is_shown_once_and_not_loaded_again(broken_checkpoints, broken, monkeypatch):
    """Every way a checkpoint breaks (tests/conftest.py) is one error naming the problem, whatever the exception
    was; reruns and other pages show it without loading again (a 27B model would reload on every click)."""
    folder, message = broken_checkpoints[broken]
    calls = []
    real = session._load_model
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(folder.parent))  # a link opens folders of the models folder
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["model"] = str(folder)
    at.run()
    assert not at.exception and [message in plain(e.value) for e in at.error] == [True] and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    at.switch_page("pages/drift.py").run()
    assert not at.exception and [message in plain(e.value) for e in at.error] == [True] and len(calls) == 1


def test_out_of_memory_is_recognised():
    assert frame._out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert frame._out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert frame._out_of_memory(MemoryError())
    assert not frame._out_of_memory(RuntimeError("shape mismatch")) and not frame._out_of_memory(ValueError())


def test_overview_state_memory_follows_the_sequence_slider(params, loaded):
    at = start(params)
    assert metric(at, "GDN layers") == str(loaded.shape.num_gdn_layers)
    fp32 = state_bytes(get_config("fp32"), loaded.shape, 64) / MIB
    assert metric(at, "fp32 state, N = 64") == f"{fp32:,.2f} MiB"
    at.slider(key="overview_n").set_value(128).run()
    check(at)
    assert metric(at, "fp32 state, N = 128") == f"{state_bytes(get_config('fp32'), loaded.shape, 128) / MIB:,.2f} MiB"
    pace4 = state_bytes(get_config("pace-4"), loaded.shape, 128) / MIB
    assert metric(at, "pace-4 state, N = 128") == f"{pace4:,.2f} MiB"


def test_overview_and_memory_read_the_card_instead_of_loading_the_model(params, loaded, tmp_path, monkeypatch):
    """A folder without a card is loaded once, which stores its card; from then on the Overview and the
    Memory page (a new session, a restarted server) show the card and load nothing."""
    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))  # no card here yet
    calls = []
    session._load_model.clear()  # a load earlier in this process would not store a card here
    session._stored_card.clear()
    real = session._load_model
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    at = start(params)
    assert len(calls) == 1 and len(list(tmp_path.rglob("model_card-*.json"))) == 1
    real.clear()  # a restarted server: no model loaded, no card read yet
    session._stored_card.clear()
    for page in (None, "memory"):
        at = start(params, page=page)
        assert len(calls) == 1, f"{page or 'overview'} loaded the model"
    assert at.selectbox(key="memory_shape").value.endswith("(sidebar model)")
    at = start(params)
    assert metric(at, "GDN layers") == str(loaded.shape.num_gdn_layers)
    assert metric(at, "Parameters") == f"{loaded.shape.weight_params / 1e6:.1f} M"
    summary = at.dataframe[0].value["value"]  # the architecture summary, the page's first table
    assert summary["params"] == str(loaded.summary()["params"]) and "dtype" not in summary.index
    assert len(calls) == 1


def test_memory_table_follows_the_bits_control(params, loaded):
    at = start(params, page="memory", preset="pace-4")
    table = at.dataframe[0].value.set_index("config")
    assert table.loc["sidebar: pace-4", "resident"] == pytest.approx(
        resident_bits(get_config("pace-4"), loaded.shape).resident_bits)
    at.sidebar.select_slider(key="w_bits").set_value(6).run()
    check(at)
    table = at.dataframe[0].value.set_index("config")
    expected = resident_bits(get_config("pace-4").replace(bits=6), loaded.shape)
    assert table.loc["sidebar: custom", "payload"] == pytest.approx(expected.payload_bits)
    assert table.loc["sidebar: custom", "resident"] == pytest.approx(expected.resident_bits)


def test_each_width_shows_its_cost_before_the_user_moves_to_it(params, loaded):
    """Issue 48: the sidebar's line under the state bits, the Memory page's table of widths and the capacity
    planner's give each width's resident bits, state bytes and sequences from the accounting (every width stored
    densely: a bit less is a real saving), the sidebar's width marked."""
    at = start(params, page="memory", preset="pace-4")
    cfg = get_config("pace-4")
    line = next(c.value for c in at.sidebar.caption if c.value.startswith("Each width with these settings"))
    for b in range(2, 9):
        bits = resident_bits(cfg.replace(bits=b), loaded.shape).resident_bits
        assert f"{b} → {bits:.2f} bits" in line
    assert "**4 → " in line and "**3 → " not in line
    widths = next(d.value for d in at.dataframe if "current" in d.value.columns and "sequences" not in d.value.columns)
    assert widths["bits"].tolist() == list(range(2, 9)) and widths.set_index("bits").loc[4, "current"]
    for b, row in widths.set_index("bits").iterrows():
        assert row["resident bits"] == pytest.approx(resident_bits(cfg.replace(bits=b), loaded.shape).resident_bits)
        assert row["state KiB / sequence"] * 1024 == state_bytes_per_sequence(cfg.replace(bits=b), loaded.shape)
    assert widths["resident bits"].is_monotonic_increasing  # each bit less is saved
    planner = next(d.value for d in at.dataframe if "current" in d.value.columns and "sequences" in d.value.columns)
    shape = loaded.shape
    for b, row in planner.set_index("bits").iterrows():
        assert row["sequences"] == capacity(cfg.replace(bits=b), shape, int(141e9), weight_bits=16,
                                            context=8192).sequences
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    check(at)
    line = next(c.value for c in at.sidebar.caption if c.value.startswith("Each width with these settings"))
    assert "**3 → " in line and "**4 → " not in line
    at.sidebar.select_slider(key="w_method").set_value("none").run()
    assert not at.exception and any(c.value == "A reference state has no code width." for c in at.sidebar.caption)


def test_memory_page_shows_the_measured_apply_bytes(params, tmp_path, monkeypatch):
    """The measured table (scripts/measure_memory.py's JSON) is shown as stored, with the code that made it (here a
    file written before pace_core.provenance: ``commit`` and ``worktree_dirty``), and a damaged file is named."""
    doc = {"kind": "apply_memory", "provenance": {"model": "m", "device": "cpu", "batch": 4, "commit": "abc",
                                                  "worktree_dirty": False},
           "rows": [{"config": "fp32", "resident_bits": 32.0, "state_bytes_accounted": 4 << 20,
                     "state_bytes_held": 4 << 20, "saving_vs_fp32": 1.0, "cache_bytes_held": 5 << 20,
                     "decode_step_peak_bytes": 1 << 20},
                    {"config": "pace-4", "resident_bits": 5.03, "state_bytes_accounted": 1 << 20,
                     "state_bytes_held": 1 << 20, "saving_vs_fp32": 4.0, "cache_bytes_held": 2 << 20,
                     "decode_step_peak_bytes": 2 << 20}]}
    (tmp_path / "memory_cpu.json").write_text(json.dumps(doc))
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = start(params, page="memory", preset="pace-4")
    table = next(d.value for d in at.dataframe if "state MiB (held)" in d.value.columns).set_index("configuration")
    assert table.loc["pace-4", "state MiB (held)"] == 1.0 and table.loc["pace-4", "× fewer than fp32"] == 4.0
    assert any("; code abc, " in plain(c.value) and "memory_cpu.json" in plain(c.value) for c in at.caption)
    (tmp_path / "memory_cuda.json").write_text("{not json")
    at.run()
    assert not at.exception and [plain(e.value) for e in at.error if "memory_cuda.json" in plain(e.value)]


def test_capacity_planner_numbers_are_the_accounting(params):
    at = start(params, page="memory", preset="pace-4")
    at.selectbox(key="plan_model").set_value("qwen3.5-27b").run()
    at.selectbox(key="plan_weights").set_value("fp8 (8 bits)").run()
    at.number_input(key="plan_context").set_value(4096).run()
    check(at)
    shape = BUILTIN_SHAPES["qwen3.5-27b"]
    caps = {
        n: capacity(get_config(n), shape, int(141e9), weight_bits=8, context=4096) for n in ("fp32", "bf16", "pace-4")
    }
    assert metric(at, "max sequences, fp32") == f"{caps['fp32'].sequences:,}"
    assert metric(at, "max sequences, bf16") == f"{caps['bf16'].sequences:,}"
    assert metric(at, "max sequences, chosen: pace-4") == f"{caps['pace-4'].sequences:,}"
    assert metric(at, "gain over bf16 states") == f"{caps['pace-4'].sequences / caps['bf16'].sequences:.2f}×"
    assert caps["pace-4"].sequences > caps["bf16"].sequences > caps["fp32"].sequences
    fig = chart(at, "plan_chart")
    assert fig["layout"]["xaxis"]["title"]["text"] == "concurrent sequences N"
    at.selectbox(key="plan_gpu").set_value("custom").run()
    at.number_input(key="plan_gb").set_value(20.0).run()  # the 27B weights in fp8 alone take ~27 GB
    assert not at.exception and any("leave no room" in plain(w.value) for w in at.warning)


def test_state_heatmap_opens_on_the_strongest_outlier_head_and_says_which_axis_wins(params, loaded):
    at = start(params, page="state_heatmaps", preset="pace-4")
    text = at.text_area(key="heat_text").value
    end = int(at.select_slider(key="heat_pos").value)
    ids = tokenize(loaded.tokenizer, text, max_tokens=end, min_tokens=1)
    states = run_with_states(loaded, get_config("fp32"), ids, capture_steps=[end]).states[end]
    ratios = {(layer, h): float(r) for layer, S in states.items()
              for h, r in enumerate(structure_stats(S[0]).col_ratio)}
    best = max(ratios.values())
    layer, head = at.selectbox(key="heat_layer").value, at.slider(key="heat_head").value
    assert ratios[(layer, head)] == pytest.approx(best, rel=1e-3)  # one prefill vs another: fp32 rounding
    assert any(w in plain(c.value) for c in at.caption
               for w in ("Key-axis groups win here", "Value-axis groups win here"))


def test_state_heatmap_shows_the_quantisation_error_of_the_reference_state(params, loaded):
    at = start(params, page="state_heatmaps", preset="pace-4")
    text = at.text_area(key="heat_text").value
    positions = at.select_slider(key="heat_pos").options
    position = int(positions[len(positions) // 3])
    at.select_slider(key="heat_pos").set_value(position).run()
    at.selectbox(key="heat_layer").set_value(loaded.gdn_layers[0]).run()
    at.slider(key="heat_head").set_value(1).run()
    check(at)
    # the page's state is the reference's after `position` tokens, read in one prefill with the other
    # positions: against a prefill of that prefix alone, float32 rounding of the chunked recurrence
    ids = tokenize(loaded.tokenizer, text, max_tokens=position, min_tokens=1)
    layer = loaded.gdn_layers[0]
    S_ref = run_with_states(loaded, get_config("fp32"), ids, capture_steps=[position]).states[position][layer][0, 1]
    fig = chart(at, "heat_chart")
    assert f"after {position} tokens" in fig["layout"]["title"]["text"]
    S = torch.tensor(array(fig["data"][0]["z"]), dtype=torch.float32)
    assert rel(S, S_ref) <= fp32_bound(position * loaded.shape.d_k * 8)

    def shown_error(bits: int, axis: str) -> str:  # the error of the state shown, with the sidebar's quantiser
        q = fake_quantize(S, QuantSpec(bits=bits, symmetric=True, axis=axis, group_size=64))
        return f"{float(torch.linalg.norm(q - S) / torch.linalg.norm(S)):.3%}"

    assert metric(at, "relative error, key-axis g=64") == shown_error(4, "key")
    assert metric(at, "relative error, value-axis g=64") == shown_error(4, "value")
    at.sidebar.select_slider(key="w_bits").set_value(8).run()
    check(at)
    assert metric(at, "relative error, key-axis g=64") == shown_error(8, "key")


def test_state_heatmap_of_a_one_token_text(params):
    at = start(params, page="state_heatmaps", preset="pace-4")
    at.text_area(key="heat_text").set_value("a").run()
    check(at)
    assert "after 1 tokens" in chart(at, "heat_chart")["layout"]["title"]["text"]


def test_generations_reference_agrees_with_itself_and_length_follows_slider(params, bars):
    at = start(params, page="generations", preset="rtn-int4")
    at.multiselect(key="gen_others").set_value([]).run()
    at.slider(key="gen_tokens").set_value(6).run()
    check(at)
    summary = at.dataframe[0].value
    assert list(summary["configuration"]) == ["fp32", "sidebar: rtn-int4"]
    assert summary["top-1 agreement"][0] == 1.0              # the fp32 row scores its own greedy tokens
    assert summary["first divergence"][0] == "none"
    html_before = [h.proto.body for h in at.get("html")]
    prompt = at.text_area(key="gen_prompt").value
    assert not prompt.rstrip().endswith(".")  # stops mid-sentence
    at.slider(key="gen_tokens").set_value(12).run()
    check(at)
    assert [h.proto.body for h in at.get("html")] != html_before
    filled(bars)


def test_generations_show_a_stored_run_per_mode(params, loaded, tmp_path, monkeypatch):
    pieces = [[" the", " cat"], [" the", " dog"], [" a", " cat"], [" a", " cat"]]
    table = pd.DataFrame({"mode": ["greedy", "greedy", "sampled", "sampled"], "config": ["fp32", "pace-4"] * 2,
                          "tokens": [[1, 2], [1, 3], [4, 2], [4, 2]], "pieces": pieces,
                          "text": ["".join(p) for p in pieces], "first_divergence": pd.array([None, 1, None, None],
                                                                                             dtype="Int64"),
                          "ref_nll": [1.5, 2.5, 1.25, 1.25], "ref_agreement": [1.0, 0.5, 1.0, 1.0]})
    _store("generation", params, loaded, table, monkeypatch, tmp_path, {"prompt": "Once upon a time"})
    at = start(params, page="generations")
    stored = [plain(o) for o in at.radio(key="gen_source").options if plain(o).startswith("stored: ")]
    assert stored == [o for o in stored if "“Once upon a time” · fp32, pace-4" in o] and len(stored) == 1
    at.radio(key="gen_source").set_value(stored[0]).run()
    check(at)
    assert [plain(h.value) for h in at.subheader if plain(h.value) in ("greedy", "sampled")] == ["greedy", "sampled"]
    greedy, sampled = at.dataframe[0].value, at.dataframe[1].value
    assert list(greedy["first divergence"]) == ["none", "token 1"] and list(greedy["NLL (nats/token)"]) == [1.5, 2.5]
    assert list(sampled["first divergence"]) == ["none", "none"]
    bodies = [h.proto.body for h in at.get("html")]
    assert len(bodies) == 4 and "dog" in bodies[1] and "dog" not in bodies[0]
    assert len(at.columns) >= 2 and "dog" in at.columns[1].get("html")[0].proto.body  # side by side
    assert "differs from token 1 on" in [c.value for c in at.columns[1].caption]
    assert any("degenerate continuation" in plain(c.value) for c in at.caption)
    assert any("`python -m pace_core generation --n 1`" in plain(c.value) for c in at.caption)


def test_benchmarks_without_results_say_what_to_run(params, tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = start(params, page="benchmarks")
    assert "No benchmark results yet" in plain(at.info[0].value) and stored.BENCH_COMMAND in plain(at.info[0].value)


def test_benchmarks_lead_with_a_headline_table_in_units(params, tmp_path, monkeypatch):
    rows = [{"batch": b, "variant": v, "seconds_per_token": t0 * b * 1e-6, "hbm_fraction": f}
            for v, t0, f in (("bf16 per-token", 50, 0.5), ("PACE-4 dP=8", 20, 0.25)) for b in (1, 8)]
    code = {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": True}  # pace_core.provenance.measurement's
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-11-30", "code": code,
                                                     "rows": rows}))
    (tmp_path / "a_list.json").write_text("[1, 2]")  # sorts first: a bad file must not hide the others
    (tmp_path / "b_bytes.json").write_bytes(b"\xff\xfe")
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    at.switch_page("pages/benchmarks.py").run()
    assert not at.exception
    assert [plain(e.value).split(":")[0] for e in at.error] == ["a_list.json", "b_bytes.json"]
    assert plain(at.subheader[0].value).startswith("Decode step of 24 GDN layers")
    assert at.json[0].value == json.dumps({"device": "NVIDIA H200", "date": "2026-11-30", "code": code})
    assert any(c.value.startswith("Measured on device NVIDIA H200, date 2026-11-30, code 0123456789ab with uncommitted "
                                  "changes · file") for c in at.caption)
    headline = at.dataframe[1].value.set_index("variant")  # after the lead table of speed-ups
    assert headline.loc["bf16 per-token", "B = 8"] == "400.0 µs · 50% HBM"
    assert headline.loc["PACE-4 dP=8", "B = 8"] == "160.0 µs · 2.50× · 25% HBM"  # 400 / 160
    table = at.dataframe[2].value
    assert list(table["time per token (µs)"]) == pytest.approx([50.0, 400.0, 20.0, 160.0])
    fig = chart(at, "bench_bench_rows_seconds_per_token")
    assert [t["name"] for t in fig["data"]] == ["bf16 per-token", "PACE-4 dP=8"]
    assert fig["layout"]["yaxis"]["title"]["text"] == "time per token (µs)"


def test_export_preview_import_and_load(params):
    at = start(params, page="export", preset="pace-4")
    exported = document_from_json(at.code[0].value)
    assert exported.config == used_settings(get_config("pace-4")) and exported.model_info["gdn_layers"]
    serve = at.code[1].value  # the vllm serve line for the same file and model
    assert serve.startswith(f"vllm serve {exported.model_info['source']} --enforce-eager --no-enable-prefix-caching")
    assert json.loads(serve.split("--additional-config ")[1].strip("'")) == {"pace_config": "pace-4.json"}
    measured = next(plain(c.value) for c in at.caption if "vllm_cpu.json" in plain(c.value))  # the shipped vLLM figures
    assert (
        f"pace-4-8 {json.loads((REPO_ROOT / 'data/bench/vllm_cpu.json').read_text())['rows'][-1]['teacher_forced']:.1%}"
        in measured
    )
    served = next(d.value for d in at.dataframe if "burst wall time ×" in d.value.columns)  # vllm_serve_cpu.json
    stored = json.loads((REPO_ROOT / "data/bench/vllm_serve_cpu.json").read_text())["ratios"]
    assert list(served["burst wall time ×"]) == [round(r["wall_ratio"], 2) for r in stored if r["concurrency"] == 64]
    assert at.get("download_button")[0].proto.label == "Download pace-4.json"
    at.text_area(key="export_paste").set_value('{"schema_version": 99}').run()
    assert at.error and "schema_version" in plain(at.error[0].value)
    assert not at.exception
    imported = get_config("rtn-int5").replace(decode_period=4, name="mine")
    at.text_area(key="export_paste").set_value(config_to_json(imported)).run()
    check(at)
    assert "Valid configuration 'mine'" in plain(at.success[0].value) and not at.warning
    at.text_area(key="export_paste").set_value(config_to_json(imported.replace(decode_period=100))).run()
    assert "Decode period dP (tokens) = 100" in plain(at.warning[0].value)
    at.text_area(key="export_paste").set_value(config_to_json(imported)).run()
    at.button(key="export_load").click().run()
    check(at)
    assert at.sidebar.select_slider(key="w_bits").value == 5
    assert at.sidebar.selectbox(key="w_axis").value == "value"
    assert document_from_json(at.code[0].value).config == used_settings(imported)  # its name kept
    at.sidebar.select_slider(key="w_bits").set_value(4).run()
    assert document_from_json(at.code[0].value).config.name == "custom"  # changed: no longer the import


def test_imported_heads_must_fit_the_model_and_memory_takes_calibrated_heads(params, loaded):
    """Heads that do not fit the loaded model are refused on import (nothing to load); heads that do fit
    are kept, and the Memory page, which also shows other models' shapes, works with them."""
    L, HV = loaded.shape.num_gdn_layers, loaded.shape.num_v_heads
    at = start(params, page="export", preset="pace-4-8")
    wrong = get_config("pace-4-8").replace(name="wrong", high_heads=((0,), (999,)))
    at.text_area(key="export_paste").set_value(config_to_json(wrong)).run()
    assert not at.exception and "Not accepted: high_heads has 2 layers" in plain(at.error[0].value)
    assert not at.success and "export_load" not in [b.key for b in at.button]
    n = num_high_heads(0.25, HV)
    fitting = get_config("pace-4-8").replace(name="fitting", high_heads=tuple(tuple(range(n)) for _ in range(L)))
    at.text_area(key="export_paste").set_value(config_to_json(fitting)).run()
    check(at)
    at.button(key="export_load").click().run()
    check(at)
    assert document_from_json(at.code[0].value).config.high_heads == fitting.high_heads
    at.switch_page("pages/memory.py").run()
    check(at)
    assert at.dataframe[0].value["config"][0] == "sidebar: pace-4-8"  # with its calibrated heads


def test_an_invalid_sidebar_is_said_at_the_top_and_export_offers_no_file(params):
    """Method damp with key-axis groups: the reason heads the page (before its title), the views fall back to
    the named configuration, and Export offers no file (not the preset's), only the reason; a valid
    combination is offered again."""
    at = opened(params, page="export", method="damp", axis="key")
    assert not at.exception
    main = list(at.main)
    title = next(i for i, e in enumerate(main) if type(e).__name__ == "Title")
    top = [plain(e.value) for e in main[:title] if type(e).__name__ == "Error"]
    assert len(top) == 1 and "group_axis='key' is not allowed for method 'damp'" in top[0]
    assert "Nothing to export" in plain(at.main.error[1].value) and not at.get("download_button") and not at.code
    at.sidebar.selectbox(key="w_axis").set_value("value").run()
    check(at)
    assert at.get("download_button")[0].proto.label == "Download custom.json"
    assert document_from_json(at.code[0].value).config.method == "damp"


def _paste(at: AppTest, doc: dict | str) -> AppTest:
    return at.text_area(key="export_paste").set_value(doc if isinstance(doc, str) else json.dumps(doc)).run()


def test_import_admits_as_every_path_does(params, loaded):
    """A pasted file is admitted against the loaded model: pace.bits = 99, a file for another model (other
    weights, other layer count) or with sections that disagree is refused with the reason and nothing to
    load; a path pasted is not read; the same file made for this model is taken."""
    import dataclasses

    from pace_core.export import export_document

    at = start(params, page="export", preset="pace-4")

    def exported(shape=loaded.shape, fingerprint=loaded.fingerprint) -> dict:
        return export_document(get_config("rtn-int5").replace(name="mine", decode_period=4), shape=shape,
                               source=loaded.source, weights_fingerprint=fingerprint)

    layers = loaded.shape.num_layers + 4
    more = dataclasses.replace(loaded.shape, num_layers=layers, num_gdn_layers=loaded.shape.num_gdn_layers + 3,
                               gdn_layers=loaded.shape.gdn_layers + tuple(range(layers - 3, layers)))
    bits = exported()
    bits["pace"]["bits"] = 99
    layout = exported()
    layout["state_layout"]["groups_along"] = "key"
    for doc, message in [(bits, "pace.bits is not allowed"), (exported(fingerprint="0" * 16), "other weights"),
                         (exported(more), f"num_layers {layers} in the file, {loaded.shape.num_layers} in the model"),
                         (layout, "state_layout.groups_along='key' contradicts"),
                         (str(REPO_ROOT / "README.md"), "not valid JSON")]:
        _paste(at, doc)
        assert not at.exception and not at.success, message
        assert plain(at.error[-1].value).startswith("Not accepted:") and message in plain(at.error[-1].value)
        assert "export_load" not in [b.key for b in at.button]
    _paste(at, exported())
    check(at)
    assert "Valid configuration 'mine' (checked against the loaded model)" in plain(at.success[0].value)
    at.button(key="export_load").click().run()
    check(at)
    assert at.sidebar.select_slider(key="w_bits").value == 5


def test_url_aliases_and_unknown_keys(params):
    """The sidebar's names (dP, P) and the settings' names are URL aliases; unknown keys and a key given twice
    are named in a warning, and the URL is rewritten with the keys the app reads."""
    at = start(params, dP="16", P="128", prefill_after_decode="carry", config="x", Bits="3", bits="5")
    warnings = [plain(w.value) for w in at.warning]
    assert any("URL parameter 'config' is unknown and was ignored; allowed: preset, model" in w for w in warnings)
    assert any("URL parameter 'bits' is given twice ('Bits' and 'bits'); using Bits = 3" in w for w in warnings)
    assert at.sidebar.select_slider(key="w_dp").value == 16 and at.sidebar.select_slider(key="w_pp").value == 128
    assert at.sidebar.selectbox(key="w_pad").value == "carry" and at.sidebar.select_slider(key="w_bits").value == 3
    url = {k: str(v).strip("[]'") for k, v in at.query_params.items()}
    assert url["dp"] == "16" and url["pp"] == "128" and not {"dP", "P", "config", "Bits"} & set(url)
    aliases = controls.url_aliases()
    for c in controls.CONTROLS:  # every symbol is a word of its label: the name the user reads
        assert aliases[c.field] == c.key and (c.symbol is None or c.symbol in c.label.split())


def test_a_link_opens_only_the_models_the_operator_offers(tiny_checkpoints, monkeypatch):
    """Without a models folder a link opens only the embedded model: a path that exists, one that does not
    and a hub id get the same answer. With one, its folders open by name; a path outside it is refused."""
    monkeypatch.delenv(controls.MODELS_DIR_ENV, raising=False)
    monkeypatch.delenv(controls.ALLOW_HUB_ENV, raising=False)
    answers = set()
    for model in ("/", "/no/such/folder", str(tiny_checkpoints["qwen3_5_text"]), "Qwen/Qwen3.5-4B"):
        at = opened({}, model=model)  # the URL is read on the first run: its warnings are on the first page
        assert not at.exception and at.sidebar.radio(key="w_model_kind").value == controls.EMBEDDED
        assert "model" not in at.query_params
        [warning] = [plain(w.value) for w in at.warning if "'model'" in plain(w.value)]
        assert model not in warning and "Traceback" not in warning
        answers.add(warning)
    assert len(answers) == 1 and "allowed: the embedded model" in answers.pop()
    folder = tiny_checkpoints["qwen3_5_text"].parent
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(folder))
    at = start({}, model="qwen3_5_text")
    assert at.sidebar.radio(key="w_model_kind").value == controls.LOCAL
    assert str(at.query_params["model"]).strip("[]'") == "qwen3_5_text"  # the name, not the server's path
    at = opened({}, model="../" + folder.name + "/../..")
    assert at.sidebar.radio(key="w_model_kind").value == controls.EMBEDDED and at.warning
    # the sidebar follows the same rule once the operator configured a folder
    at.sidebar.radio(key="w_model_kind").set_value(controls.LOCAL).run()
    at.sidebar.text_input(key="w_model_text").input("/").run()
    assert at.sidebar.radio(key="w_model_kind").value == controls.EMBEDDED
    assert any("opens only the models its operator offers" in plain(w.value) for w in at.warning)


def test_model_rules_of_links_and_the_sidebar(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(controls.ALLOW_HUB_ENV, raising=False)
    assert controls.url_model("") == (controls.EMBEDDED, "")
    assert controls.url_model("m") == (controls.LOCAL, "m")
    assert controls.url_model(str(tmp_path / "m")) == (controls.LOCAL, str(tmp_path / "m"))
    assert controls.url_model("Qwen/Qwen3.5-4B")[0] == controls.LOCAL  # no hub: a name in the models folder
    for refused in ("/", "../x", "m/../../x"):
        with pytest.raises(PaceError, match="a link opens only models the operator offers"):
            controls.url_model(refused)
    assert controls.sidebar_model_problem(controls.HUB, "Qwen/Qwen3.5-4B") is not None
    assert controls.sidebar_model_problem(controls.LOCAL, "m") is None
    assert controls.sidebar_model_problem(controls.LOCAL, "/etc") is not None
    monkeypatch.setenv(controls.ALLOW_HUB_ENV, "1")
    assert controls.url_model("Qwen/Qwen3.5-4B") == (controls.HUB, "Qwen/Qwen3.5-4B")
    assert controls.url_model("m") == (controls.LOCAL, "m")  # a folder of the models folder before a hub id
    assert controls.sidebar_model_problem(controls.HUB, "Qwen/Qwen3.5-4B") is None
    monkeypatch.delenv(controls.MODELS_DIR_ENV)
    assert controls.sidebar_model_problem(controls.LOCAL, "/anywhere") is None  # the local user's own choice
    with pytest.raises(PaceError):
        controls.url_model("/anywhere")


def test_head_ranking_follows_dp_and_share(params, loaded, bars):
    at = start(params, page="head_ranking", preset="pace-4-8")
    HV = loaded.shape.num_v_heads

    def check_table(dP: int, share: float) -> None:
        table = at.dataframe[0].value
        np.testing.assert_allclose(table["E_h"], table["e_h"] / (1 - table["a_h"] ** (2 * dP)), rtol=1e-9)
        for _, part in table.groupby("layer"):
            chosen = set(part[part["8-bit"]]["head"])
            top = set(part.sort_values("E_h", ascending=False)["head"][:int(share * HV + 0.5)])
            assert chosen == top

    check_table(8, 0.25)
    E8 = at.dataframe[0].value.sort_values(["layer", "head"])["E_h"].to_numpy()
    at.sidebar.select_slider(key="w_dp").set_value(2).run()
    check(at)
    check_table(2, 0.25)
    assert not np.allclose(at.dataframe[0].value.sort_values(["layer", "head"])["E_h"].to_numpy(), E8)
    at.sidebar.select_slider(key="w_hi").set_value(0.5).run()
    check(at)
    check_table(2, 0.5)
    assert metric(at, "8-bit heads per layer") == f"{int(0.5 * HV + 0.5)} of {HV}"
    assert all(done == total for total, done in bars), bars  # the calibration may be kept from an earlier test
    table = at.dataframe[0].value
    at.button(key="heads_use").click().run()
    at.switch_page("pages/export.py").run()
    check(at)
    heads = json.loads(at.code[0].value)["pace"]["high_heads"]
    expected = [sorted(table[(table.layer == layer) & table["8-bit"]]["head"]) for layer in loaded.gdn_layers]
    assert [heads[str(layer)] for layer in loaded.gdn_layers] == [  # keyed by decoder layer, GDN ordinal beside
        {"gdn_layer": i, "heads": h} for i, h in enumerate(expected)]


def test_drift_shows_the_analysis_and_follows_the_step_slider(params, loaded, bars):
    from pace_core.analysis.drift import drift

    at = start(params, page="drift", preset="pace-4")
    at.slider(key="drift_steps").set_value(16).run()
    check(at)
    fig = chart(at, "drift_chart")
    names = ["pace-4, 4-bit, dP 1", "pace-4, 4-bit, dP 8", "pace-4, 4-bit, dP 16"]
    assert [t["name"] for t in fig["data"]] == [n for n in names for _ in range(2)]
    assert ", ".join(names) in fig["layout"]["title"]["text"]
    assert array(fig["data"][0]["x"]).max() == 16            # steps 0 (right after the prefill) .. 16
    prefill = at.slider(key="drift_prefill").value
    ids = tokenize(loaded.tokenizer, compute.analysis_text(), max_tokens=prefill + 16 + 1)
    ref = drift(loaded, {"dP 8": get_config("pace-4").replace(name="4-bit dP8")}, ids, prefill).table
    # the page may run the reference apart from a configuration (a batch of another size): float32
    # rounding, which can move a 4-bit rounding boundary of a state entry, so agreement to a small share
    np.testing.assert_allclose(array(fig["data"][2]["y"]), ref["rel_error"].to_numpy(), rtol=1e-2)
    np.testing.assert_allclose(array(fig["data"][3]["y"]), ref["excess_nll"].to_numpy(), rtol=1e-2, atol=1e-4)
    at.multiselect(key="drift_periods_8").set_value([8]).run()
    check(at)
    assert [t["name"] for t in chart(at, "drift_chart")["data"]] == ["pace-4, 4-bit, dP 8"] * 2
    filled(bars)


def test_drift_pickers_follow_the_sidebar(params):
    """The page's own bits and dP start from the sidebar's, also after the sidebar changes."""
    at = start(params, page="drift", preset="pace-4")
    at.slider(key="drift_steps").set_value(8).run()
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    at.sidebar.select_slider(key="w_dp").set_value(9).run()
    check(at)
    names = [t["name"] for t in chart(at, "drift_chart")["data"]]
    assert names == [f"custom, 3-bit, dP {p}" for p in (1, 9, 18) for _ in range(2)]


def test_drift_shows_stored_results_with_provenance(params, loaded, tmp_path, monkeypatch):
    from pace_core.results import make_provenance, result_key, save_result

    rng = np.random.default_rng()
    table = pd.DataFrame({"config": ["rtn-int4"] * 5 + ["pace-4"] * 5, "step": list(range(5)) * 2,
                          "rel_error": rng.random(10), "excess_nll": rng.standard_normal(10)})
    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    name = stored.results_model_name(params.get("model", ""))
    for n, weights in ((1, loaded.fingerprint), (2, "0" * 16)):  # the second: other weights, same model name
        prov = make_provenance("m", configs=[get_config("pace-4")], command=f"python -m pace_core drift --tokens {n}",
                               extra={"weights": weights})
        for config in ("pace-4", "rtn-int4"):  # stored in another order than the named configurations'
            part = table[table.config == config].reset_index(drop=True)
            summary = {"config": config, "mean_rel_error": float(part.rel_error.mean()),
                       "final_rel_error": float(part.rel_error.iloc[-1]), "mean_excess_nll": 0.0}
            save_result("drift", name, result_key({"n": n, "config": config}),
                        {"summary": summary, "params_key": f"set {n}", "config": config, "decode_from": 4,
                         "tokens": 8}, prov, part)
    stored.stored_sets.clear()          # the listing is cached for 30 s; this test just wrote two sets
    at = start(params, page="drift", preset="pace-4")
    options = [plain(o) for o in at.radio(key="drift_source").options if plain(o).startswith("stored: ")]
    assert len(options) == 1 and options[0].startswith("stored: rtn-int4, pace-4")
    at.radio(key="drift_source").set_value(options[0]).run()
    check(at)
    assert any("`python -m pace_core drift --tokens 1`" in plain(c.value) for c in at.caption)
    fig = chart(at, "drift_chart")
    assert [t["name"] for t in fig["data"]] == ["rtn-int4", "rtn-int4", "pace-4", "pace-4"]
    # the state error's log axis is labelled in % (d3's percent type), and each panel's axis names its quantity
    assert fig["layout"]["yaxis"]["type"] == "log" and fig["layout"]["yaxis"]["tickformat"].endswith("p")
    assert fig["layout"]["yaxis"]["title"]["text"] == "relative state error (%, log scale)"
    assert fig["layout"]["yaxis2"]["title"]["text"] == "excess NLL over fp32 (nats per token)"
    np.testing.assert_allclose(array(fig["data"][2]["y"]), table.rel_error[5:].to_numpy())
    assert list(at.dataframe[0].value["mean_rel_error"]) == [float(table.rel_error[:5].mean()),
                                                            float(table.rel_error[5:].mean())]


PER_CONFIG_KINDS = ("drift", "perplexity", "generation")


def _store(kind: str, params, loaded, table: pd.DataFrame, monkeypatch, tmp_path, data: dict | None = None) -> None:
    """Save ``table`` (and ``data``) as a ``kind`` result of the loaded weights, and another of other
    weights under the same model name (which the app must leave out). Drift, perplexity and generation
    results are stored as the CLI stores them: one result per configuration of the table, one set."""
    from pace_core.results import make_provenance, result_key, save_result

    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    name = stored.results_model_name(params.get("model", ""))
    for n, weights in ((1, loaded.fingerprint), (2, "0" * 16)):
        prov = make_provenance("m", configs=[get_config("pace-4")], command=f"python -m pace_core {kind} --n {n}",
                               extra={"weights": weights})
        part = table.iloc[::n]
        if kind not in PER_CONFIG_KINDS:
            save_result(kind, name, result_key({"n": n}), data or {}, prov, part)
            continue
        for config in part["config"].unique():
            rows = part[part["config"] == config].reset_index(drop=True)
            if kind == "perplexity":  # stored as its row, as the CLI does
                extra, rows = {"row": rows.to_dict("records")[0], "decode_from": 1}, None
            else:
                extra = {}
            save_result(kind, name, result_key({"n": n, "config": config}),
                        {**(data or {}), **extra, "params_key": f"set {n}", "config": config}, prov, rows)
    stored.stored_results.clear()  # the listings are cached for 30 s
    stored.stored_sets.clear()


def test_overview_shows_stored_perplexity_with_provenance(params, loaded, tmp_path, monkeypatch):
    rng = np.random.default_rng()
    nll = rng.random(3) + 3
    table = pd.DataFrame({"config": ["fp32", "rtn-int4", "pace-4"], "tokens": [99] * 3, "nll": nll,
                          "ppl": np.exp(nll), "agreement": [1.0, *rng.random(2)], "kl": [0.0, *(rng.random(2) / 100)],
                          "bpb": rng.random(3) + 1})
    _store("perplexity", params, loaded, table, monkeypatch, tmp_path)
    at = start(params)
    assert at.selectbox(key="overview_quality_run").options == [
        at.selectbox(key="overview_quality_run").value]  # only the loaded weights' run
    assert at.selectbox(key="overview_quality_run").value.endswith("fp32, rtn-int4, pace-4")
    assert any("`python -m pace_core perplexity --n 1`" in plain(c.value) for c in at.caption)
    shown = [d.value for d in at.dataframe if "ppl" in d.value.columns]  # AppTest keeps no dataframe keys
    assert len(shown) == 1
    pd.testing.assert_frame_equal(shown[0].reset_index(drop=True), table)


def test_overview_without_stored_quality_says_what_to_run(params, tmp_path, monkeypatch):
    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    stored.stored_results.clear()
    stored.stored_sets.clear()
    at = start(params)
    assert any("python -m pace_core perplexity" in plain(c.value) for c in at.caption)
    assert not [d for d in at.dataframe if "ppl" in d.value.columns]


def test_only_stale_and_damaged_results_stored(params, loaded, tmp_path, monkeypatch):
    """Results of another method version are shown labelled stale with the command that recomputes them (the
    drift page keeps live first); a damaged file is named in a warning, with what to do, and the page works."""
    from pace_core import results
    from pace_core.version import METHOD_VERSION

    rng = np.random.default_rng(11)
    nll = rng.random(2) + 3
    ppl = pd.DataFrame({"config": ["fp32", "rtn-int4"], "tokens": [99] * 2, "nll": nll, "ppl": np.exp(nll),
                        "agreement": [1.0, 0.9], "kl": [0.0, 0.01], "bpb": [1.1, 1.2]})
    made = results.make_provenance
    monkeypatch.setattr(results, "make_provenance", lambda *a, **k: {
        **made(*a, **k), "method_version": METHOD_VERSION - 1, "code": {"commit": "c0ffee" * 7, "dirty": False}})
    _store("perplexity", params, loaded, ppl, monkeypatch, tmp_path)
    folder = results.results_dir(stored.results_model_name(params.get("model", "")))
    damaged = folder / f"drift-{'d' * 16}.json"
    damaged.write_text("{not json")
    at = start(params)
    assert at.selectbox(key="overview_quality_run").value.startswith(stored.STALE)
    warning = [plain(w.value) for w in at.warning if "stale: made by method version" in plain(w.value)]
    assert warning == [f"stale: made by method version {METHOD_VERSION - 1} (code c0ffeec0ffee; the current method "
                       f"version is {METHOD_VERSION}), recompute with `python -m pace_core perplexity --n 1`. Its "
                       "numbers may not be what the current code computes."]
    shown = [d.value for d in at.dataframe if "ppl" in d.value.columns]
    pd.testing.assert_frame_equal(shown[0].reset_index(drop=True), ppl)
    at = start(params, page="drift", preset="pace-4")
    assert at.radio(key="drift_source").value.startswith("live")  # live stays the first choice
    [named] = [plain(w.value) for w in at.warning if str(damaged) in plain(w.value)]
    assert named.startswith("A stored drift result is damaged and not shown: ") and "not a readable JSON" in named
    assert "Delete it, or recompute it with" in named and chart(at, "drift_chart")


def test_memory_plots_a_stored_sweep_and_follows_the_error_choice(params, loaded, tmp_path, monkeypatch):
    rng = np.random.default_rng()
    table = pd.DataFrame({"config": [f"b{b}-{a}" for b in (3, 4) for a in ("key", "value")], "bits": [3, 3, 4, 4],
                          "decode_period": [8] * 4, "group_axis": ["key", "value"] * 2, "group_size": [32] * 4,
                          "buffer": ["int8"] * 4, "resident_bits": rng.random(4) * 8 + 1,
                          "output_rel_error": rng.random(4), "mean_rel_error": rng.random(4),
                          "final_rel_error": rng.random(4), "prefill_rel_error": rng.random(4)})
    _store("sweep", params, loaded, table, monkeypatch, tmp_path,
           {"steps": {}, "tokens": 64, "decode_tokens": 16, "mode": "layer-local"})
    at = start(params, page="memory")
    assert len(at.selectbox(key="memory_sweep").options) == 1
    fig = chart(at, "memory_sweep_chart")
    assert [t["name"] for t in fig["data"]] == ["3-bit, key groups", "3-bit, value groups", "4-bit, key groups",
                                               "4-bit, value groups"]
    np.testing.assert_allclose(np.concatenate([array(t["y"]) for t in fig["data"]]), table["output_rel_error"])
    at.radio(key="memory_sweep_error").set_value("final_rel_error").run()
    check(at)
    fig = chart(at, "memory_sweep_chart")
    np.testing.assert_allclose(np.concatenate([array(t["y"]) for t in fig["data"]]), table["final_rel_error"])
    np.testing.assert_allclose(np.concatenate([array(t["x"]) for t in fig["data"]]), table["resident_bits"])


def test_generations_run_damp_with_its_calibrated_outlier_rows(params):
    at = start(params, page="generations", preset="damp-int4")
    at.multiselect(key="gen_others").set_value([]).run()
    at.slider(key="gen_tokens").set_value(4).run()
    check(at)
    summary = at.dataframe[0].value
    assert list(summary["configuration"]) == ["fp32", "sidebar: damp-int4"]
    assert 0.0 <= summary["top-1 agreement"][1] <= 1.0


def test_a_stopped_computation_waits_until_run_again(params):
    """Stop (app_state.work.progress) leaves the page showing what was stopped; 'Run it' computes it."""
    from app_state import controls

    at = start(params, page="drift", preset="pace-4")
    prefill = at.slider(key="drift_prefill").value
    source, where = params.get("model", ""), controls.Runtime(at.session_state["device"], at.session_state["weights"])
    configs = tuple(controls.config_key(get_config("pace-4").replace(name=f"4-bit dP{p}", decode_period=p))
                    for p in (1, 8, 16))
    at.session_state["_work_stopped"] = ("drift", (source, where, prefill, 24), configs)  # as Stop leaves it
    at.slider(key="drift_steps").set_value(24).run()
    check(at)
    assert any(i.value.startswith("Stopped: Teacher-forcing the fp32 reference") for i in at.info)
    assert not at.get("plotly_chart")
    [resume] = [b for b in at.button if b.label == "Run it"]
    resume.click().run()
    check(at)
    assert array(chart(at, "drift_chart")["data"][0]["x"]).max() == 24


def test_kept_results_are_bounded_and_computed_once():
    from app_state import work

    calls = []

    def compute(missing: dict) -> dict:
        calls.append(sorted(missing))
        return {label: f"result of {text}" for label, text in missing.items()}

    setting = ("test", np.random.default_rng().integers(1 << 30))
    first = work.per_config("test_kind", setting, (("a", "A"), ("b", "B")), compute, max_entries=3)
    again = work.per_config("test_kind", setting, (("b", "B"), ("c", "C"), ("renamed a", "A")), compute)
    assert first == {"a": "result of A", "b": "result of B"} and calls == [["a", "b"], ["c"]]
    assert again == {"b": "result of B", "c": "result of C", "renamed a": "result of A"}
    work.per_config("test_kind", setting, (("d", "D"),), compute)  # a fourth: the least recently used goes
    work.per_config("test_kind", setting, (("b", "B"),), compute)
    assert calls[-1] == ["b"]


def _shown_text(at: AppTest) -> str:
    """Every text the page shows a reader: headings, paragraphs, captions, alerts, metric labels, and the column
    names and text cells of its tables."""
    parts = [e.value for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning",
                                  "success", "error") for e in getattr(at.main, kind)]
    parts += [m.label for m in at.main.metric]
    for table in at.main.dataframe:
        frame = table.value.data if hasattr(table.value, "data") else table.value  # a Styler or a DataFrame
        parts += [str(c) for c in frame.columns] + [v for v in frame.to_numpy().ravel() if isinstance(v, str)]
    return "\n".join(parts)


def _shipped(kind: str):
    """A result of ``kind`` shipped for the embedded model (data/results/pace-tiny-qwen35)."""
    from pace_core.results import list_results

    return list_results(str(REPO_ROOT / "data" / "models" / "pace-tiny-qwen35"), kind).results[0]


def test_export_summarises_what_it_ships_with_a_portable_model(params, loaded, tmp_path, monkeypatch):
    """Resident bits with their terms, KL and agreement of a stored result of the same configuration on these
    weights (which result, its command), the sequences one H200 holds against fp32 and bf16 states; the file and
    the vllm line name the embedded model by its repository path (another folder as the link gave it)."""
    rng = np.random.default_rng(3)
    table = pd.DataFrame({"config": ["fp32", "pace-4"], "tokens": [99, 99], "nll": [3.0, 3.1],
                          "ppl": np.exp([3.0, 3.1]), "agreement": [1.0, 0.97], "kl": [0.0, float(rng.random() / 100)],
                          "bpb": [1.5, 1.6]})
    _store("perplexity", params, loaded, table, monkeypatch, tmp_path)
    at = start(params, page="export", preset="pace-4")
    cfg, shape = get_config("pace-4"), loaded.shape
    rb = resident_bits(cfg, shape)
    assert metric(at, "Resident bits per state value") == f"{rb.resident_bits:.3f}"
    terms = next(plain(c.value) for c in at.caption if plain(c.value).startswith("= payload"))
    assert f"payload {rb.payload_bits:.3f}" in terms and f"metadata {rb.metadata_bits:.3f}" in terms
    assert f"c·dP {rb.buffer_bits:.3f}" in terms
    assert metric(at, "KL to fp32 (nats/token)") == f"{table.kl[1]:.2e}"
    quality = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Top-1 agreement"))
    assert "97.00%" in quality and "over 99 scored tokens" in quality and "the perplexity result of 'pace-4'" in quality
    assert "`python -m pace_core perplexity --n 1`" in quality and "--n 2" not in quality  # not the other weights'
    caps = {
        n: capacity(get_config(n), shape, int(141e9), weight_bits=16, context=8192) for n in ("fp32", "bf16", "pace-4")
    }
    assert metric(at, "Sequences that fit") == f"{caps['pace-4'].sequences:,}"
    gain = next(m for m in at.metric if m.label == "Sequences that fit").proto.delta
    assert gain == f"{caps['pace-4'].sequences / caps['fp32'].sequences:.2f}× fp32 states"
    fits = next(plain(c.value) for c in at.caption
                if plain(c.value).startswith("On one H200 141 GB GPU, 16-bit weights, 8,192"))
    assert f"fp32 states {caps['fp32'].sequences:,}, bf16 states {caps['bf16'].sequences:,}" in fits
    source = document_from_json(at.code[0].value).model_info["source"]
    expected = params.get("model", "data/models/pace-tiny-qwen35")  # a folder outside the repository: as given
    assert source == expected and at.code[1].value.startswith(f"vllm serve {expected} ")
    at.sidebar.select_slider(key="w_bits").set_value(5).run()  # no stored result of this one
    check(at)
    assert metric(at, "KL to fp32 (nats/token)") == "not measured yet"
    run = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Not measured yet"))
    model = f" --model {params['model']}" if params else ""
    assert f"`python -m pace_core perplexity{model} --configs custom.json` with the file below" in run


def test_export_quality_is_matched_by_the_settings_not_the_name(params, loaded, monkeypatch):
    """A perplexity result stored under the name 'pace-4' for other settings is not pace-4's; a claims report's
    row of pace-4's settings under another label is, and it is named."""
    from pace_core.export import config_to_json
    from pace_core.results import Listing, Result, config_hash
    from pace_core.version import METHOD_VERSION

    other = get_config("pace-4").replace(bits=5)
    prov = {"weights": loaded.fingerprint, "method_version": METHOD_VERSION, "command": "cmd", "date": "d"}
    row = {"config": "pace-4", "tokens": 500, "nll": 3.0, "ppl": float(np.exp(3.0)), "agreement": 0.5, "kl": 0.5,
           "bpb": 1.0}
    misnamed = Result("perplexity", "m", "k1", {"config": "pace-4", "row": row, "decode_from": 1},
                      {**prov, "config_hashes": {"pace-4": config_hash(other.replace(name="pace-4"))}})
    report = Result("claims", "m", "k2", {"tokens": 2047, "quality": [
        {"label": "rtn5", "config": config_to_json(other), "kl": 0.25, "agreement": 0.75, "bpb": 1.0},
        {"label": "the same settings", "config": config_to_json(get_config("pace-4").replace(name="x")),
         "kl": 1.25e-3, "agreement": 0.875, "bpb": 1.5}]}, {**prov, "command": "python -m pace_core claims"})
    found = {"perplexity": [misnamed], "claims": [report]}
    monkeypatch.setattr(stored, "stored_results", lambda source, kind, weights: Listing(
        [r for r in found.get(kind, []) if r.provenance["weights"] == weights], []))
    at = start(params, page="export", preset="pace-4")
    assert metric(at, "KL to fp32 (nats/token)") == "1.25e-03"
    quality = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Top-1 agreement"))
    assert "87.50%" in quality and "2,047 scored tokens: the row 'the same settings' of the claims report" in quality
    assert "Also stored" not in quality  # neither the misnamed result nor the row of other settings


def test_memory_fit_table_counts_as_the_planner(params, loaded):
    """The table of every model and GPU gives the planner's number for the planner's model, GPU and configuration,
    at the planner's weights and context (the KV cache counted), and follows them."""
    at = start(params, page="memory", preset="pace-4")
    model = at.selectbox(key="memory_shape").value

    def shown_fit() -> int:
        fits = next(d.value for d in at.dataframe if "KV MiB / sequence" in d.value.columns)
        row = fits[(fits.model == model) & (fits.config == "sidebar: pace-4")].iloc[0]
        return int(row["sequences in H200 141 GB"])

    for weights, bits, context in (("bf16 (16 bits)", 16, 8192), ("fp8 (8 bits)", 8, 0), ("int4 (4 bits)", 4, 2048)):
        at.selectbox(key="plan_weights").set_value(weights).run()
        at.number_input(key="plan_context").set_value(context).run()
        check(at)
        planner = int(metric(at, "max sequences, chosen: pace-4").replace(",", ""))
        expected = capacity(get_config("pace-4"), loaded.shape, int(141e9), weight_bits=bits, context=context).sequences
        assert shown_fit() == planner == expected
    assert any(f"at {2048:,} tokens of context" in plain(c.value) and "int4 (4 bits) weights" in plain(c.value)
               for c in at.caption)


def test_overview_says_paper_names_the_claims_and_explains_its_two_tables(params, loaded, tmp_path, monkeypatch):
    """No "seed" wording; claims (a)-(d) named with what the paper claims; the text tables wrap instead of cutting
    their cells; each quality table says how many tokens it scores and the second sets its count beside the
    first's."""
    claims = _shipped("claims")
    nll = np.array([3.0, 3.2])
    table = pd.DataFrame({"config": ["fp32", "pace-4"], "tokens": [4096] * 2, "nll": nll, "ppl": np.exp(nll),
                          "agreement": [1.0, 0.96], "kl": [0.0, 0.003], "bpb": [1.5, 1.6]})
    _store("perplexity", params, loaded, table, monkeypatch, tmp_path)
    _store("claims", params, loaded, claims.table, monkeypatch, tmp_path, claims.data)
    at = start(params)
    text = _shown_text(at)
    assert not re.search(r"\bseeds?\b", text, re.IGNORECASE), re.findall(r".{40}\bseeds?\b.{40}", text, re.I)
    assert "The paper's claims and ours, measured, with their spread" in [plain(s.value) for s in at.subheader]
    names = next(d.value for d in at.dataframe if "the paper claims" in d.value.columns)
    assert [c[:3] for c in names["claim"]] == ["(a)", "(b)", "(c)", "(d)", "(e)"]
    assert "every token" in names["the paper claims"][0] and "key axis" in names["the paper claims"][1]
    assert "E_h" in names["the paper claims"][2] and "dP grows" in names["the paper claims"][3]
    assert "Ours, not the paper's" in names["the paper claims"][4] and "STEPQuant-4" in names["tested here as"][4]
    results = next(d.value for d in at.dataframe if "margin" in getattr(d.value, "data", d.value).columns)
    results = getattr(results, "data", results)
    assert set(results["claim"]) == {
        "(a) Periodic rounding", "(b) Channel-aligned (key-axis) groups", "(c) Head-level precision (PACE-4/8)",
        "(d) Drift against dP", "(e) PACE vs STEPQuant at equal bits"}
    for claim, spread, shown in zip(claims.data["claims"], results["spread"], results["verdict"]):
        sp = claim["spread"]  # the shipped report's spread, as measured
        assert spread == (f"[{sp['low']:+.1%}, {sp['high']:+.1%}] over {sp['n']} {sp['unit']}; holds in "
                          f"{sp['holds_share']:.1%} of resamples")
        assert shown in ("holds beyond the spread", "within the spread", "fails beyond the spread")
    for claim, figures in zip(claims.data["claims"], results["figures"]):  # the bits each stores, where reported
        assert all(f"{label}: " in figures for label in claim["labels"])
        assert ("resident_bits" in claim) == (" bits" in figures)
        for bits in claim.get("resident_bits", []):
            assert f"{bits:.2f} bits" in figures
    random = next(c["random"] for c in claims.data["claims"] if c["claim"] == "c")
    assert any(c.value.startswith(f"Claim (c) over its {random['n']} random allocations: their KL "
                                  f"{random['kl_mean']:.2e} ± {random['kl_sd']:.2e}") for c in at.caption)
    for element in at.dataframe:  # the tables of sentences: wide text columns, rows tall enough to wrap their text
        columns = json.loads(element.proto.columns) if element.proto.columns else {}
        if any(c in columns for c in ("what it does", "the paper claims", "figures")):
            assert element.proto.row_height > 64  # Streamlit wraps text only in rows taller than 4rem
            assert all(spec.get("width") for name, spec in columns.items() if name != "_index")
    first = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Table 1,"))
    assert "4,096 scored tokens" in first
    second = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Table 2,"))
    kl = next(r["kl"] for r in claims.data["main"] if r["config"] == "pace-4")
    assert f"over the claims report's {claims.data['tokens']:,} tokens" in second
    assert f"Table 1 above is over 4,096 scored tokens, this one over {claims.data['tokens']:,}" in second
    assert f"pace-4: KL 3.00e-03 in Table 1, {kl:.2e} here" in second
    assert any("`python -m pace_core claims --n 1`" in plain(c.value) for c in at.caption)  # the command that made it


def test_benchmarks_lead_with_the_servers_gain_and_keep_the_dashboards_times_last(params, tmp_path, monkeypatch):
    """The first table is the PACE variants' speed-up over bf16 per-token of the decode step and, end to end under
    torch.compile; the vLLM file says its engine and what it measured; the app's response times come last under
    their own heading."""
    step = [{"batch": b, "variant": v, "seconds_per_token": t * 1e-6} for v, ts in
            (("bf16 per-token", (50, 400)), ("PACE-4 dP=8", (20, 100)), ("PACE-4/8 dP=8", (100, 200)))
            for b, t in zip((1, 8), ts)]
    e2e = [
        {"batch": 128, "variant": v, "tpot_median_s": t} for v, t in (("bf16 per-token", 0.009), ("PACE-4 dP=8", 0.006))
    ]
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": step}))
    (tmp_path / "bench_e2e_compiled.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": e2e}))
    (tmp_path / "app_cpu.json").write_text(json.dumps({"kind": "app_responsiveness", "figures": [
        {"figure": "first_page_s", "median_s": 2.0, "target_s": 10, "met": True}]}))
    (tmp_path / "vllm_cpu.json").write_text((REPO_ROOT / "data" / "bench" / "vllm_cpu.json").read_text())
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = start(params, page="benchmarks")
    assert [plain(h.value) for h in at.header] == [
        "What the state kernels give a server",
        "Every measurement, with its provenance",
        "This dashboard's own response times",
    ]
    lead = at.dataframe[0].value
    lead = getattr(lead, "data", lead).set_index(["measured", "variant"])
    step_label, e2e_label = (
        "GDN decode step (24 layers, Qwen3.5-4B shapes)",
        "end to end under torch.compile (Qwen3.5-4B-sized model)",
    )
    assert lead.loc[(step_label, "PACE-4 dP=8"), "B = 1"] == pytest.approx(2.5)      # 50 / 20
    assert lead.loc[(step_label, "PACE-4 dP=8"), "B = 8"] == pytest.approx(4.0)      # 400 / 100
    assert lead.loc[(step_label, "PACE-4/8 dP=8"), "B = 1"] == pytest.approx(0.5)
    assert lead.loc[(e2e_label, "PACE-4 dP=8"), "B = 128"] == pytest.approx(1.5)
    assert np.isnan(lead.loc[(e2e_label, "PACE-4 dP=8"), "B = 1"])                   # not measured there
    titles = [plain(s.value) for s in at.subheader]
    order = [
        next(i for i, t in enumerate(titles) if t.startswith(p))
        for p in (
            "Decode step",
            "End to end under torch.compile",
            "vLLM serving the PACE state",
            "Dashboard responsiveness",
        )
    ]
    assert order == sorted(order)
    vllm = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Engine: vLLM 0.32.0"))
    assert "Not a speed measurement" in vllm and "pace-tiny-qwen35" in vllm and "python -m pace_core.vllm.check" in vllm


def test_benchmarks_show_each_gpu_calls_folder_with_its_readme_and_nested_figures(params, tmp_path, monkeypatch):
    """A folder of data/bench/ (one GPU machine's calls) comes under its own heading with its README, and a file's
    nested records (the serving harness's per-stage figures) are columns ``stage.figure``; two folders' files of one
    name both show."""
    harness = {"kind": "gpu-serving-harness", "device": "cuda", "results": [
        {"config": c, "checks": {"graph": True}, "decode": {"graph_median_s": t, "graph_ratio_over_bf16": r}}
        for c, t, r in (("bf16", 128e-6, 1.0), ("pace-4", 66e-6, 1.95))]}
    for day in ("h100_2026-12-06", "h100_2026-12-07"):
        (tmp_path / day).mkdir()
        (tmp_path / day / "harness.json").write_text(json.dumps(harness))
    (tmp_path / "h100_2026-12-07" / "README.md").write_text("# Calls of the day\nSession 59: the pool step.")
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H100", "rows": [
        {"batch": 1, "variant": "bf16 per-token", "seconds_per_token": 5e-5}]}))
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = start(params, page="benchmarks")
    assert not at.exception
    assert "GPU calls, one folder each" in [plain(h.value) for h in at.header]
    titles = [plain(s.value) for s in at.subheader]
    assert [t for t in titles if t.startswith("h100_")] == ["h100_2026-12-06", "h100_2026-12-07"]
    assert any("Session 59: the pool step." in m.value for m in at.markdown)
    tables = [getattr(d.value, "data", d.value) for d in at.dataframe]
    nested = [t for t in tables if "decode.graph_ratio_over_bf16" in t.columns]
    assert len(nested) == 2
    assert nested[0].set_index("config").loc["pace-4", "decode.graph_ratio_over_bf16"] == pytest.approx(1.95)
    assert nested[0].set_index("config").loc["bf16", "checks.graph"]


def test_state_heatmap_marks_the_sidebars_groups(params, loaded):
    """The scale-group boundaries of each grouping are drawn on its panels and the sidebar's grouping is named;
    moving the sidebar's axis moves the mark."""
    at = start(params, page="state_heatmaps", preset="pace-4")  # key axis, g = 64

    def lines() -> dict[str, dict]:
        return {
            t["name"]: t for t in chart(at, "heat_chart")["data"] if t.get("mode") == "lines" and t.get("showlegend")
        }

    K = loaded.shape.d_k
    shown = lines()
    key = shown["scale groups of key-axis g=64: 64 key rows (sidebar)"]
    assert [y for y in key["y"] if y is not None] == [b - 0.5 for b in range(64, K, 64) for _ in range(2)]
    assert "scale groups of value-axis g=64: 64 value columns" in shown
    assert any("'(sidebar)'" in plain(c.value) and "key axis" in plain(c.value) for c in at.caption)
    at.sidebar.selectbox(key="w_axis").set_value("value").run()
    check(at)
    assert "scale groups of value-axis g=64: 64 value columns (sidebar)" in lines()
    titles = [a["text"] for a in chart(at, "heat_chart")["layout"]["annotations"]]
    assert "quantised: value-axis g=64 (sidebar)" in titles and "quantised: key-axis g=64" in titles


def test_generations_default_prompt_gives_text_and_shows_seed_and_temperature(params):
    """The default prompt is prose without WikiText's "<unk>" placeholder, the continuations hold none, and on the
    embedded model they are not all the same text; the decoding's seed and temperature are shown."""
    at = start(params, page="generations")
    prompt = at.text_area(key="gen_prompt").value
    assert "<unk>" not in prompt and not prompt.rstrip().endswith(".")
    bodies = [h.proto.body for h in at.get("html")]
    assert bodies and not any("&lt;unk&gt;" in b for b in bodies)
    decoding = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Decoding: **greedy**"))
    assert f"seed {compute.GENERATION_SEED}, temperature 0.8, top-p 0.95" in decoding
    if not params:  # the embedded model: a 4-bit state parts from fp32 within the default 32 tokens
        assert set(at.dataframe[0].value["first divergence"][1:]) != {"none"}
    at.radio(key="gen_mode").set_value("sampled").run()
    check(at)
    assert any(c.value.startswith(f"Decoding: **sampled**. Seed {compute.GENERATION_SEED}, temperature 0.8")
               for c in at.caption)


def test_head_ranking_says_how_to_enable_8_bit_heads_at_share_0(params):
    at = start(params, page="head_ranking", preset="pace-4")
    assert metric(at, "8-bit heads per layer").startswith("0 of")
    [info] = [plain(i.value) for i in at.info if "No head keeps 8 bits" in i.value]
    assert "**Share of 8-bit heads** (sidebar, under Configuration) to 25%" in info and "pace-4-8" in info
    at.sidebar.select_slider(key="w_hi").set_value(0.25).run()
    check(at)
    assert not [i for i in at.info if "No head keeps 8 bits" in i.value]


def _compare_stored(params, loaded, tmp_path, monkeypatch, rng: np.random.Generator) -> dict:
    """A stored comparison of configurations that need no calibration, with random figures, for the loaded weights
    (and one of other weights, which the page leaves out); the card stored beside it by one load."""
    from pace_core.analysis.compare import comparison, point

    names = ["fp32", "bf16", "rtn-int4", "rtn-int8", "pace-4", "qmamba-dsq"]
    kls = [0.0, *np.sort(rng.random(5))[::-1] * 1e-2]  # random KL, larger for the first (fewer bits) mostly
    rng.shuffle(kls[2:])
    points = [point(get_config(n), loaded.shape, {"kl": float(kl), "agreement": float(1 - kl), "bpb": 1.5,
                                                  "ppl": 20.0, "tokens": 4095}) for n, kl in zip(names, kls)]
    data, table = comparison(points)
    data = {**data, "tokens": 4095, "window": 512}
    _store("compare", params, loaded, table, monkeypatch, tmp_path, data)
    return data


def test_compare_says_which_command_makes_its_results(params, tmp_path, monkeypatch):
    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    stored.stored_results.clear()
    at = start(params, page="compare")
    assert "python -m pace_core compare" in plain(at.info[0].value) and not at.get("plotly_chart")
    assert not at.get("download_button")


def test_compare_recommends_the_best_under_a_budget_and_exports_it_without_loading(params, loaded, tmp_path,
                                                                                  monkeypatch):
    from pace_core.analysis.compare import Point, budget_bits, recommendation
    from pace_core.figures import CAPACITY_CONTEXT, CAPACITY_WEIGHT_BITS

    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    data = _compare_stored(params, loaded, tmp_path, monkeypatch, rng)
    session._load_model.clear()  # a load earlier in this process would not store a card here
    session._stored_card.clear()
    start(params)  # one load, which stores the card in this results folder
    calls = []
    real = session._load_model
    real.clear()  # a restarted server: no model loaded
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    session._stored_card.clear()
    files = []  # what the Export page's function wrote for the page
    write = exporting.export_file
    monkeypatch.setattr(exporting, "export_file", lambda *a, **k: files.append(write(*a, **k)) or files[-1])
    at = start(params, page="compare")
    points = {p["config"]: p for p in data["points"]}

    def expected(budget: float) -> str | None:  # the lowest KL that fits, ties: fewer bits
        fits = sorted((p["kl"], p["resident_bits"], name) for name, p in points.items() if p["resident_bits"] <= budget)
        return fits[0][2] if fits else None

    for budget in (3.0, 4.6, 6.0, 9.0, 20.0, 40.0):
        at.number_input(key="compare_bits").set_value(budget).run()
        check(at)
        best = expected(budget)
        if best is None:
            assert "No configuration fits" in plain(at.warning[0].value) and not at.success
            continue
        p = points[best]
        assert plain(at.success[0].value) == recommendation(Point.of(p), get_config(best), loaded.shape, int(141e9),
                                                     "an H200 141 GB", context=CAPACITY_CONTEXT,
                                                     weight_bits=CAPACITY_WEIGHT_BITS)
        assert at.get("download_button")[0].proto.label == f"Export {best}.json"
        exported = document_from_json(files[-1][2])  # the configuration as measured, for the loaded model
        assert exported.config == used_settings(get_config(best)) and files[-1][1] == f"{best}.json"
        assert exported.model_info["weights_fingerprint"] == loaded.fingerprint
        assert exported.model_info["source"] == (params.get("model") or "data/models/pace-tiny-qwen35")
        fig = chart(at, "compare_chart")
        ring = [t for t in fig["data"] if t["name"].startswith("best: ")]
        assert [t["name"] for t in ring] == ([f"best: {best}"] if p["kl"] > 0 else [])
    frontier = next(t for t in chart(at, "compare_chart")["data"] if t["name"] == "frontier")
    on = [name for name in data["frontier"] if points[name]["kl"] > 0]  # fp32's KL 0 is off the log axis
    np.testing.assert_allclose(array(frontier["x"]), [points[n]["resident_bits"] for n in on])
    # a GPU, sequences and context: the budget the states of that many sequences may take
    at.radio(key="compare_budget_kind").set_value("GPU, sequences and context").run()
    at.selectbox(key="compare_gpu").set_value("custom").run()
    at.number_input(key="compare_gb").set_value(1.0).run()
    at.selectbox(key="compare_weights").set_value("fp8 (8 bits)").run()
    at.number_input(key="compare_context").set_value(2048).run()
    for sequences in (1, 50, 400, 5000):
        at.number_input(key="compare_sequences").set_value(sequences).run()
        check(at)
        budget = budget_bits(loaded.shape, 10**9, sequences, context=2048, weight_bits=8)
        assert any(c.value.startswith(f"{budget:.2f} bits per state value") for c in at.caption)
        holds = sorted((p["kl"], p["resident_bits"], name) for name, p in points.items()
                       if capacity(get_config(name), loaded.shape, 10**9, weight_bits=8, context=2048).sequences
                       >= sequences)
        best = holds[0][2] if holds else None
        shown = plain(at.success[0].value) if best is not None else plain(at.warning[0].value)
        assert shown.startswith(f"{best}: ") if best is not None else "No configuration holds" in shown
        if best is not None:
            assert "on 1 GB at 2,048 tokens of context with 8-bit weights" in shown
    assert calls == []  # the stored path: no model loaded


def test_compare_recommends_for_a_gpu_what_its_memory_holds(params, loaded, tmp_path, monkeypatch):
    """GPU mode recommends the lowest KL among the configurations of which the memory holds the sequences by the
    accounting's capacity (issue 46: the page set one sequence's resident bits, which carry what STEPQuant keeps once
    per layer, against the per-sequence budget, and recommended Q-Mamba DSQ of 7x the KL where STEPQuant-4 fits)."""
    from pace_core.analysis.compare import budget_bits, comparison, point
    from pace_core.methods import Calibrated

    shape = loaded.shape
    sq4 = get_config("stepquant-4").replace(calibrated=Calibrated(  # every head at 4 bits
        [{"widths": torch.full((shape.num_v_heads,), 4, dtype=torch.int16),
          "impact": torch.ones(shape.num_v_heads, shape.d_k)}] * shape.num_gdn_layers))
    cfgs = {"fp32": get_config("fp32"), "bf16": get_config("bf16"), "qmamba-dsq": get_config("qmamba-dsq"),
            "stepquant-4": sq4}
    kls = {"fp32": 0.0, "bf16": 1.9e-7, "qmamba-dsq": 1.29e-3, "stepquant-4": 1.82e-4}
    data, table = comparison([point(c, shape, {"kl": kls[n], "agreement": 1 - kls[n], "bpb": 1.5, "ppl": 20.0,
                                               "tokens": 4095}) for n, c in cfgs.items()])
    _store("compare", params, loaded, table, monkeypatch, tmp_path, {**data, "tokens": 4095, "window": 1024})
    session._load_model.clear()
    session._stored_card.clear()
    start(params)  # one load, which stores the card in this results folder
    n = capacity(sq4, shape, 10**9, weight_bits=8, context=2048).sequences
    budget = budget_bits(shape, 10**9, n, context=2048, weight_bits=8)
    # the page's old choice: stepquant-4's resident bits (one sequence) above the per-sequence budget
    assert resident_bits(sq4, shape).resident_bits > budget >= resident_bits(cfgs["qmamba-dsq"], shape).resident_bits
    at = start(params, page="compare")
    at.radio(key="compare_budget_kind").set_value("GPU, sequences and context").run()
    at.selectbox(key="compare_gpu").set_value("custom").run()
    at.number_input(key="compare_gb").set_value(1.0).run()
    at.selectbox(key="compare_weights").set_value("fp8 (8 bits)").run()
    at.number_input(key="compare_context").set_value(2048).run()
    at.number_input(key="compare_sequences").set_value(n).run()
    check(at)
    assert plain(at.success[0].value).startswith("stepquant-4: ") and f"({n:,} against" in at.success[0].value
    holds = {name: capacity(c, shape, 10**9, weight_bits=8, context=2048).sequences for name, c in cfgs.items()}
    most = max(holds, key=lambda name: (holds[name], -kls[name]))  # the most sequences, ties: the lower KL
    for sequences, best in ((n + 1, "qmamba-dsq" if holds["qmamba-dsq"] > n else None), (holds[most] + 1, None)):
        at.number_input(key="compare_sequences").set_value(sequences).run()
        check(at)
        if best is None:
            assert plain(at.warning[0].value).startswith(f"No configuration holds {sequences:,} sequences on 1 GB")
            assert f"the most, {most}, holds {holds[most]:,}" in plain(at.warning[0].value)
        else:
            assert plain(at.success[0].value).startswith(f"{best}: ")


def test_overview_shows_the_perplexity_run_over_the_most_tokens_first(params, loaded, tmp_path, monkeypatch):
    """A newer run over fewer tokens (a compare on a prefix) does not replace the run over the whole text as the
    Overview's Table 1; both are offered."""
    from pace_core.results import make_provenance, result_key, save_result

    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    name = stored.results_model_name(params.get("model", ""))
    for tokens, date in ((360_013, "2026-12-01T00:00:00+00:00"), (4_095, "2026-12-05T00:00:00+00:00")):
        prov = {**make_provenance("m", configs=[get_config("fp32")], command=f"python -m pace_core x --t {tokens}",
                                  extra={"weights": loaded.fingerprint}), "date": date}
        row = {"config": "fp32", "tokens": tokens, "nll": 3.0, "ppl": math.exp(3.0), "agreement": 1.0, "kl": 0.0,
               "bpb": 1.5}
        save_result("perplexity", name, result_key({"t": tokens}), {"row": row, "decode_from": 1,
                                                                     "params_key": f"set {tokens}", "config": "fp32"},
                    prov, None)
    stored.stored_sets.clear()
    at = start(params)
    box = at.selectbox(key="overview_quality_run")
    assert [o.split(" · ")[:2] for o in box.options] == [["2026-12-01T00:00:00+00:00", "360,013 scored tokens"],
                                                         ["2026-12-05T00:00:00+00:00", "4,095 scored tokens"]]
    assert box.value == box.options[0]


def test_a_drift_run_superseded_by_a_dp_change_leaves_nothing_behind(params, monkeypatch):
    """A dP change while Drift computes: streamlit (fast reruns) starts the new run in a new script thread at
    once and stops the old one at its next progress update. Here session 1 computes; at its first progress update
    session 2 (the new run, dP 16) starts and asks for the model's turn (app_state.turns: one computation at a time
    on the shared model; without it the two ran at once and session 2 failed with "Expected size for first two
    dimensions of batch2 tensor to be: [8, 128] but got: [8, 0]"); session 1 is then stopped (StopException, as
    streamlit raises it) and unwinds, session 2 computes and finishes without an error, and session 1 then computes
    with another dP."""
    import threading

    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    from app_state import turns, work

    sessions = []
    for dp in ("8", "16"):  # settings of their own (40 steps): nothing kept from other tests
        at = start(params, preset="pace-4", dp=dp)
        at.session_state["drift_prefill"], at.session_state["drift_steps"] = 24, 40
        at.switch_page("pages/drift.py").run()
        check(at)
        sessions.append(at)
    first, second = sessions
    real, opened, asked = work.progress, [], set()
    second_asks = threading.Event()
    superseding = threading.Thread(target=lambda: second.slider(key="drift_prefill").set_value(32).run())
    page = turns.Turn.page

    @contextlib.contextmanager
    def asking(turn):
        asked.add(threading.get_ident())
        if len(asked) == 2:  # a second thread asks for the turn the first holds
            second_asks.set()
        with page(turn):
            yield

    @contextlib.contextmanager
    def interleaved(total: int, text: str, key):
        session = len(opened)
        opened.append(key)
        with real(total, text, key) as advance:
            def step(n: int) -> None:
                advance(n)
                if session == 0:  # the superseded run: the new one starts and asks for the turn, this one stops
                    superseding.start()
                    assert second_asks.wait(120)
                    raise StopException()

            yield step

    monkeypatch.setattr(turns.Turn, "page", asking)
    monkeypatch.setattr(work, "progress", interleaved)
    first.slider(key="drift_prefill").set_value(32).run()
    superseding.join(300)
    monkeypatch.undo()
    assert not superseding.is_alive() and len(opened) == 2 and len(asked) == 2
    assert not first.exception  # stopped at its progress update, not failed
    check(second)
    assert array(chart(second, "drift_chart")["data"][0]["x"]).max() == 40
    first.sidebar.select_slider(key="w_dp").set_value(4).run()  # dP 4 and 8 computed, dP 1 kept from session 2
    check(first)
    assert [t["name"] for t in chart(first, "drift_chart")["data"]][::2] == [
        f"custom, 4-bit, dP {p}" for p in (1, 4, 8)]  # a setting changed: the configuration is custom


def test_no_page_shows_its_docstrings(params):
    """Streamlit's "magic" writes every bare string literal of a page script (a constant's docstring) into the
    page; .streamlit/config.toml turns it off. Every page is visited and none of its bare strings is shown."""
    import ast

    at = start(params, preset="pace-4")
    for path in sorted((REPO_ROOT / "pages").glob("*.py")):
        literals = {node.value.value.strip() for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)}
        at.switch_page(f"pages/{path.name}").run()
        check(at)
        shown = {m.value.strip() for m in at.markdown}
        assert literals and not literals & shown, (path.name, literals & shown)


HOSTILE = "![i](http://evil.example/i.png) [Fix this](www.evil.example) <img src=x> :material/home: $x$"
"""A URL value or a name that would be a live link, an outside image, HTML, an icon and LaTeX if shown as Markdown."""
ESCAPE = re.compile(r"\\[!-/:-@\[-`{-~]")
"""A backslash escape of an ASCII punctuation character: shown as the character itself."""


def _literal(markdown: str) -> bool:
    """Whether Markdown shows no construct: once its escapes are dropped, no bracket, angle bracket, colon or dollar
    is left to start a link, an image, HTML, a directive, an icon or LaTeX, and no web address to linkify."""
    bare = ESCAPE.sub("", markdown).replace("\u2060", "")
    return not set(bare) & set("[]<>$`") and not re.search(r"(?i)https?://|www\.|:\w", markdown.replace("\\", ""))


def test_a_links_values_are_shown_as_text(params):
    """Every value of a link echoed in a warning (preset, device, weights, a setting, an unknown key) reads as the
    value itself and forms no Markdown (before: `?bits=[Fix this](http://…)` was a live link in the app's own
    warning, `![i](http://…)` an image fetched from another host; the browser test checks the rendering)."""
    at = opened(params, preset=HOSTILE, device=HOSTILE, weights=HOSTILE, bits=HOSTILE, dp=HOSTILE, **{HOSTILE: "1"})
    assert not at.exception and not at.error
    warnings = [w.value for w in at.warning]
    for key in ("preset", "device", "weights", "bits", "dp"):
        [warning] = [w for w in warnings if f"URL parameter '{key}'" in plain(w)]
        assert HOSTILE in plain(warning) and _literal(warning), warning
    [unknown] = [w for w in warnings if "is unknown and was ignored" in plain(w)]
    assert f"URL parameter {HOSTILE!r} is unknown" in plain(unknown) and _literal(unknown)
    active = next(c.value for c in at.sidebar.caption if c.value.startswith("Active:"))
    assert active.startswith("Active: **pace-4** ·")  # the named configuration instead


def test_an_imported_name_that_is_not_a_name_is_refused_and_shown_as_text(params):
    """A file whose configuration name is Markdown is refused by the name rule (pace_core.names), its name shown as
    text (before: accepted as "Valid configuration '![i](…)'" and rendered)."""
    at = start(params, page="export", preset="pace-4")
    doc = json.loads(config_to_json(get_config("rtn-int5").replace(name=HOSTILE)))
    _paste(at, doc)
    assert not at.exception and not at.success and "export_load" not in [b.key for b in at.button]
    error = at.error[-1].value
    assert plain(error).startswith(f"Not accepted: the field pace.name={HOSTILE[:60]!r}… (92 characters) is not "
                                   "allowed; allowed: a configuration name of 1 to 64 characters") and _literal(error)


def test_an_empty_file_and_json_that_is_no_object_get_a_message(params):
    """An empty upload is said to be empty (before: nothing happened); JSON that is not an object is refused with
    what the import takes, JSON only (before: it offered configuration names and paths, which it does not read)."""
    at = start(params, page="export", preset="pace-4")
    at.file_uploader(key="export_upload").set_value(("empty.json", b"", "application/json")).run()
    assert not at.exception and plain(at.error[-1].value) == (
        "Not accepted: the uploaded file empty.json is empty; allowed: a PACE configuration JSON object as the Export "
        "page or `python -m pace_core export` writes it.")
    at.file_uploader(key="export_upload").set_value(None).run()
    for text, what in (("[1,2,3]", "a list"), ('"pace-4"', "a string"), ("3", "a number"), ("null", "null")):
        _paste(at, text)
        shown = plain(at.error[-1].value)
        assert shown == (f"Not accepted: this JSON is {what}, not an object; allowed: a PACE configuration JSON object "
                         "as the Export page or `python -m pace_core export` writes it"), shown
        assert "name" not in shown and "path" not in shown


def _page_protos(at: AppTest) -> str:
    """Everything the page holds as text: each element's and block's message (bodies, labels, values, options,
    help texts, tables' data)."""
    out = []

    def walk(node) -> None:
        if getattr(node, "proto", None) is not None:
            out.append(str(node.proto))
        for child in getattr(node, "children", {}).values():
            walk(child)

    walk(at._tree)
    return "\n".join(out)


def test_operator_mode_shows_no_server_path(tiny_checkpoints, broken_checkpoints, monkeypatch):
    """With a models folder (a server others visit) no page shows a path of the server: the model by its name in
    the folder, in the page, the exported file and the commands it suggests; a failed load's message too (before:
    the folder's absolute path in the Overview's heading, the architecture table, the file and the commands)."""
    folder = tiny_checkpoints["qwen3_5_text"].parent
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(folder))
    at = start({}, model="qwen3_5_text")
    for page in (None, "export", "compare", "memory"):
        if page is not None:
            at.switch_page(f"pages/{page}.py").run()
            check(at)
        text = _page_protos(at)
        assert "qwen3_5_text" in text and str(folder) not in text and str(REPO_ROOT) not in text, page
    assert document_from_json(at.switch_page("pages/export.py").run().code[0].value).model == "qwen3_5_text"
    for name in ("truncated weights", "a missing weight"):
        broken, message = broken_checkpoints[name]
        monkeypatch.setenv(controls.MODELS_DIR_ENV, str(broken.parent))
        at = opened({}, model=broken.name)
        assert message in plain(at.error[0].value)
        text = _page_protos(at)
        assert str(broken.parent) not in text and str(REPO_ROOT) not in text and "/tmp/" not in text


def _quality_result(name: str, loaded, config: str, tokens: int, commit: str, dirty: bool, params_key: str) -> dict:
    """A perplexity result of ``config`` as the CLI stores it (its row), made by the code ``commit``; its row."""
    from pace_core.results import make_provenance, result_key, save_result

    reference = config == "fp32"
    row = {"config": config, "tokens": tokens, "nll": 3.0 + tokens / 1e4, "ppl": float(np.exp(3.0 + tokens / 1e4)),
           "agreement": 1.0 if reference else 0.97, "kl": 0.0 if reference else 1e-3 + tokens / 1e6, "bpb": 1.5}
    prov = make_provenance("m", configs=[get_config(config)], command=f"python -m pace_core perplexity --n {tokens}",
                           extra={"weights": loaded.fingerprint})
    prov["code"] = {"commit": commit, "dirty": dirty}
    save_result("perplexity", name, result_key({"config": config, "tokens": tokens}),
                {"row": row, "decode_from": 1, "params_key": params_key, "config": config}, prov, None)
    return row


def test_results_of_different_commits_are_named_where_they_are_shown_together(params, loaded, tmp_path, monkeypatch):
    """Overview's table, the Export summary's figures and the Compare page's points, each from stored results of
    two or three commits: a warning names each commit and what it made; each provenance line names its commit
    (before: combined silently)."""
    from pace_core.analysis.compare import comparison, point
    from pace_core.results import make_provenance, result_key, save_result

    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    name = stored.results_model_name(params.get("model", ""))
    a, b, c = "a" * 40, "b" * 40, "c" * 40
    rows = {"fp32": _quality_result(name, loaded, "fp32", 99, a, False, "set 1"),
            "pace-4": _quality_result(name, loaded, "pace-4", 99, b, True, "set 1")}
    _quality_result(name, loaded, "pace-4", 50, a, False, "set 2")
    points = [point(get_config(n), loaded.shape, rows.get(n, {"kl": 0.02, "agreement": 0.9, "bpb": 1.6, "ppl": 30.0,
                                                               "tokens": 99})) for n in ("fp32", "pace-4", "rtn-int4")]
    data, table = comparison(points)
    prov = make_provenance("m", configs=[get_config("pace-4")], command="python -m pace_core compare",
                           extra={"weights": loaded.fingerprint})
    prov["code"] = {"commit": c, "dirty": False}
    save_result("compare", name, result_key({"compare": 1}), {**data, "tokens": 99, "window": 512}, prov, table)
    stored.stored_results.clear()
    stored.stored_sets.clear()
    session._stored_card.clear()
    at = start(params, preset="pace-4")
    warning = [plain(w.value) for w in at.warning if "made by different code" in w.value]
    assert warning == ["The rows of this table were made by different code: commit aaaaaaaaaaaa (fp32); commit "
                       "bbbbbbbbbbbb with uncommitted changes (pace-4). Figures of different code may differ by more "
                       "than their settings do: recompute them with one commit (the commands in their provenance, "
                       "`--force`) to compare them."]
    assert any("code aaaaaaaaaaaa" in plain(c.value) or "code bbbbbbbbbbbb" in plain(c.value) for c in at.caption)
    at.switch_page("pages/export.py").run()
    check(at)
    [warning] = [plain(w.value) for w in at.warning if "made by different code" in w.value]
    assert warning.startswith("The stored figures of this configuration were made by different code: commit "
                              "bbbbbbbbbbbb with uncommitted changes (the perplexity result of 'pace-4' over 99 "
                              "tokens); commit aaaaaaaaaaaa (the perplexity result of 'pace-4' over 50 tokens).")
    quality = next(plain(c.value) for c in at.caption if plain(c.value).startswith("Top-1 agreement"))
    assert "code bbbbbbbbbbbb with uncommitted changes" in quality
    at.switch_page("pages/compare.py").run()
    check(at)
    [warning] = [plain(w.value) for w in at.warning if "made by different code" in w.value]
    assert warning.startswith("The points of this comparison were made by different code: commit aaaaaaaaaaaa (fp32); "
                              "commit bbbbbbbbbbbb with uncommitted changes (pace-4); commit cccccccccccc (rtn-int4).")


def test_export_names_a_damaged_result_instead_of_not_measured(params, loaded, tmp_path, monkeypatch):
    """A stored perplexity file that cannot be read: the Export summary names it and what to do, as the Overview
    does (before: "not measured yet", as if nothing were stored)."""
    from pace_core import results

    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    folder = results.results_dir(stored.results_model_name(params.get("model", "")))
    folder.mkdir(parents=True, exist_ok=True)
    damaged = folder / f"perplexity-{'e' * 16}.json"
    damaged.write_text("{not json")
    stored.stored_results.clear()
    at = start(params, page="export", preset="pace-4")
    assert metric(at, "KL to fp32 (nats/token)") == "stored result damaged"
    [named] = [plain(w.value) for w in at.warning if damaged.name in w.value.replace("\\", "")]
    assert named.startswith("A stored perplexity result is damaged and not shown: ") and "Delete it" in named
    assert any(plain(c.value).startswith("No readable stored result of this configuration") for c in at.caption)


def test_install_advice_is_the_readmes():
    """The project publishes no package: every install advice is the README's, from a clone (before: the Export
    page and pace_core/vllm advised `pip install "pace-studio[vllm]"`, a registry name anyone may hold)."""
    import subprocess

    from pace_core.vllm import INSTALL_COMMAND

    assert f"```bash\n{INSTALL_COMMAND}" in (REPO_ROOT / "README.md").read_text()
    files = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "*.py", "*.md", "*.toml", "*.txt"],
                           capture_output=True, text=True, check=True).stdout.split()
    advised = [f for f in files if not f.startswith("tests/") and re.search(
        r"pip install\s+\\?[\"']?pace-studio", (REPO_ROOT / f).read_text(encoding="utf-8", errors="replace"))]
    assert advised == []
