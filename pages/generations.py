"""Generations: one prompt, up to four configurations side by side, first divergence marked; live, or
stored by `python -m pace_core generate`."""

import inspect

import pandas as pd
import streamlit as st

from app_state import compute, controls, frame, session, stored
from app_state.library import NAMED_CONFIGS, PaceConfig, generate_side_by_side
from app_state.markup import escape
from pace_core import figures

SAMPLING = {name: p.default for name, p in inspect.signature(generate_side_by_side).parameters.items()
            if name in ("temperature", "top_p")}
"""The temperature and top-p of the live view's sampled mode: generate_side_by_side's own (compute.generations
passes none), shown beside its seed."""


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Generations")
    st.caption("Each configuration continues the same prompt (greedy, or seeded sampling with the same seed "
               "for all, so texts differ only where the state does). The continuation is scored by the fp32 "
               "reference, teacher-forced: NLL = mean nats per generated token, agreement = share of tokens "
               "the reference would also pick as its top-1. The first token that differs from the fp32 "
               "continuation is marked red, what follows it yellow.")

    loaded = session.loaded_model()  # load the model (or show why it cannot) before any control
    result = stored.choose_stored(
        "generation", "generate", loaded.fingerprint,
        lambda r: f"stored: “{_excerpt(r.results[0].data.get('prompt', ''))}” · {', '.join(r.configs)} · "
                  f"{r.provenance.get('date', '?')}",
        "gen_source", live="live: the prompt and configurations below", per_config=True)
    if result is not None:
        st.markdown(f"**Prompt:** {escape(result.results[0].data.get('prompt', '?'))}")
        st.caption("Greedy rows take the most likely token at each step (no seed or temperature); sampled rows use "
                   "the stored command's `--seed`, `--temperature` and `--top-p` (the CLI's defaults where it names "
                   "none), the same for every configuration.")
        _show(result.table)
        return

    prompt = st.text_area("Prompt", compute.default_prompt(), key="gen_prompt", height=90)
    c1, c2, c3 = st.columns([2, 1, 1])
    others = c1.multiselect("Compare with (up to 3)", [n for n in NAMED_CONFIGS if n != "fp32"],
                            default=["rtn-int4"], max_selections=3, key="gen_others",
                            help="The sidebar configuration is always shown; fp32 is the reference.")
    max_new = c2.slider("New tokens", 4, 128, 32, key="gen_tokens")
    mode = c3.radio("Decoding", ["greedy", "sampled"], key="gen_mode", horizontal=True,
                    help="greedy: the most likely token at each step; sampled: a seeded draw from each "
                         "configuration's own distribution, with the same random numbers for all.")
    st.caption(f"Decoding: **{mode}**. " + (
        "Greedy takes the most likely token at each step: no seed or temperature enter (sampled: seed "
        f"{compute.GENERATION_SEED}, temperature {SAMPLING['temperature']:g}, top-p {SAMPLING['top_p']:g})."
        if mode == "greedy" else
        f"Seed {compute.GENERATION_SEED}, temperature {SAMPLING['temperature']:g}, top-p {SAMPLING['top_p']:g}, the "
        "same for every configuration: their texts differ only where their states do."))
    if not prompt.strip():
        st.error("The prompt is empty: type a prompt to generate from.", icon=":material/edit:")
        st.stop()

    configs = {f"sidebar: {cfg.name}": cfg}
    configs.update({n: NAMED_CONFIGS[n] for n in others})
    _show(compute.generations(controls.model_source(), controls.runtime(),
                                tuple((label, controls.config_key(c)) for label, c in configs.items()),
                                prompt, max_new, mode))


def _excerpt(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _show(table: pd.DataFrame) -> None:
    """Per decoding mode of ``table`` (pace_core.analysis.generation.generate_side_by_side's rows): the
    summary table, then the continuations side by side, each with its first divergence marked."""
    modes = list(table["mode"].unique())
    st.caption("A low NLL is not a good text: the reference scores each token given the text before it, so a "
               "degenerate continuation that repeats itself (a 2-bit state often does) is easy to predict and "
               "can score below fp32's own. Read the NLL beside the text and its first divergence.")
    for mode, part in table.groupby("mode", sort=False):
        if len(modes) > 1:
            st.subheader(str(mode))
        divergence = [None if pd.isna(d) else int(d) for d in part["first_divergence"]]
        summary = pd.DataFrame({"configuration": part["config"], "NLL (nats/token)": part["ref_nll"],
                                "top-1 agreement": part["ref_agreement"],
                                "first divergence": ["none" if d is None else f"token {d}" for d in divergence]})
        st.dataframe(summary.style.format({"NLL (nats/token)": "{:.3f}", "top-1 agreement": "{:.1%}"}),
                     hide_index=True, key=f"gen_summary_{mode}")
        for start in range(0, len(part), COLUMNS):
            columns = st.columns(COLUMNS, border=True)
            rows = list(part.iterrows())[start:start + COLUMNS]
            for col, (_, row), first in zip(columns, rows, divergence[start:start + COLUMNS]):
                with col:
                    reference = row["config"] == "fp32"
                    st.markdown(f"**{escape(row['config'])}**" + (" · reference" if reference else ""))
                    st.caption("the reference" if reference else
                               "identical to fp32" if first is None else f"differs from token {first} on")
                    st.html(figures.generation_html(list(row["pieces"]), first))


COLUMNS = 3
"""Continuations per row of side-by-side columns."""


frame.run_page(page)
