"""Compare: every named configuration measured on the loaded model as a point of resident bits against KL to fp32
(stored by `python -m pace_core compare`), their Pareto frontier, the best configuration under a memory budget in
one sentence, and its file in one click. Read from stored results only: no model is loaded here."""

import streamlit as st

from app_state import controls, exporting, frame, session, stored
from app_state.library import (
    PaceConfig,
    Point,
    best_in_memory,
    best_under,
    budget_bits,
    capacity,
    portable_reference,
    recommendation,
    stored_config,
    stored_configs,
)
from pace_core import figures
from pace_core.errors import PaceError

BITS, GPU = "Bits per state value", "GPU, sequences and context"
"""The two ways to give the memory budget."""


def page(cfg: PaceConfig) -> None:
    """The page body (the sidebar's configuration plays no part: every named configuration is compared)."""
    st.title("Compare")
    st.caption("Which state format to deploy on this model, within this memory, at what accuracy cost. Each point is "
               "a named configuration measured on the loaded model: its exact resident bits per state value (codes, "
               "scales, metadata and decode buffer, spec §5) against its KL divergence from the fp32 reference on "
               "held-out text (spec §7). On the frontier: no configuration has fewer bits and a lower KL.")
    card = session.model_card(stop=False)  # the stored card: no model load for this page
    if card is None:
        return
    result = stored.choose_stored(
        "compare",
        "compare",
        card.fingerprint,
        lambda r: (
            f"{r.provenance.get('date', '?')} · {len(r.data['points'])} configurations · "
            f"{r.data['tokens']:,} tokens in windows of {r.data['window']:,}"
        ),
        "compare_run",
        title="Stored comparison",
    )
    if result is None:
        model = f" --model {controls.model_source()}" if controls.model_source() else ""
        st.info(
            f"No stored comparison for {session.model_label()}: `python -m pace_core compare{model}` measures every "
            "named configuration on the first 4,096 tokens of the test split (about 9 minutes for the embedded "
            f"model on a 2-core CPU; `python -m pace_core compare{model} --max-tokens 0 --device cuda` the whole "
            "split on a GPU), and this page then shows them.",
            icon=":material/query_stats:",
        )
        return
    data, table = result.data, result.table
    points = [Point.of(p) for p in data["points"]]

    st.subheader("Best under a memory budget")
    budget, memory, where, context, weight_bits, sequences = _budget(card.shape)
    if sequences is None:  # bits per state value: against each point's resident bits, the plotted axis
        best = best_under(points, budget)
    else:  # a GPU: the configurations that hold the sequences by the accounting's capacity
        best = best_in_memory(points, stored_configs(data), card.shape, memory, sequences, context=context,
                              weight_bits=weight_bits)
    if best is None and sequences is None:
        fewest = min(points, key=lambda p: p.resident_bits)
        st.warning(f"No configuration fits {budget:.2f} bits per state value: the fewest, {fewest.config}, takes "
                   f"{fewest.resident_bits:.2f}.", icon=":material/block:")
    elif best is None:
        most = max((capacity(stored_config(data, p.config), card.shape, memory, weight_bits=weight_bits,
                             context=context).sequences, -p.kl, p.config) for p in points)  # ties: lower KL
        st.warning(f"No configuration holds {sequences:,} sequences on {where} at {context:,} tokens of context with "
                   f"{weight_bits}-bit weights: the most, {most[2]}, holds {most[0]:,}.", icon=":material/block:")
    else:
        st.success(recommendation(best, stored_config(data, best.config), card.shape, memory, where, context=context,
                                  weight_bits=weight_bits), icon=":material/recommend:")
        _export(best, data, card)

    st.subheader("Resident bits against KL")
    st.plotly_chart(figures.compare_figure(table, None if best is None else best.config, budget), key="compare_chart")
    st.caption(
        f"{data['tokens']:,} scored tokens of {stored.text_name(result.provenance)} per configuration, windows of "
        f"{data.get('window', '?')} tokens, each window's second half decoded token by token (the command "
        "above). The fp32 reference (KL 0) lies off the log axis. Green: the frontier."
    )
    shown = table.drop(columns=[c for c in ("method", "ppl", "tokens") if c in table.columns])
    st.dataframe(shown.style.format({"resident_bits": "{:.3f}", "kl": "{:.2e}", "agreement": "{:.2%}",
                                     "bpb": "{:.4f}"}), hide_index=True, key="compare_table")


def _budget(shape) -> tuple[float, int, str, int, int, int | None]:
    """The budget as the user gives it: bits per state value, with the memory, its name, the context and the weight
    bits the sentence states the capacity at (for a budget in bits: :data:`figures.CAPACITY_GPU` and its settings,
    and no sequence count); or a GPU's memory, with the sequences it must hold and the bits per state value that
    leaves each sequence (shown as the budget line)."""
    kind = st.radio("Memory budget as", [BITS, GPU], key="compare_budget_kind", horizontal=True,
                    help="Bits per state value directly, or the memory a GPU leaves for the states of a number of "
                         "sequences after the weights and their attention KV cache.")
    if kind == BITS:
        bits = st.number_input(BITS, min_value=1.0, max_value=64.0, value=6.0, step=0.25, format="%.3f",
                               key="compare_bits", help="Resident bits per state value a configuration may take "
                                                        "(fp32: 32).")
        return (float(bits), int(figures.GPU_BUDGETS_GB[figures.CAPACITY_GPU] * figures.GB),
                f"an {figures.CAPACITY_GPU}", figures.CAPACITY_CONTEXT, figures.CAPACITY_WEIGHT_BITS, None)
    c1, c2, c3, c4 = st.columns(4)
    gpus = {**figures.GPU_BUDGETS_GB, "custom": None}
    gpu = c1.selectbox("GPU memory", list(gpus), index=list(gpus).index(figures.CAPACITY_GPU), key="compare_gpu")
    gb = gpus[gpu] if gpus[gpu] is not None else c1.number_input(
        "GPU memory (GB, 10⁹ bytes)", min_value=1.0, max_value=100000.0, value=96.0, step=1.0, key="compare_gb")
    sequences = c2.number_input("Concurrent sequences", min_value=1, max_value=10**7, value=64, step=1,
                                key="compare_sequences")
    context = c3.number_input("Context length (tokens)", min_value=0, max_value=1 << 20,
                              value=figures.CAPACITY_CONTEXT, step=1024, key="compare_context")
    weights = c4.selectbox("Weights", list(figures.WEIGHT_PRECISIONS), key="compare_weights")
    memory, weight_bits = int(gb * figures.GB), figures.WEIGHT_PRECISIONS[weights]
    bits = budget_bits(shape, memory, int(sequences), context=int(context), weight_bits=weight_bits)
    st.caption(f"{bits:.2f} bits per state value: what {gb:g} GB leaves after the weights at {weight_bits} bits and "
               f"{int(sequences):,} sequences' bf16 attention KV cache at {int(context):,} tokens, shared by their "
               "recurrent states (pace_core.analysis.compare.budget_bits). A configuration fits when the memory "
               "holds the sequences by the accounting's capacity: what it keeps once per layer (head maps, "
               "STEPQuant's impact weights, static scales' ranges) comes off the memory first, so its resident bits "
               "of one sequence may lie right of this line (pace_core.accounting.best_in_memory).")
    where = f"an {gpu}" if gpus[gpu] is not None else f"{gb:g} GB"
    return bits, memory, where, int(context), weight_bits, int(sequences)


def _export(best: Point, data: dict, card) -> None:
    """The chosen configuration's file in one click: the Export page's file (app_state.exporting) of the
    configuration as it was measured, its calibration on these weights included."""

    def calibrate(c: PaceConfig) -> PaceConfig:  # only for a stored configuration lacking its calibration
        from app_state import compute

        return compute.runnable(controls.model_source(), controls.runtime(), c)

    try:
        _, filename, text = exporting.export_file(
            stored_config(data, best.config), card.shape,
            portable_reference(session.results_model_name(controls.model_source())), card.fingerprint,
            calibrate=calibrate)
    except PaceError as err:
        st.error(f"{best.config} cannot be exported for the loaded model: {err}", icon=":material/block:")
        return
    st.download_button(f"Export {filename}", text, file_name=filename, mime="application/json", key="compare_export",
                       type="primary", help="The file the Export page writes for this configuration on the loaded "
                                            "model: pace_core.apply and the vLLM plugin take it.")


frame.run_page(page)
