"""The dashboard with streamlit's AppTest: every page renders without exception, and moving a
control changes what is shown (asserted on the shown values against pace_core computed here)."""

from __future__ import annotations

import base64
import contextlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

from app_state import compute, frame, session, stored
from app_support import REPO_ROOT, app_model_param
from conftest import BROKEN_CHECKPOINTS
from numerics import fp32_bound, rel
from pace_core.accounting import capacity, resident_bits, state_bytes
from pace_core.analysis.structure import structure_stats
from pace_core.analysis.text import tokenize
from pace_core.config import config_to_json, document_from_json, get_config, num_high_heads
from pace_core.export import used_settings
from pace_core.figures import MIB
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
    """A fresh session of the app with `query` in the URL, switched to pages/<page>.py."""
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in {**params, **query}.items():
        at.query_params[k] = v
    at.run()
    if page is not None:
        at.switch_page(f"pages/{page}.py").run()
    check(at)
    return at


def check(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}; have {[m.label for m in at.metric]}"
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
    warnings = " ".join(w.value for w in at.warning)
    assert "allowed: flush, carry" in warnings and "allowed: float32, bfloat16" in warnings
    for name in ("'bits'", "'dp'", "'axis'", "'device'", "'pad'", "'weights'"):
        assert f"URL parameter {name}" in warnings
    assert "allowed: 2, 3, 4, 5, 6, 7, 8" in warnings
    assert at.sidebar.select_slider(key="w_bits").value == 4
    assert at.sidebar.selectbox(key="w_axis").value == "key"
    assert at.query_params["bits"] == ["4"] or at.query_params["bits"] == "4"


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


def test_a_model_that_failed_to_load_is_not_retried_on_every_change(tmp_path, monkeypatch):
    """A path or hub id that fails (offline, a hub id takes about 30 s to fail) is shown as failed on the
    next changes, tried again at once when its folder changes, and on "Try again"."""
    calls = []
    real = session._load_model
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["model"] = str(tmp_path / "nowhere")
    at.run()
    assert not at.exception and "Could not load model" in at.error[0].value and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    assert "Could not load model" in at.error[0].value and len(calls) == 1
    (tmp_path / "nowhere").mkdir()  # the folder changed: tried at once (still not a checkpoint)
    at.sidebar.select_slider(key="w_bits").set_value(5).run()
    assert "Could not load model" in at.error[0].value and len(calls) == 2
    (tmp_path / "nowhere" / "config.json").write_text("{")  # a file appears: tried again
    at.sidebar.select_slider(key="w_bits").set_value(6).run()
    assert "Could not load model" in at.error[0].value and len(calls) == 3
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
    assert not at.exception and "RuntimeError: the loader broke" in at.error[0].value and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    assert "RuntimeError: the loader broke" in at.error[0].value and len(calls) == 1


@pytest.mark.parametrize("broken", list(BROKEN_CHECKPOINTS))
def test_a_broken_checkpoint_is_shown_once_and_not_loaded_again(broken_checkpoints, broken, monkeypatch):
    """Every way a checkpoint breaks (tests/conftest.py) is one error naming the problem, whatever the exception
    was; reruns and other pages show it without loading again (a 27B model would reload on every click)."""
    folder, message = broken_checkpoints[broken]
    calls = []
    real = session._load_model
    monkeypatch.setattr(session, "_load_model", lambda source, device: calls.append(source) or real(source, device))
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["model"] = str(folder)
    at.run()
    assert not at.exception and [message in e.value for e in at.error] == [True] and len(calls) == 1
    at.sidebar.select_slider(key="w_bits").set_value(3).run()
    at.switch_page("pages/drift.py").run()
    assert not at.exception and [message in e.value for e in at.error] == [True] and len(calls) == 1


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


def test_capacity_planner_numbers_are_the_accounting(params):
    at = start(params, page="memory", preset="pace-4")
    at.selectbox(key="plan_model").set_value("qwen3.5-27b").run()
    at.selectbox(key="plan_weights").set_value("fp8 (8 bits)").run()
    at.number_input(key="plan_context").set_value(4096).run()
    check(at)
    shape = BUILTIN_SHAPES["qwen3.5-27b"]
    caps = {n: capacity(get_config(n), shape, int(141e9), weight_bits=8, context=4096) for n in ("fp32", "bf16", "pace-4")}
    assert metric(at, "max sequences, fp32") == f"{caps['fp32'].sequences:,}"
    assert metric(at, "max sequences, bf16") == f"{caps['bf16'].sequences:,}"
    assert metric(at, "max sequences, chosen: pace-4") == f"{caps['pace-4'].sequences:,}"
    assert metric(at, "gain over bf16 states") == f"{caps['pace-4'].sequences / caps['bf16'].sequences:.2f}×"
    assert caps["pace-4"].sequences > caps["bf16"].sequences > caps["fp32"].sequences
    fig = chart(at, "plan_chart")
    assert fig["layout"]["xaxis"]["title"]["text"] == "concurrent sequences N"
    at.selectbox(key="plan_gpu").set_value("custom").run()
    at.number_input(key="plan_gb").set_value(20.0).run()  # the 27B weights in fp8 alone take ~27 GB
    assert not at.exception and "leave no room" in at.warning[0].value


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
    assert any(w in c.value for c in at.caption for w in ("Key-axis groups win here", "Value-axis groups win here"))


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
    stored = [o for o in at.radio(key="gen_source").options if o.startswith("stored: ")]
    assert stored == [o for o in stored if "“Once upon a time” · fp32, pace-4" in o] and len(stored) == 1
    at.radio(key="gen_source").set_value(stored[0]).run()
    check(at)
    assert [h.value for h in at.subheader if h.value in ("greedy", "sampled")] == ["greedy", "sampled"]
    greedy, sampled = at.dataframe[0].value, at.dataframe[1].value
    assert list(greedy["first divergence"]) == ["none", "token 1"] and list(greedy["NLL (nats/token)"]) == [1.5, 2.5]
    assert list(sampled["first divergence"]) == ["none", "none"]
    bodies = [h.proto.body for h in at.get("html")]
    assert len(bodies) == 4 and "dog" in bodies[1] and "dog" not in bodies[0]
    assert len(at.columns) >= 2 and "dog" in at.columns[1].get("html")[0].proto.body  # side by side
    assert "differs from token 1 on" in [c.value for c in at.columns[1].caption]
    assert any("degenerate continuation" in c.value for c in at.caption)
    assert any("`python -m pace_core generation --n 1`" in c.value for c in at.caption)


def test_benchmarks_without_results_say_what_to_run(params, tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = start(params, page="benchmarks")
    assert "No benchmark results yet" in at.info[0].value and stored.BENCH_COMMAND in at.info[0].value


def test_benchmarks_lead_with_a_headline_table_in_units(params, tmp_path, monkeypatch):
    rows = [{"batch": b, "variant": v, "seconds_per_token": t0 * b * 1e-6, "hbm_fraction": f}
            for v, t0, f in (("bf16 per-token", 50, 0.5), ("PACE-4 dP=8", 20, 0.25)) for b in (1, 8)]
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-11-30", "rows": rows}))
    (tmp_path / "a_list.json").write_text("[1, 2]")  # sorts first: a bad file must not hide the others
    (tmp_path / "b_bytes.json").write_bytes(b"\xff\xfe")
    monkeypatch.setattr(stored, "BENCH_DIR", tmp_path)
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    at.switch_page("pages/benchmarks.py").run()
    assert not at.exception
    assert [e.value.split(":")[0] for e in at.error] == ["a_list.json", "b_bytes.json"]
    assert at.subheader[0].value.startswith("Decode step of 24 GDN layers")
    assert at.json[0].value == json.dumps({"device": "NVIDIA H200", "date": "2026-11-30"})
    assert any(c.value.startswith("Measured on device NVIDIA H200, date 2026-11-30") for c in at.caption)
    headline = at.dataframe[0].value.set_index("variant")
    assert headline.loc["bf16 per-token", "B = 8"] == "400.0 µs · 50% HBM"
    assert headline.loc["PACE-4 dP=8", "B = 8"] == "160.0 µs · 2.50× · 25% HBM"  # 400 / 160
    table = at.dataframe[1].value
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
    measured = next(c.value for c in at.caption if "vllm_cpu.json" in c.value)  # the shipped vLLM figures
    assert f"pace-4-8 {json.loads((REPO_ROOT / 'data/bench/vllm_cpu.json').read_text())['rows'][-1]['teacher_forced']:.1%}" \
        in measured
    assert at.get("download_button")[0].proto.label == "Download pace-4.json"
    at.text_area(key="export_paste").set_value('{"schema_version": 99}').run()
    assert at.error and "schema_version" in at.error[0].value
    assert not at.exception
    imported = get_config("rtn-int5").replace(decode_period=4, name="mine")
    at.text_area(key="export_paste").set_value(config_to_json(imported)).run()
    check(at)
    assert "Valid configuration 'mine'" in at.success[0].value and not at.warning
    at.text_area(key="export_paste").set_value(config_to_json(imported.replace(decode_period=100))).run()
    assert "Decode period dP (tokens) = 100" in at.warning[0].value
    at.text_area(key="export_paste").set_value(config_to_json(imported)).run()
    at.button(key="export_load").click().run()
    check(at)
    assert at.sidebar.select_slider(key="w_bits").value == 5
    assert at.sidebar.selectbox(key="w_axis").value == "value"
    assert document_from_json(at.code[0].value).config == used_settings(imported)  # its name kept
    at.sidebar.select_slider(key="w_bits").set_value(4).run()
    assert document_from_json(at.code[0].value).config.name == "custom"  # changed: no longer the import


def test_imported_heads_must_fit_the_model_and_memory_takes_calibrated_heads(params, loaded):
    """Heads that do not fit the loaded model are dropped on import (with a warning); heads that do fit
    are kept, and the Memory page, which also shows other models' shapes, works with them."""
    L, HV = loaded.shape.num_gdn_layers, loaded.shape.num_v_heads
    at = start(params, page="export", preset="pace-4-8")
    wrong = get_config("pace-4-8").replace(name="wrong", high_heads=((0,), (999,)))
    at.text_area(key="export_paste").set_value(config_to_json(wrong)).run()
    assert not at.exception and any("do not fit the loaded model" in w.value for w in at.warning)
    at.button(key="export_load").click().run()
    check(at)
    heads = document_from_json(at.code[0].value).config.high_heads  # chosen again on this model
    assert heads is not None and len(heads) == L and heads != wrong.high_heads
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
            summary = {"config": config, "mean_rel_error": float(part.rel_error.mean())}
            save_result("drift", name, result_key({"n": n, "config": config}),
                        {"summary": summary, "params_key": f"set {n}", "config": config}, prov, part)
    stored.stored_sets.clear()          # the listing is cached for 30 s; this test just wrote two sets
    at = start(params, page="drift", preset="pace-4")
    options = [o for o in at.radio(key="drift_source").options if o.startswith("stored: ")]
    assert len(options) == 1 and options[0].startswith("stored: rtn-int4, pace-4")
    at.radio(key="drift_source").set_value(options[0]).run()
    check(at)
    assert any("`python -m pace_core drift --tokens 1`" in c.value for c in at.caption)
    fig = chart(at, "drift_chart")
    assert [t["name"] for t in fig["data"]] == ["rtn-int4", "rtn-int4", "pace-4", "pace-4"]
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
            save_result(kind, name, result_key({"n": n, "config": config}),
                        {**(data or {}), "params_key": f"set {n}", "config": config}, prov,
                        part[part["config"] == config].reset_index(drop=True))
    stored.stored_results.clear()  # the listings are cached for 30 s
    stored.stored_sets.clear()


def test_overview_shows_stored_perplexity_with_provenance(params, loaded, tmp_path, monkeypatch):
    rng = np.random.default_rng()
    table = pd.DataFrame({"config": ["fp32", "rtn-int4", "pace-4"], "tokens": [99] * 3, "nll": rng.random(3) + 3,
                          "ppl": rng.random(3) * 50, "agreement": rng.random(3), "kl": rng.random(3) / 100,
                          "bpb": rng.random(3) + 1})
    _store("perplexity", params, loaded, table, monkeypatch, tmp_path)
    at = start(params)
    assert at.selectbox(key="overview_quality_run").options == [
        at.selectbox(key="overview_quality_run").value]  # only the loaded weights' run
    assert at.selectbox(key="overview_quality_run").value.endswith("fp32, rtn-int4, pace-4")
    assert any("`python -m pace_core perplexity --n 1`" in c.value for c in at.caption)
    shown = [d.value for d in at.dataframe if "ppl" in d.value.columns]  # AppTest keeps no dataframe keys
    assert len(shown) == 1
    pd.testing.assert_frame_equal(shown[0].reset_index(drop=True), table)


def test_overview_without_stored_quality_says_what_to_run(params, tmp_path, monkeypatch):
    monkeypatch.setenv("PACE_RESULTS_DIR", str(tmp_path))
    stored.stored_results.clear()
    stored.stored_sets.clear()
    at = start(params)
    assert any("python -m pace_core perplexity" in c.value for c in at.caption)
    assert not [d for d in at.dataframe if "ppl" in d.value.columns]


def test_memory_plots_a_stored_sweep_and_follows_the_error_choice(params, loaded, tmp_path, monkeypatch):
    rng = np.random.default_rng()
    table = pd.DataFrame({"config": [f"b{b}-{a}" for b in (3, 4) for a in ("key", "value")], "bits": [3, 3, 4, 4],
                          "group_axis": ["key", "value"] * 2, "resident_bits": rng.random(4) * 8,
                          "output_rel_error": rng.random(4), "mean_rel_error": rng.random(4),
                          "final_rel_error": rng.random(4), "prefill_rel_error": rng.random(4)})
    _store("sweep", params, loaded, table, monkeypatch, tmp_path)
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


def test_a_drift_run_superseded_by_a_dp_change_leaves_nothing_behind(params):
    """A dP change while Drift computes: streamlit (fast reruns) starts the new run in a new script thread at
    once and stops the old one at its next progress update, so the two run at the same time on the one shared
    model. Here session 1 computes; at its first progress update session 2 (the new run, dP 16) starts and
    computes; session 1 is then stopped (StopException, as streamlit raises it) and unwinds while session 2 is
    in the middle of its run. Session 2 finishes without an error (it failed with "Expected size for first two
    dimensions of batch2 tensor to be: [8, 128] but got: [8, 0]"), and session 1 then computes with another dP."""
    import threading

    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    from app_state import work

    sessions = []
    for dp in ("8", "16"):  # settings of their own (40 steps): nothing kept from other tests
        at = start(params, preset="pace-4", dp=dp)
        at.session_state["drift_prefill"], at.session_state["drift_steps"] = 24, 40
        at.switch_page("pages/drift.py").run()
        check(at)
        sessions.append(at)
    first, second = sessions
    real, opened = work.progress, []
    second_running, first_gone = threading.Event(), threading.Event()
    superseding = threading.Thread(target=lambda: second.slider(key="drift_prefill").set_value(32).run())

    @contextlib.contextmanager
    def interleaved(total: int, text: str, key):
        session = len(opened)
        opened.append(key)
        with real(total, text, key) as advance:
            def step(n: int) -> None:
                advance(n)
                if session == 0:  # the superseded run: the new one starts, then this one is stopped
                    superseding.start()
                    assert second_running.wait(120)
                    raise StopException()
                second_running.set()  # the new run waits in its run until the old one has unwound
                assert first_gone.wait(120)

            try:
                yield step
            finally:
                if session == 0:
                    first_gone.set()

    work.progress = interleaved
    try:
        first.slider(key="drift_prefill").set_value(32).run()
        superseding.join(300)
    finally:
        work.progress = real
    assert not superseding.is_alive() and len(opened) == 2
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
