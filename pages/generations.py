"""Generations: one prompt, up to four configurations side by side, first divergence marked."""

import pandas as pd
import streamlit as st

import app_state
from pace_core import figures
from pace_core.config import NAMED_CONFIGS, PaceConfig


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Generations")
    st.caption("Each configuration continues the same prompt (greedy, or seeded sampling with the same seed "
               "for all, so texts differ only where the state does). The continuation is scored by the fp32 "
               "reference, teacher-forced: NLL = mean nats per generated token, agreement = share of tokens "
               "the reference would also pick as its top-1. The first token that differs from the fp32 "
               "continuation is marked red, what follows it yellow.")

    app_state.loaded_model()  # load the model (or show why it cannot) before any control

    prompt = st.text_area("Prompt", app_state.default_prompt(), key="gen_prompt", height=90)
    c1, c2, c3 = st.columns([2, 1, 1])
    others = c1.multiselect("Compare with (up to 3)", [n for n in NAMED_CONFIGS if n != "fp32"],
                            default=["rtn-int4"], max_selections=3, key="gen_others",
                            help="The sidebar configuration is always shown; fp32 is the reference.")
    max_new = c2.slider("New tokens", 4, 128, 16, key="gen_tokens")
    mode = c3.radio("Decoding", ["greedy", "sampled"], key="gen_mode", horizontal=True)
    if not prompt.strip():
        st.error("The prompt is empty: type a prompt to generate from.", icon=":material/edit:")
        st.stop()

    configs = {f"sidebar: {cfg.name}": cfg}
    configs.update({n: NAMED_CONFIGS[n] for n in others})
    table = app_state.generations(app_state.model_source(), st.session_state["device"],
                                  tuple((label, app_state.config_key(c)) for label, c in configs.items()),
                                  prompt, max_new, mode)
    divergence = [None if pd.isna(d) else int(d) for d in table["first_divergence"]]
    summary = pd.DataFrame({"configuration": table["config"], "NLL (nats/token)": table["ref_nll"],
                            "top-1 agreement": table["ref_agreement"],
                            "first divergence": ["none" if d is None else f"token {d}" for d in divergence]})
    st.dataframe(summary.style.format({"NLL (nats/token)": "{:.3f}", "top-1 agreement": "{:.1%}"}),
                 hide_index=True, key="gen_summary")
    for (_, row), first in zip(table.iterrows(), divergence):
        st.markdown(f"**{row['config']}**" + (" · reference" if row["config"] == "fp32" else ""))
        st.html(figures.generation_html(row["pieces"], first))


app_state.run_page(page)
