"""Overview: the loaded model's architecture, its state memory, its measured quality (stored runs), and
what each PACE part does."""

import pandas as pd
import streamlit as st

from app_state import controls, frame, session, stored
from app_state.library import SPREAD_LEVEL, PaceConfig, get_config, state_bytes, state_share, verdict
from app_state.markup import escape
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
        st.subheader(f"Model: {escape(session.model_label())}")
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
            st.dataframe(pd.DataFrame({"value": {k: controls.hide_paths(str(v)) for k, v in card.summary.items()}}),
                         key="overview_summary", column_config={"value": st.column_config.TextColumn(width="large")})

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
        cols[1].metric(f"{escape(cfg.name)} state, N = {n_seq}", f"{rows[1][n_col]:,.2f} MiB",
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
            lambda r: f"{r.provenance.get('date', '?')} · {_scored(r.table['tokens'])} · {', '.join(r.configs)}",
            "overview_quality_run", title="Stored perplexity run", per_config=True,
            rank=lambda r: -int(r.table["tokens"].max()))  # the run over the most tokens first
        if result is None:
            st.caption("No stored perplexity run for the loaded model: `python -m pace_core perplexity` measures "
                       "the named configurations on held-out text, and this section then shows them.")
        else:
            st.caption(f"Table 1, {_scored(result.table['tokens'])} of {stored.text_name(result.provenance)} per "
                       "configuration, from the command named above. Perplexity and bits per byte of the text (nll: "
                       "nats per scored token); top-1 agreement and KL divergence (nats per token) of the "
                       "next-token distribution against the fp32 reference (spec §7).")
            st.dataframe(result.table.style.format({"nll": "{:.4f}", "ppl": "{:.3f}", "agreement": "{:.2%}",
                                                    "kl": "{:.5f}", "bpb": "{:.4f}"}),
                         hide_index=True, key="overview_quality")
            stored.mixed_code([(r.data.get("config", "?"), r.provenance) for r in result.results],
                              "The rows of this table")

        st.subheader("The paper's claims and ours, measured, with their spread")
        claims = stored.choose_stored(
            "claims", "claims", card.fingerprint,
            lambda r: f"{r.provenance.get('date', '?')} · {r.data.get('tokens', '?')} tokens", "overview_claims_run",
            title="Stored claims report")
        if claims is None:
            st.caption(
                "No stored claims report for the loaded model: `python -m pace_core claims` measures the "
                "paper's claims (a)–(d) (periodic rounding, key-axis groups, head allocation, drift against dP), "
                "ours (e) (PACE against STEPQuant at equal resident bits), each margin with its spread, and the "
                "main table on held-out text, and this section then shows them."
            )
        else:
            _claims(claims.data, claims.provenance, None if result is None else result.table)

    st.subheader("The parts of PACE")
    st.caption("“From the paper”: what the PACE paper specifies; “our choice”: our reading where it is silent "
               "(each is a setting you can change).")
    parts = pd.DataFrame(
        [
            {
                "part": "Key-axis (channel-aligned) groups",
                "source": "from the paper",
                "setting": "Group axis, group size",
                "now": f"{cfg.group_axis}, g = {cfg.group_size}",
                "what it does": "One fp16 scale per g consecutive key rows of one value column: an outlier value "
                "column widens only its own quantisation step.",
            },
            {
                "part": "Periodic decode rounding",
                "source": "from the paper",
                "setting": "Decode period dP",
                "now": f"dP = {cfg.decode_period}",
                "what it does": "Round the state once every dP tokens instead of every token; fewer roundings, less "
                "accumulated error in slowly decaying heads.",
            },
            {
                "part": "Decode buffer of (k_t, u_t, g_t)",
                "source": "[ours: u_t, not v_t]",
                "setting": "Buffer precision",
                "now": cfg.buffer,
                "what it does": "Holds the tokens since the last rounding so outputs use the exact state "
                "e^G·Ŝ + Σ e^(G−G_i) k_i u_iᵀ without re-rounding.",
            },
            {
                "part": "Exact current token",
                "source": "our choice",
                "setting": "Exact current token",
                "now": "on" if cfg.exact_current_token else "off",
                "what it does": "A token's own output and delta value use its exact k_t, u_t (at hand when it is "
                "processed); only the record kept for later tokens is rounded. No memory cost.",
            },
            {
                "part": "Buffer scale groups",
                "source": "our choice",
                "setting": "Buffer key / value group, symmetric",
                "now": f"keys {cfg.buffer_key_group or 'per vector'}"
                f"{'' if cfg.buffer_key_symmetric else ' + zero point'}, "
                f"values {cfg.buffer_value_group or 'per vector'}"
                f"{'' if cfg.buffer_value_symmetric else ' + zero point'}",
                "what it does": "Entries of a buffered integer vector sharing one fp16 scale (and zero point): finer "
                "groups follow outlier channels of u_t and k_t for 16/g bits per entry in c · dP.",
            },
            {
                "part": "Prefill in P-token segments",
                "source": "from the paper",
                "setting": "Prefill period P",
                "now": f"P = {cfg.prefill_period}",
                "what it does": "The prompt runs chunked from the dequantised state; the state is rounded once per "
                "segment.",
            },
            {
                "part": "Prompt after decoded tokens",
                "source": "our choice",
                "setting": "Prompt after decoded tokens",
                "now": cfg.prefill_after_decode,
                "what it does": "flush: round the checkpoint plus buffer before the prompt; carry: run the prompt from "
                "that exact state, one rounding fewer (serving multi-turn chats; no view here has a "
                "second prompt).",
            },
            {
                "part": "Head-level precision (PACE-4/8)",
                "source": "from the paper; a_h, e_h estimates our choice",
                "setting": "Share of 8-bit heads",
                "now": f"{cfg.high_share:.1%}",
                "what it does": "Heads with the largest retained error E_h = e_h / (1 − a_h^(2·dP)) keep 8 bits.",
            },
            {
                "part": "fp16 scales, integer zero point",
                "source": "fp16 scale our choice",
                "setting": "Symmetric",
                "now": "symmetric" if cfg.symmetric else "zero point",
                "what it does": "Codes are computed from the stored fp16 scale so dequantisation is exact; all-zero "
                "groups stay zero.",
            },
        ]
    )
    st.dataframe(parts, hide_index=True, key="overview_parts", row_height=TEXT_ROW_HEIGHT, height="content",
                 column_config=_widths(part=180, source=140, setting=170, now=150, **{"what it does": 340}))


CLAIMS = {
    "a": ("Periodic rounding",
          "Rounding the state once every dP = 8 tokens, the tokens between kept in a decode buffer, loses less "
          "accuracy than rounding after every token, at every bit width below 8.",
          "RTN with value-axis groups of 32 at 3–6 bits, dP 8 against dP 1 (the same decode buffer): KL to fp32."),
    "b": ("Channel-aligned (key-axis) groups",
          "Large state entries gather in columns, so scale groups along the key axis (one value column each) give "
          "a lower perplexity than value-axis groups of the same width.",
          "4-bit groups of 32, key axis against value axis, rounded every token (only the grouping differs): KL."),
    "c": ("Head-level precision (PACE-4/8)",
          "Keeping the quarter of heads with the largest retained error E_h = e_h / (1 − a_h^(2·dP)) at 8 bits "
          "gives a lower perplexity than DAMP INT4 at the same resident bits.",
          "The E_h allocation against the best of several random allocations of the same share and against a "
          "uniform 5-bit width of the same payload: KL."),
    "d": ("Drift against dP",
          "The state's drift from the full-precision state falls as dP grows, for every 4-bit quantiser.",
          "Relative state error of PACE-4's and RTN-INT4's quantisers at dP 1, 2, 4, 8, 16, at the decode steps "
          "where every dP has just rounded."),
    "e": ("PACE vs STEPQuant at equal bits",
          "Ours, not the paper's: at the resident bits of STEPQuant-4 (2026), PACE's periodic rounding loses less "
          "accuracy than STEPQuant's per-head widths and row × column scales.",
          "STEPQuant-4 calibrated on the model against PACE-4's quantiser at the dP and group size whose resident "
          "bits are the most not above STEPQuant-4's (a PACE win is not bought with memory): KL."),
}
"""The paper's claims (a)–(d) as the articles about it state them, and ours (e), and how ``python -m pace_core
claims`` (pace_core.analysis.claims) tests each on the loaded model: (name, the claim, the test)."""

TEXT_ROW_HEIGHT = 96
"""Row height (pixels) of the tables of sentences: four lines of text. Streamlit wraps a cell's text only in rows
taller than 4rem (64 px); in shorter ones it cuts the text off."""


def _widths(**pixels: int) -> dict:
    """Column configuration giving each named column its width in pixels (a table of sentences: about 980 in
    all, the width of the page's main column on a laptop screen, so that no column lies off screen)."""
    return {name: st.column_config.Column(width=width) for name, width in pixels.items()}


def _scored(tokens: pd.Series) -> str:
    """'N scored tokens' of a quality table's token counts (one figure when every row scored the same)."""
    counts = sorted({int(t) for t in tokens})
    return (f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}–{counts[-1]:,}") + " scored tokens"


def _claims(report: dict, provenance: dict, quality: pd.DataFrame | None) -> None:
    """The claims report of ``python -m pace_core claims`` (pace_core.analysis.claims): what each claim says, a
    verdict and margin per claim with the margin's spread and whether the claim holds beyond it, then the main
    table, whose token count is set beside that of the Measured quality table ``quality`` (None when there is
    none)."""
    st.dataframe(pd.DataFrame([{"claim": f"({letter}) {name}", "the paper claims": claim, "tested here as": test}
                               for letter, (name, claim, test) in CLAIMS.items()]),
                 hide_index=True, key="overview_claim_names", row_height=TEXT_ROW_HEIGHT, height="content",
                 column_config=_widths(claim=200, **{"the paper claims": 390, "tested here as": 390}))
    rows = [{"claim": f"({c['claim']}) {CLAIMS[c['claim']][0]}" if c["claim"] in CLAIMS else c["claim"],
             "what": c["what"], "holds": "yes" if c["holds"] else "no", "margin": c["margin"],
             "spread": _spread(c), "verdict": verdict(c),
             "figures": _figures(c)}
            for c in report["claims"]]
    st.caption(
        f"{report['tokens']:,} held-out tokens of {stored.text_name(provenance)} scored (KL to fp32, nats per token); "
        f"state errors on {report['drift_tokens']:,} tokens at the steps where every dP has just rounded. "
        "Margin: the relative KL (or error) reduction of the claimed better configuration over the best it is "
        f"compared with; negative where the claim does not hold. Spread: the margin's central {SPREAD_LEVEL:.0%} "
        "over bootstrap resamples of the scored windows (the compared configurations resampled together; "
        "claim (d): of the decode steps, which are correlated, so its interval is too narrow), and the share of "
        "resamples in which the claim holds. Verdict: it holds beyond the spread in 97.5% of the resamples or "
        "more, fails beyond it in 2.5% or fewer, else it is within the spread. Claim (c) also varies with the "
        "random allocations it is compared with (below the table). The whole test split: `python -m pace_core "
        "claims --max-tokens 0 --device cuda --batch 128` on a GPU host."
    )
    st.dataframe(pd.DataFrame(rows).style.format({"margin": "{:+.1%}"}), hide_index=True, key="overview_claims",
                 row_height=TEXT_ROW_HEIGHT, height="content",
                 column_config=_widths(claim=150, what=190, holds=50, margin=65, spread=170,
                                       verdict=110, figures=245))
    for c in report["claims"]:
        if "random" in c:
            drawn = c["random"]
            st.caption(
                f"Claim ({escape(c['claim'])}) over its {drawn['n']} random allocations: their KL "
                f"{drawn['kl_mean']:.2e} ± {drawn['kl_sd']:.2e} (mean ± standard deviation); E_h's margin over "
                f"their mean {drawn['margin_vs_mean']:+.1%}; E_h's KL is below "
                + ("every one of them." if drawn["below_all"] else "not every one of them.")
            )
    main = pd.DataFrame(report["main"])
    st.caption(f"Table 2, the paper's main table in shape, over the claims report's {report['tokens']:,} tokens (its "
               "command above): resident bits on the loaded model and on Qwen3.5-27B (the share of 8-bit heads, not "
               "this model's heads), bits per byte, KL and top-1 agreement against fp32. " + _two_tables(report, main,
                                                                                                  quality))
    st.dataframe(main.style.format({"resident_bits": "{:.3f}", "resident_bits_27b": "{:.3f}", "bpb": "{:.4f}",
                                    "kl": "{:.2e}", "agreement": "{:.2%}"}),
                 hide_index=True, key="overview_main_table",
                 column_config={"config": st.column_config.TextColumn(width=220)})


def _figures(claim: dict) -> str:
    """A claim's figures per label: its KL (or state error) and, where the report has them (claims (a) and (e)), the
    resident bits the configuration stores on the model."""
    values = ([f"KL {kl:.2e}" for kl in claim["kl"]] if "kl" in claim
              else [f"{e:.2%}" for e in claim["state_error"]])
    if "resident_bits" in claim:
        values = [f"{v}, {bits:.2f} bits" for v, bits in zip(values, claim["resident_bits"])]
    return ", ".join(f"{label}: {v}" for label, v in zip(claim["labels"], values))


def _spread(claim: dict) -> str:
    """A claim's margin interval and share of resamples in which it holds ('not measured' in an older report)."""
    if "spread" not in claim:
        return "not measured (a report made before spreads: rerun the claims command)"
    sp = claim["spread"]
    return (f"[{sp['low']:+.1%}, {sp['high']:+.1%}] over {sp['n']} {sp['unit']}; holds in {sp['holds_share']:.1%} of "
            "resamples")


def _two_tables(report: dict, main: pd.DataFrame, quality: pd.DataFrame | None) -> str:
    """Why Table 2's KL of a configuration is not Table 1's: the token counts of each, with one configuration
    that is in both as the example ('' without Table 1)."""
    if quality is None:
        return ""
    both = [c for c in main["config"] if c in set(quality["config"])]
    example = ""
    if both:
        name = both[0]
        example = (f" ({escape(name)}: KL {float(quality.set_index('config').loc[name, 'kl']):.2e} in Table 1, "
                   f"{float(main.set_index('config').loc[name, 'kl']):.2e} here)")
    return (f"Table 1 above is over {_scored(quality['tokens'])}, this one over {report['tokens']:,}: the same "
            f"configuration's figures differ between them{example}, and those over fewer tokens vary more with "
            "the text.")


frame.run_page(page)
