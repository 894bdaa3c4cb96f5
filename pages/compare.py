"""Compare: every named configuration measured on the loaded model as a point of resident bits against a quality
axis the user picks (KL to fp32 or perplexity, stored by `python -m pace_core compare`, or a task score stored by
`python -m pace_core tasks`), their Pareto frontier on it, the best configuration under a memory budget in one
sentence, its file in one click (recording what it was picked on), and the task scores of every configuration.
Read from stored results only: no model is loaded here."""

import streamlit as st

from app_state import controls, exporting, frame, session, stored
from app_state.library import (
    EVAL_INSTALL,
    KL,
    PERPLEXITY,
    TASK_KIND,
    Axis,
    PaceConfig,
    Point,
    axis_table,
    best_in_memory,
    best_under,
    budget_bits,
    capacity,
    evidence,
    gap,
    harness_installed,
    portable_reference,
    recommendation,
    setting_label,
    stored_config,
    stored_configs,
    task_axes,
    task_table,
)
from app_state.markup import code, escape
from pace_core import figures
from pace_core.errors import PaceError

BITS, GPU = "Bits per state value", "GPU, sequences and context"
"""The two ways to give the memory budget."""


def page(cfg: PaceConfig) -> None:
    """The page body (the sidebar's configuration plays no part: every named configuration is compared)."""
    st.title("Compare")
    st.caption("Which state format to deploy on this model, within this memory, at what accuracy cost. Each point is "
               "a named configuration measured on the loaded model: its exact resident bits per state value (codes, "
               "scales, metadata and decode buffer, spec §5) against the quality axis picked below: its KL divergence "
               "from the fp32 reference on held-out text (spec §7), its perplexity there, or a task score (lm-eval). "
               "On the frontier: no configuration has fewer bits and a better value.")
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
        command = f"python -m pace_core compare{model}"
        st.info(
            f"No stored comparison for {escape(session.model_label())}: {code(command)} measures every named "
            "configuration on the first 4,096 tokens of the test split (about 9 minutes for the embedded model on "
            f"a 2-core CPU; {code(command + ' --max-tokens 0 --device cuda')} the whole split on a GPU), and this "
            "page then shows them.",
            icon=":material/query_stats:",
        )
        return
    data, table = result.data, result.table
    points = [Point.of(p) for p in data["points"]]
    task_sets = _task_sets(card)
    axis = _axis(points, data, task_sets)

    st.subheader("Best under a memory budget")
    budget, memory, where, context, weight_bits, sequences = _budget(card.shape)
    measured = axis.measured(points)
    among = "" if axis is KL else f" among those measured on {escape(axis.label)}"
    if sequences is None:  # bits per state value: against each point's resident bits, the plotted axis
        best = best_under(points, budget, axis)
    else:  # a GPU: the configurations that hold the sequences by the accounting's capacity
        best = best_in_memory(points, stored_configs(data), card.shape, memory, sequences, context=context,
                              weight_bits=weight_bits, axis=axis)
    if best is None and sequences is None:
        fewest = min(measured, key=lambda p: p.resident_bits)
        st.warning(f"No configuration fits {budget:.2f} bits per state value{among}: the fewest, "
                   f"{escape(fewest.config)}, takes {fewest.resident_bits:.2f}.", icon=":material/block:")
    elif best is None:
        most = max((capacity(stored_config(data, p.config), card.shape, memory, weight_bits=weight_bits,
                             context=context).sequences, -axis.loss(p), p.config) for p in measured)  # ties: better
        st.warning(f"No configuration holds {sequences:,} sequences on {escape(where)} at {context:,} tokens of "
                   f"context with {weight_bits}-bit weights{among}: the most, {escape(most[2])}, holds {most[0]:,}.",
                   icon=":material/block:")
    else:
        st.success(escape(recommendation(best, stored_config(data, best.config), card.shape, memory, where,
                                         context=context, weight_bits=weight_bits, axis=axis)),
                   icon=":material/recommend:")
        _against_reference(axis, best, measured)
        held = None if sequences is None else {"bytes": memory, "sequences": sequences, "context": context,
                                               "weight_bits": weight_bits}
        _export(best, data, card, evidence(axis, best, points, budget, held))

    st.subheader(f"Resident bits against {escape(axis.label)}")
    if axis is KL:
        st.plotly_chart(figures.compare_figure(table, None if best is None else best.config, budget),
                        key="compare_chart")
        st.caption(
            f"{data['tokens']:,} scored tokens of {stored.text_name(result.provenance)} per configuration, windows of "
            f"{escape(data.get('window', '?'))} tokens, each window's second half decoded token by token (the command "
            "above). The fp32 reference (KL 0) lies off the log axis. Green: the frontier."
        )
    else:
        shown_axis = axis_table(points, axis)
        direction = "higher is better" if axis.higher_is_better else "lower is better"
        st.plotly_chart(figures.compare_figure(shown_axis, None if best is None else best.config, budget, y="value",
                                               y_title=f"{axis.label} ({direction})", log_y=False, error="stderr"),
                        key="compare_chart")
        left_out = [p.config for p in points if axis.value(p) is None]
        st.caption(f"Green: the frontier on {escape(axis.label)} ({direction}; no configuration with fewer bits and a "
                   "better value); bars: each task score's standard error as lm-eval reports it."
                   + (f" Not measured on this axis, so left out: {escape(', '.join(left_out))}." if left_out else ""))
    shown = table.drop(columns=[c for c in ("method", "ppl", "tokens") if c in table.columns])
    st.dataframe(shown.style.format({"resident_bits": "{:.3f}", "kl": "{:.2e}", "agreement": "{:.2%}",
                                     "bpb": "{:.4f}"}), hide_index=True, key="compare_table")
    stored.mixed_code(stored.measured_by(result, card.fingerprint), "The points of this comparison")
    _tasks(task_sets)


def _against_reference(axis: Axis, best: Point, measured: list[Point]) -> None:
    """For a task score: the chosen configuration against fp32's on it, the difference with its standard error,
    and whether the task tells them apart (more than two standard errors)."""
    ref = next((p for p in measured if p.config == "fp32"), None)
    if axis.scores is None or ref is None or ref.config == best.config:
        return
    difference, se = gap(axis, best, ref)
    if se is None:
        st.caption(f"fp32 scores {axis.shown(ref)} here ({difference:+.3f}); lm-eval reports no standard error.")
        return
    verdict = ("more than two standard errors: a difference these items measure" if abs(difference) > 2 * se else
               "within two standard errors: at this number of items the task does not tell them apart")
    st.caption(f"fp32 scores {axis.shown(ref)}: {escape(best.config)} differs by {difference:+.3f} ± {se:.3f} (both "
               f"standard errors combined, an upper bound for scores of the same items), {verdict}.")


def _task_sets(card) -> list:
    """The stored task results of the loaded weights (one set per task and setting), the damaged ones named."""
    listing = stored.stored_sets(controls.model_source(), TASK_KIND, card.fingerprint)
    stored.name_damaged("task", listing.damaged)
    return listing.results


def _axis(points: list[Point], data: dict, task_sets: list) -> Axis:
    """The quality axis the user picks: KL, perplexity (where the comparison has it) or a stored task score."""
    axes = [KL] + ([PERPLEXITY] if PERPLEXITY.measured(points) else [])
    axes += task_axes([s for s in task_sets if not s.stale], data["points"])
    labels = [a.label for a in axes]
    choice = st.selectbox("Quality axis", labels, key="compare_axis",
                          help="What the frontier and the recommendation judge a configuration on besides its bits: "
                               "KL to fp32 or perplexity on held-out text (the stored comparison), or a task score "
                               "stored by `python -m pace_core tasks` (only the configurations it measured).")
    return axes[labels.index(choice)]


def _tasks(task_sets: list) -> None:
    """The task scores of every configuration, each with its standard error, and where they come from."""
    st.subheader("Task scores")
    if not task_sets:
        model = f" --model {controls.model_source()}" if controls.model_source() else ""
        command = f"python -m pace_core tasks{model} --configs pace-4 stepquant-4 --tasks pace_vt_mc_2048,gsm8k"
        needs = ("" if harness_installed() else
                 f" It needs lm-evaluation-harness, not installed here: {code(EVAL_INSTALL)} in a clone of this "
                 "repository.")
        st.info(f"No stored task scores for {escape(session.model_label())}: {code(command)} runs lm-eval tasks with "
                "each configuration applied (fp32 and bf16 beside them), and this page then offers them as quality "
                "axes." + needs, icon=":material/fact_check:")
        return
    current = [s for s in task_sets if not s.stale]
    if current:
        st.dataframe(task_table(current), hide_index=True, key="compare_tasks")
    for s in task_sets:
        first = s.results[0]
        harness = first.provenance.get("lm_eval") or {}
        st.caption(f"{'Stale (not offered as an axis): ' + escape(s.stale_label) + '. ' if s.stale else ''}"
                   f"{escape(first.data['task'])}: {escape(setting_label(first.data))}, lm-eval "
                   f"{escape(harness.get('version', '?'))}, {len(s.results)} configuration(s); "
                   f"{stored.provenance_label(s.provenance)}.")


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


def _export(best: Point, data: dict, card, picked_on: dict) -> None:
    """The chosen configuration's file in one click: the Export page's file (app_state.exporting) of the
    configuration as it was measured, its calibration on these weights included, recording what it was picked on
    (``picked_on``: :func:`pace_core.analysis.compare.evidence`), which the Export page's file of the same settings
    records too in this session."""

    def calibrate(c: PaceConfig) -> PaceConfig:  # only for a stored configuration lacking its calibration
        from app_state import compute

        return compute.runnable(controls.model_source(), controls.runtime(), c)

    chosen = stored_config(data, best.config)
    try:
        _, filename, text = exporting.export_file(
            chosen, card.shape, portable_reference(session.results_model_name(controls.model_source())),
            card.fingerprint, calibrate=calibrate, evidence=picked_on)
    except PaceError as err:
        st.error(f"{escape(best.config)} cannot be exported for the loaded model: {escape(err)}",
                 icon=":material/block:")
        return
    exporting.remember_pick(chosen, picked_on)
    st.download_button(f"Export {escape(filename)}", text, file_name=filename, mime="application/json",
                       key="compare_export", type="primary",
                       help="The file the Export page writes for this configuration on the loaded model: "
                            "pace_core.apply and the vLLM plugin take it. Its provenance records what it was picked on "
                            "(the axis, its value, the budget).")


frame.run_page(page)
