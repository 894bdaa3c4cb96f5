"""Head calibration for PACE-4/8 (spec §4) and DAMP outlier rows, on a calibration text.

The fp32 reference model reads the first ``tokens`` tokens of the calibration text in chunks of
``sample_every`` tokens (transformers' own cache carries the state from chunk to chunk); after each
chunk every GDN layer's state is one calibration state. Forward hooks on the GDN modules record the
log decays ``g [T, HV]`` (``g = −exp(A_log) · softplus(a + dt_bias)``, spec §1, from the module's own
projections). Then per GDN layer and value head: ``a_h`` (mean ``exp(g)``), ``e_h`` (mean
``‖Q(S) − S‖²_F`` with the configuration's low-bit quantiser), ``E_h = e_h / (1 − a_h^{2 dP})``, and
the top ``high_share`` of heads by ``E_h`` keep ``high_bits`` (:mod:`pace_core.heads`).

The calibration text defaults to the WikiText-2 validation split; the test split is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from pace_core.analysis.text import CALIBRATION_TEXT, is_test_split, read_text, tokenize
from pace_core.config import HIGH_SHARE_METHODS, PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.heads import allocate_high_heads, head_decay, retained_error, rounding_error
from pace_core.model.capture import cache_states
from pace_core.model.loading import LoadedModel
from pace_core.model.patch import gdn_modules, pace
from pace_core.outliers import rank_outlier_rows


@dataclass
class Calibration:
    """Calibration of one configuration on one model.

    a, e, E [L, HV] float64 (L = GDN layers in ``layers`` order); ``config`` carries ``high_heads``
    when ``high_share > 0``; ``damp_rows`` one ``[HV, r]`` tensor per GDN layer for damp configs.
    """

    config: PaceConfig
    layers: list[int]
    a: torch.Tensor
    e: torch.Tensor
    E: torch.Tensor
    tokens: int
    samples: int
    damp_rows: list[torch.Tensor] | None = None

    def table(self) -> pd.DataFrame:
        """One row per GDN layer and head: layer, gdn_index, head, a, e, E, high (keeps high_bits)."""
        high = self.config.high_heads or ((),) * len(self.layers)
        return pd.DataFrame(
            [
                {
                    "layer": layer,
                    "gdn_index": i,
                    "head": h,
                    "a": float(self.a[i, h]),
                    "e": float(self.e[i, h]),
                    "E": float(self.E[i, h]),
                    "high": h in high[i],
                }
                for i, layer in enumerate(self.layers)
                for h in range(self.a.shape[1])
            ]
        )


def _decay_hook(store: dict[int, list[torch.Tensor]], layer: int):
    """Forward hook recording ``g [T, HV]`` of a GDN module from its input hidden states."""

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if hasattr(module, "in_proj_a"):
            a = module.in_proj_a(h)
        else:  # Qwen3-Next packs b and a into in_proj_ba
            a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))[5]
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        store[layer].append(g[0].detach().cpu())

    return hook


@torch.no_grad()
def reference_samples(
    loaded: LoadedModel, ids: torch.Tensor, sample_every: int, progress: Callable[[int], None] | None = None
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """fp32 reference states after every ``sample_every`` tokens and the log decays of all tokens.

    ids [1, T] -> (``{layer: S [N, HV, K, V]}`` with N = T // sample_every, ``{layer: g [T, HV]}``).
    """
    model = loaded.model
    decays: dict[int, list[torch.Tensor]] = {layer: [] for layer in loaded.gdn_layers}
    handles = [m.register_forward_hook(_decay_hook(decays, layer), with_kwargs=True) for layer, m in gdn_modules(model)]
    states: dict[int, list[torch.Tensor]] = {layer: [] for layer in loaded.gdn_layers}
    try:
        with pace(model, get_config("fp32")):
            cache = DynamicCache(config=model.config)
            n = ids.shape[1] // sample_every * sample_every
            for start in range(0, n, sample_every):
                model(input_ids=ids[:, start : start + sample_every].to(loaded.device), past_key_values=cache, use_cache=True)
                for layer, S in cache_states(cache, loaded.gdn_layers).items():
                    states[layer].append(S[0])
                if progress is not None:
                    progress(1)
    finally:
        for h in handles:
            h.remove()
    return (
        {layer: torch.stack(s) for layer, s in states.items()},
        {layer: torch.cat(g) for layer, g in decays.items()},
    )


def calibrate(
    loaded: LoadedModel,
    cfg: PaceConfig,
    text_path: str | os.PathLike | None = None,
    *,
    tokens: int = 2048,
    sample_every: int = 64,
    progress: Callable[[int], None] | None = None,
) -> Calibration:
    """Calibrate ``cfg`` on ``loaded`` with the text at ``text_path`` (default: WikiText-2 valid).

    Every method gets ``a, e, E`` (``e`` with the config's group quantiser, for damp without its
    outlier rows); rtn/pace with ``high_share > 0`` get ``high_heads``; damp gets its outlier rows (``damp_outlier_rows`` per head, :func:`pace_core.outliers.rank_outlier_rows`).
    """
    path = CALIBRATION_TEXT if text_path is None else text_path
    if is_test_split(path):
        raise PaceError(
            f"text: {str(path)!r} is the WikiText-2 test split; allowed: any other text "
            f"(default {CALIBRATION_TEXT.name}); the test split is for held-out perplexity only"
        )
    if cfg.method not in (*HIGH_SHARE_METHODS, "damp"):
        raise PaceError(f"config method {cfg.method!r} has nothing to calibrate; allowed: rtn, pace, damp")
    if sample_every < 1:
        raise PaceError(f"sample_every: must be >= 1, got {sample_every}")
    if tokens < sample_every:
        raise PaceError(f"tokens: must be >= sample_every={sample_every}, got {tokens}")
    ids = tokenize(loaded.tokenizer, read_text(path), tokens, min_tokens=sample_every)
    states, decays = reference_samples(loaded, ids, sample_every, progress)
    layers = list(loaded.gdn_layers)
    a = torch.stack([head_decay(decays[layer]) for layer in layers])
    spec = cfg.quant_spec()
    e = torch.stack([rounding_error(states[layer], spec) for layer in layers])
    E = retained_error(e, a, cfg.decode_period)
    calibrated, damp_rows = cfg, None
    if cfg.method == "damp":
        damp_rows = [
            rank_outlier_rows(states[layer], a[i], cfg.damp_outlier_rows, bits=cfg.bits,
                              hadamard=cfg.damp_hadamard, group_size=cfg.group_size)
            for i, layer in enumerate(layers)
        ]
    elif cfg.high_share > 0:
        calibrated = cfg.replace(high_heads=allocate_high_heads(E, cfg.high_share)).validate_for(loaded.shape)
    return Calibration(calibrated, layers, a, e, E, int(ids.shape[1]), int(next(iter(states.values())).shape[0]), damp_rows)
