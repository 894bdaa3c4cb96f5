"""Memory: resident bits per state value, the curve over dP, the measured error against resident bits
(stored sweeps), and how many sequences fit."""

import json

import pandas as pd
import streamlit as st

from app_state import frame, session, stored
from app_state.library import BUILTIN_SHAPES, NAMED_CONFIGS, PaceConfig, capacity, code_label, tagged
from app_state.markup import code, escape
from pace_core import figures


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    cfg = cfg.uncalibrated()  # bits follow the share of 8-bit heads; what is calibrated fits one model only
    st.title("Memory")
    st.caption("Resident bits per state value = payload + metadata + c · dP (spec §5), where "
               "c = (b_k·d_k/γ + b_v·d_v + 32) / (d_k·d_v) is the decode buffer's cost per value and "
               "buffered token. 'exact' is what the implementation actually stores.")

    card = session.model_card(stop=False)  # the stored card: no model load for this page
    shapes = {} if card is None else {f"{session.model_label()} (sidebar model)": card.shape}
    shapes.update(BUILTIN_SHAPES)

    col_shape, col_cfgs = st.columns([1, 2])
    shape_name = col_shape.selectbox("Model shape", list(shapes), key="memory_shape",
                                     help="The sidebar model's shape, or a built-in Qwen shape (no download).")
    shape = shapes[shape_name]
    chosen = col_cfgs.multiselect("Configurations to compare", list(NAMED_CONFIGS), default=list(tagged("memory-page")),
                                  key="memory_cfgs")
    configs = {"sidebar: " + cfg.name: cfg}
    configs.update({n: NAMED_CONFIGS[n] for n in chosen})

    table = figures.resident_bits_table(configs, shape)
    st.subheader(f"Resident bits per state value on {escape(shape_name)}")
    st.plotly_chart(figures.resident_bits_figure(table), key="memory_bits_chart")
    st.dataframe(
        table.style.format(dict.fromkeys(["payload", "metadata", "buffer c·dP", "resident", "exact", "c"], "{:.4f}")),
        hide_index=True,
        key="memory_bits_table",
    )

    st.subheader(f"Each code width with the sidebar's other settings on {shape_name}")
    widths = figures.width_table(cfg, shape)
    if widths.empty:
        st.caption(f"'{cfg.name}' keeps a reference state: it has no code width.")
    else:
        st.caption("Every width 2–8 is stored densely (b bits a code, a row padded only to a whole byte), so each "
                   "bit less is a real saving: resident bits per state value and the state bytes each sequence "
                   "adds, against fp32 states (pace_core.accounting). The darker bar is the sidebar's width; the "
                   "Compare page shows what each costs in quality.")
        st.plotly_chart(figures.width_figure(widths, cfg.name), key="memory_width_chart")
        st.dataframe(widths.style.format({"resident bits": "{:.3f}", "state KiB / sequence": "{:,.1f}",
                                          "× fewer than fp32": "{:.2f}"}), hide_index=True, key="memory_width_table")

    st.subheader("Resident bits against the decode period dP")
    st.caption("Rounding less often shrinks the rounding error's growth but the buffer holds dP records: "
               "the buffer term grows linearly with dP.")
    curve_cfgs = {"sidebar: " + cfg.name: cfg}
    curve_cfgs.update({n: NAMED_CONFIGS[n] for n in tagged("dp-curve") if n != cfg.name})
    st.plotly_chart(figures.dp_curve_figure(curve_cfgs, shape), key="memory_dp_chart")

    st.subheader("Measured error against resident bits")
    result = None if card is None else stored.choose_stored(
        "sweep", "sweep", card.fingerprint,
        lambda r: f"{r.provenance.get('date', '?')} · {len(r.table)} configurations · {r.key}", "memory_sweep",
        title="Stored sweep")
    if result is None:
        st.caption("No stored sweep for the loaded model: `python -m pace_core sweep` measures the grid of bit "
                   "widths × dP × group axis on it (relative state and output errors against the fp32 "
                   "reference), and this section then plots it against the resident bits.")
    else:
        error = st.radio("Relative error", list(figures.SWEEP_ERRORS), format_func=figures.SWEEP_ERRORS.get,
                         horizontal=True, key="memory_sweep_error")
        st.plotly_chart(figures.sweep_figure(result.table, error), key="memory_sweep_chart")
        st.dataframe(result.table, hide_index=True, key="memory_sweep_table")

    _measured()

    weights, context = _planner(cfg, shapes, shape_name)

    st.subheader("Sequences that fit, every model and GPU")
    custom_gb = st.number_input("Custom budget (GB, 10⁹ bytes)", min_value=1.0, max_value=10000.0, value=48.0,
                                step=1.0, key="memory_budget", help="One more memory size beside the GPUs'.")
    st.caption(f"Counted as the capacity planner above counts: {weights} weights, then per sequence its recurrent "
               f"state (exact stored bytes) and the full-attention layers' bf16 KV cache at {context:,} tokens of "
               "context (the planner's settings; context 0 counts the states alone). The planner's model, "
               "GPU and chosen configuration give the same number here.")
    budgets = dict(figures.GPU_BUDGETS_GB)
    budgets[f"{custom_gb:g} GB"] = custom_gb
    fit_models = {shape_name: shape}
    fit_models.update({k: v for k, v in shapes.items() if k != shape_name})
    fits = figures.fit_table(configs, fit_models, budgets, weight_bits=figures.WEIGHT_PRECISIONS[weights],
                             context=context)
    st.dataframe(fits.style.format({"state MiB / sequence": "{:.3f}", "KV MiB / sequence": "{:.2f}"}),
                 hide_index=True, key="memory_fit_table")


def _measured() -> None:
    """What ``pace_core.apply`` really holds on a model, measured by scripts/measure_memory.py (data/bench)."""
    st.subheader("What `pace_core.apply` holds, measured")
    files = sorted(stored.BENCH_DIR.glob("memory_*.json"))
    if not files:
        st.caption("No measurement stored: `python scripts/measure_memory.py` (add `--model DIR --device cuda` on a "
                   "GPU host) generates with every configuration applied and counts what the cache holds.")
        return
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            rows, prov = pd.DataFrame(doc["rows"]), doc["provenance"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            st.error(f"{escape(path.name)} is not a memory measurement ({escape(err)}); run "
                     "`python scripts/measure_memory.py` again to rewrite it.", icon=":material/block:")
            continue
        made = (f"{escape(prov.get('model'))} on {escape(prov.get('device'))}, {escape(prov.get('batch'))} sequences, "
                f"{escape(prov.get('prompt_tokens'))} prompt + {escape(prov.get('new_tokens'))} generated tokens; "
                f"code {escape(code_label(prov))}, {escape(prov.get('date'))} ({code(path.name)})")
        st.caption(f"{made}. *held* counts every tensor the generation's state keeps (equal to the accounted bytes); "
                   "*cache* adds the attention KV and "
                   "conv states; *step peak* is the largest workspace of one further decode step (freed after it).")
        mib = 1 << 20
        table = pd.DataFrame(
            {
                "configuration": rows["config"],
                "resident bits": rows["resident_bits"],
                "state MiB (accounted)": rows["state_bytes_accounted"] / mib,
                "state MiB (held)": rows["state_bytes_held"] / mib,
                "× fewer than fp32": rows["saving_vs_fp32"],
                "whole cache MiB": rows["cache_bytes_held"] / mib,
                "step peak MiB": rows["decode_step_peak_bytes"] / mib,
            }
        )
        st.dataframe(table.style.format(dict.fromkeys(table.columns[1:], "{:.3f}")), hide_index=True,
                     key=f"memory_measured_{path.stem}")


def _planner(cfg: PaceConfig, shapes: dict, default_shape: str) -> tuple[str, int]:
    """Capacity planner: the most concurrent sequences in a GPU's memory with fp32, bf16 and the chosen
    state (pace_core.accounting.capacity), the state's share of the memory, the gain, and a chart over N.
    Returns the chosen weight precision (a key of :data:`pace_core.figures.WEIGHT_PRECISIONS`) and context length."""
    st.subheader("Capacity planner")
    st.caption("How many sequences a GPU serves at once: weights + per sequence its recurrent states (exact "
               "stored bytes) and the full-attention layers' bf16 KV cache at the context length. Activations "
               "and the engine's own buffers are not counted.")
    c1, c2, c3, c4 = st.columns(4)
    gpus = {**figures.GPU_BUDGETS_GB, "custom": None}
    gpu = c1.selectbox("GPU memory", list(gpus), index=1, key="plan_gpu")
    gb = gpus[gpu] if gpus[gpu] is not None else c1.number_input(
        "GPU memory (GB, 10⁹ bytes)", min_value=1.0, max_value=100000.0, value=96.0, step=1.0, key="plan_gb")
    name = c2.selectbox("Model", list(shapes), index=list(shapes).index(default_shape), key="plan_model")
    weights = c3.selectbox("Weights", list(figures.WEIGHT_PRECISIONS), key="plan_weights")
    context = c4.number_input("Context length (tokens)", min_value=0, max_value=1 << 20, value=8192, step=1024,
                              key="plan_context")
    shape, budget = shapes[name], int(gb * figures.GB)
    if not shape.kv_bytes_per_token:
        st.caption(f"{escape(name)}: the attention layers' head shape is unknown, so their KV cache is not counted.")
    configs = {**{n: NAMED_CONFIGS[n] for n in tagged("capacity-baseline")}, f"chosen: {cfg.name}": cfg}
    caps = {label: capacity(c, shape, budget, weight_bits=figures.WEIGHT_PRECISIONS[weights], context=int(context))
            for label, c in configs.items()}
    chosen = caps[f"chosen: {cfg.name}"]
    if chosen.sequences == 0:
        st.warning(f"The weights of {escape(name)} in {weights} ({chosen.weight_bytes / figures.GB:.1f} GB) leave no "
                   f"room for a sequence in {gb:g} GB: choose more memory or lower-precision weights.",
                   icon=":material/memory:")
        return weights, int(context)
    cols = st.columns(len(caps) + 1)
    for col, (label, cap) in zip(cols, caps.items()):
        col.metric(f"max sequences, {escape(label)}", f"{cap.sequences:,}",
                   help=f"state {cap.state_bytes_per_sequence / figures.MIB:.2f} MiB + KV "
                        f"{cap.kv_bytes_per_sequence / figures.MIB:.1f} MiB per sequence")
    gain = chosen.sequences / max(caps["bf16"].sequences, 1)
    cols[-1].metric("gain over bf16 states", f"{gain:.2f}×",
                    help=f"over fp32 states: {chosen.sequences / max(caps['fp32'].sequences, 1):.2f}×")
    st.caption(f"At its maximum the chosen state takes {chosen.state_share:.1%} of the {gb:g} GB "
               f"(fp32 states: {caps['fp32'].state_share:.1%}).")
    st.plotly_chart(figures.capacity_figure(caps, budget), key="plan_chart")
    widths = figures.width_table(cfg, shape, budget_bytes=budget, weight_bits=figures.WEIGHT_PRECISIONS[weights],
                                 context=int(context))
    if not widths.empty:
        bf16 = max(caps["bf16"].sequences, 1)
        widths["gain over bf16 states"] = widths["sequences"] / bf16
        st.caption(f"The chosen configuration at each code width, the rest as it is: sequences that fit in {gb:g} GB "
                   f"beside {weights} weights and {int(context):,} tokens of KV each.")
        st.dataframe(widths.style.format({"resident bits": "{:.3f}", "state KiB / sequence": "{:,.1f}",
                                          "× fewer than fp32": "{:.2f}", "sequences": "{:,}",
                                          "gain over bf16 states": "{:.2f}×"}), hide_index=True, key="plan_widths")
    return weights, int(context)


frame.run_page(page)
