"""Overview: the loaded model's architecture, its state memory, its measured quality (stored runs), and
what each PACE part does."""

import pandas as pd
import streamlit as st

from app_state import frame, session, stored
from pace_core.accounting import state_bytes, state_share
from pace_core.config import PaceConfig, get_config
from pace_core.figures import MIB


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("PACE Studio")
    st.markdown("**P**eriodic and **C**hannel-**A**ligned **E**ncoding of four-bit recurrent states: see what "
                "storing a Gated DeltaNet state in 2–8 bits does inside a real Qwen3.5-architecture model, "
                "pick the settings in the sidebar, and export them as JSON.")

    card = session.model_card(stop=False)  # the stored card: no model load for this page
    if card is not None:
        shape = card.shape
        st.subheader(f"Model: {session.model_label()}")
        gamma = shape.num_v_heads // shape.num_k_heads
        cols = st.columns(6)
        cols[0].metric("Layers", shape.num_layers)
        cols[1].metric("GDN layers", shape.num_gdn_layers, help="Gated DeltaNet (linear attention) layers: "
                       "the ones with a recurrent state. The others are full attention with a KV cache.")
        cols[2].metric("Key / value heads", f"{shape.num_k_heads} / {shape.num_v_heads}",
                       help="γ = value heads / key heads; a key head is shared by γ value heads.")
        cols[3].metric("γ", gamma)
        cols[4].metric("Head dims d_k × d_v", f"{shape.d_k} × {shape.d_v}")
        cols[5].metric("Parameters", f"{shape.weight_params / 1e6:.1f} M")
        with st.expander("Full architecture summary (from the checkpoint's config and weights)"):
            st.dataframe(pd.DataFrame({"value": {k: str(v) for k, v in card.summary.items()}}),
                         key="overview_summary")

        st.subheader("Recurrent state memory")
        n_seq = st.slider("Concurrent sequences N", 1, 256, 64, key="overview_n",
                          help="How many sequences the server decodes at once; each holds its own state.")
        n_col = f"state MiB for N = {n_seq}"
        rows = [{"configuration": label,
                 "state MiB / sequence": state_bytes(c, shape, 1) / MIB,
                 n_col: state_bytes(c, shape, n_seq) / MIB,
                 "share of weights + state": state_share(c, shape, n_seq)}
                for label, c in (("fp32 reference", get_config("fp32")), (f"sidebar: {cfg.name}", cfg))]
        cols = st.columns(3)
        cols[0].metric(f"fp32 state, N = {n_seq}", f"{rows[0][n_col]:,.2f} MiB",
                       help="fp32 recurrent state of every GDN layer for N sequences.")
        cols[1].metric(f"{cfg.name} state, N = {n_seq}", f"{rows[1][n_col]:,.2f} MiB",
                       delta=f"{rows[1][n_col] / rows[0][n_col] - 1:+.1%}", delta_color="inverse",
                       help="Real resident bytes of the sidebar configuration: packed codes, scales, zero "
                            "points and the decode buffer.")
        cols[2].metric(f"fp32 state share of weights + state, N = {n_seq}",
                       f"{rows[0]['share of weights + state']:.1%}",
                       help="Spec §5: at 64 sequences an fp32 state takes 10–41% of weights + state on the "
                            "large Qwen backbones.")
        st.dataframe(pd.DataFrame(rows).style.format({"state MiB / sequence": "{:.3f}", n_col: "{:,.2f}",
                                                      "share of weights + state": "{:.2%}"}),
                     hide_index=True, key="overview_state_table")

        st.subheader("Measured quality")
        result = stored.choose_stored(
            "perplexity", "perplexity", card.fingerprint,
            lambda r: f"{r.provenance.get('date', '?')} · {', '.join(r.configs)}", "overview_quality_run",
            title="Stored perplexity run", per_config=True)
        if result is None:
            st.caption("No stored perplexity run for the loaded model: `python -m pace_core perplexity` measures "
                       "the named configurations on held-out text, and this section then shows them.")
        else:
            st.caption("Perplexity and bits per byte of the text (nll: nats per scored token); top-1 agreement "
                       "and KL divergence (nats per token) of the next-token distribution against the fp32 "
                       "reference (spec §7).")
            st.dataframe(result.table.style.format({"nll": "{:.4f}", "ppl": "{:.3f}", "agreement": "{:.2%}",
                                                    "kl": "{:.5f}", "bpb": "{:.4f}"}),
                         hide_index=True, key="overview_quality")

        st.subheader("The seed's claims, measured")
        claims = stored.choose_stored(
            "claims", "claims", card.fingerprint,
            lambda r: f"{r.provenance.get('date', '?')} · {r.data.get('tokens', '?')} tokens", "overview_claims_run",
            title="Stored claims report")
        if claims is None:
            st.caption("No stored claims report for the loaded model: `python -m pace_core claims` measures the seed "
                       "articles' claims (periodic rounding, key-axis groups, head allocation, drift against dP) and "
                       "the paper's main table on held-out text, and this section then shows them.")
        else:
            _claims(claims.data)

    st.subheader("The parts of PACE")
    st.caption("“From the paper”: stated by the seed articles about the paper; “our choice”: our reading where "
               "they are silent (each is a setting you can change).")
    parts = pd.DataFrame([
        {"part": "Key-axis (channel-aligned) groups", "source": "from the paper", "setting": "Group axis, group size",
         "now": f"{cfg.group_axis}, g = {cfg.group_size}",
         "what it does": "One fp16 scale per g consecutive key rows of one value column: an outlier value "
                         "column widens only its own quantisation step."},
        {"part": "Periodic decode rounding", "source": "from the paper", "setting": "Decode period dP",
         "now": f"dP = {cfg.decode_period}",
         "what it does": "Round the state once every dP tokens instead of every token; fewer roundings, less "
                         "accumulated error in slowly decaying heads."},
        {"part": "Decode buffer of (k_t, u_t, g_t)", "source": "[ours: u_t, not v_t]", "setting": "Buffer precision",
         "now": cfg.buffer,
         "what it does": "Holds the tokens since the last rounding so outputs use the exact state "
                         "e^G·Ŝ + Σ e^(G−G_i) k_i u_iᵀ without re-rounding."},
        {"part": "Exact current token", "source": "our choice", "setting": "Exact current token",
         "now": "on" if cfg.exact_current_token else "off",
         "what it does": "A token's own output and delta value use its exact k_t, u_t (at hand when it is "
                         "processed); only the record kept for later tokens is rounded. No memory cost."},
        {"part": "Buffer scale groups", "source": "our choice", "setting": "Buffer key / value group, symmetric",
         "now": f"keys {cfg.buffer_key_group or 'per vector'}{'' if cfg.buffer_key_symmetric else ' + zero point'}, "
                f"values {cfg.buffer_value_group or 'per vector'}{'' if cfg.buffer_value_symmetric else ' + zero point'}",
         "what it does": "Entries of a buffered integer vector sharing one fp16 scale (and zero point): finer groups "
                         "follow outlier channels of u_t and k_t for 16/g bits per entry in c · dP."},
        {"part": "Prefill in P-token segments", "source": "from the paper", "setting": "Prefill period P",
         "now": f"P = {cfg.prefill_period}",
         "what it does": "The prompt runs chunked from the dequantised state; the state is rounded once per "
                         "segment."},
        {"part": "Prompt after decoded tokens", "source": "our choice", "setting": "Prompt after decoded tokens",
         "now": cfg.prefill_after_decode,
         "what it does": "flush: round the checkpoint plus buffer before the prompt; carry: run the prompt from "
                         "that exact state, one rounding fewer (serving multi-turn chats; no view here has a "
                         "second prompt)."},
        {"part": "Head-level precision (PACE-4/8)", "source": "from the paper; a_h, e_h estimates our choice",
         "setting": "Share of 8-bit heads", "now": f"{cfg.high_share:.1%}",
         "what it does": "Heads with the largest retained error E_h = e_h / (1 − a_h^(2·dP)) keep 8 bits."},
        {"part": "fp16 scales, integer zero point", "source": "fp16 scale our choice", "setting": "Symmetric",
         "now": "symmetric" if cfg.symmetric else "zero point",
         "what it does": "Codes are computed from the stored fp16 scale so dequantisation is exact; all-zero "
                         "groups stay zero."},
    ])
    st.dataframe(parts, hide_index=True, key="overview_parts")


def _claims(report: dict) -> None:
    """The claims report of ``python -m pace_core claims`` (pace_core.analysis.claims): a verdict and margin per
    claim, then the main table."""
    rows = [{"claim": c["claim"], "what": c["what"], "holds": "yes" if c["holds"] else "no",
             "margin": c["margin"],
             "figures": ", ".join(f"{label}: KL {kl:.2e}" for label, kl in zip(c["labels"], c["kl"])) if "kl" in c
             else ", ".join(f"{label}: {e:.2%}" for label, e in zip(c["labels"], c["state_error"]))}
            for c in report["claims"]]
    st.caption(f"{report['tokens']} held-out tokens scored (KL to fp32, nats per token); state errors on "
               f"{report['drift_tokens']} tokens at the steps where every dP has just rounded. Margin: the relative "
               "KL (or error) reduction of the claimed better configuration over the best it is compared with; "
               "negative where the claim does not hold.")
    st.dataframe(pd.DataFrame(rows).style.format({"margin": "{:+.1%}"}), hide_index=True, key="overview_claims")
    st.caption("The paper's main table in shape: resident bits on the loaded model and on Qwen3.5-27B (the share "
               "of 8-bit heads, not this model's heads), bits per byte, KL and top-1 agreement against fp32.")
    st.dataframe(pd.DataFrame(report["main"]).style.format({"resident_bits": "{:.3f}", "resident_bits_27b": "{:.3f}",
                                                            "bpb": "{:.4f}", "kl": "{:.2e}", "agreement": "{:.2%}"}),
                 hide_index=True, key="overview_main_table")


frame.run_page(page)
