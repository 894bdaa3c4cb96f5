"""Calibration on a calibration text: PACE-4/8's 8-bit heads (spec §4) and what a method chooses per layer on
the model for the configuration's settings (:attr:`pace_core.methods.Method.calibrate`: DAMP's outlier rows,
static scales' ranges).

The fp32 reference model reads the first ``tokens`` tokens of the calibration text in one forward; after
every ``sample_every`` tokens every GDN layer's state is one calibration state. A tap on the GDN layers' core calls
(:func:`pace_core.model.patch.tapped`) records the recurrence's inputs as transformers computes them (``q, k``
prepared, ``g = −exp(A_log) · softplus(a + dt_bias)``, ``beta``; spec §1). Then per GDN layer and value head:
``a_h`` (mean ``exp(g)``), ``e_h`` (mean ``‖Q(S) − S‖²_F`` with the configuration's low-bit group quantiser),
``E_h = e_h / (1 − a_h^{2 dP})``, and the top ``high_share`` of heads by ``E_h`` keep ``high_bits``
(:mod:`pace_core.heads`); a method with per-layer tensors computes them from the same samples, or from its own
(:attr:`pace_core.methods.Method.sampling`: STEPQuant's authors' protocol, :func:`protocol_samples`).

The calibration text defaults to the WikiText-2 validation split; the test split is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from pace_core.analysis.text import CALIBRATION_TEXT, is_test_split, read_text, tokenize
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.export import config_from_dict, config_to_dict
from pace_core.heads import head_decay, high_heads_for, retained_error, rounding_error
from pace_core.methods import METHODS, Calibrated, Sampling, method_of
from pace_core.model.loading import LoadedModel
from pace_core.model.patch import core_inputs, tapped
from pace_core.model.teacher import Member, teacher_forced


@dataclass
class Calibration:
    """Calibration of one configuration on one model.

    a, e, E [L, HV] float64 (L = GDN layers in ``layers`` order; ``e`` and ``E`` of the configuration's group
    quantiser, zeros for a method without one); ``config`` carries ``high_heads`` when ``high_share > 0`` and its
    method's calibrated tensors (``calibrated``) when it has them.
    """

    config: PaceConfig
    layers: list[int]
    a: torch.Tensor
    e: torch.Tensor
    E: torch.Tensor
    tokens: int
    samples: int

    def to_data(self) -> dict:
        """The calibration as plain JSON data (``calibrate``'s stored result; :meth:`from_data` reads it)."""
        return {"config": config_to_dict(self.config), "layers": self.layers, "a": self.a.tolist(),
                "e": self.e.tolist(), "E": self.E.tolist(), "tokens": self.tokens, "samples": self.samples}

    @classmethod
    def from_data(cls, d: dict) -> Calibration:
        """The calibration of :meth:`to_data`'s data; PaceError when fields are missing or malformed."""
        try:
            return cls(config_from_dict(d["config"]), list(d["layers"]), torch.tensor(d["a"], dtype=torch.float64),
                       torch.tensor(d["e"], dtype=torch.float64), torch.tensor(d["E"], dtype=torch.float64),
                       int(d["tokens"]), int(d["samples"]))
        except (KeyError, TypeError, ValueError) as err:
            raise PaceError(f"stored calibration: {err!r} is missing or malformed; allowed: data written by "
                            "python -m pace_core calibrate") from None

    def allocate(self, cfg: PaceConfig) -> PaceConfig:
        """``cfg`` with the 8-bit heads this calibration gives it (its dP and share; unchanged when it
        has no share of high-bit heads). The quantiser of ``cfg`` must be the calibrated one."""
        if cfg.high_share == 0:
            return cfg
        return cfg.replace(high_heads=high_heads_for(self.a, self.e, cfg)[1])

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


@torch.no_grad()
def reference_samples(
    loaded: LoadedModel, ids: torch.Tensor, sample_every: int, progress: Callable[[int], None] | None = None,
    on_state: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """fp32 reference states after every ``sample_every`` tokens and the recurrence's inputs of all tokens, in
    one forward (:func:`pace_core.model.teacher.teacher_forced`, the reference's prompt cut at the samples).

    ids [1, T] -> (``{layer: S [N, HV, K, V]}`` with N = T // sample_every, ``{layer: {"q", "k": [T', H, K]
    prepared, "g", "beta": [T', HV]}}``, T' the N · sample_every tokens sampled), on each layer's device: kept
    there with no read-back per sample, so that a calibration on them runs where the model runs. With
    ``on_state``, each state ``S [HV, K, V]`` goes to ``on_state(layer, S)`` as it is read (a layer's in order; S is
    the run's own, valid during the call) and none is kept (``{}``).
    """
    model = loaded.model
    n = ids.shape[1] // sample_every * sample_every
    inputs: dict[int, dict[str, torch.Tensor]] = {}
    states: dict[int, list[torch.Tensor]] = {layer: [] for layer in loaded.gdn_layers}

    def record(module, arguments: dict, decode: bool) -> None:
        q, k, _, g, beta = core_inputs(module, arguments)
        inputs[int(module.layer_idx)] = {"q": q[0], "k": k[0], "g": g[0], "beta": beta[0]}

    def keep(member: int, layer: int, step: int, S: torch.Tensor) -> None:
        if on_state is None:
            states[layer].append(S[0].clone())
        else:
            on_state(layer, S[0])

    with tapped(model, record):
        teacher_forced(loaded, [Member("fp32", get_config("fp32"))], ids[:, :n], n,
                       capture_steps=range(sample_every, n + 1, sample_every), on_state=keep, logits_from=n - 1,
                       progress=progress)
    return ({} if on_state is not None else {layer: torch.stack(s) for layer, s in states.items()}), inputs


class Reservoir:
    """A seeded reservoir of ``size`` states (:class:`pace_core.methods.Sampling`): the first ``size`` states
    offered are kept; the k-th after them (k counting every state offered) replaces slot ``i = randint(k)`` of a
    ``torch.Generator`` seeded ``seed`` when ``i < size`` (STEPQuant's ``LayerStatistics``)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.offered, self.kept = size, 0, []
        self.generator = torch.Generator().manual_seed(seed)

    def offer(self, S: torch.Tensor) -> None:
        self.offered += 1
        if len(self.kept) < self.size:
            self.kept.append(S.clone())
            return
        i = int(torch.randint(self.offered, (), generator=self.generator))
        if i < self.size:
            self.kept[i].copy_(S)


@dataclass
class CalibrationSamples:
    """What every calibration of one model on one text shares: the fp32 reference states and the recurrence's
    inputs of :func:`reference_samples` (``states {layer: S [N, HV, K, V]}``, ``inputs {layer: {"q", "k", "g",
    "beta"}}``, on each layer's device) and the settings they were taken with. Calibrating another quantiser on
    them costs no forward.

    The samples of a method's own ``sampling`` (:func:`protocol_samples`) hold the reservoir's states, of the inputs
    only ``g [segments, T, HV]``, and ``sums {layer: {name: float64}}``, what its ``reduce`` kept of every window,
    added up over the ``tokens`` tokens read."""

    text: str
    tokens: int
    sample_every: int
    states: dict[int, torch.Tensor]
    inputs: dict[int, dict[str, torch.Tensor]]
    sampling: Sampling | None = None
    sums: dict[int, dict[str, torch.Tensor]] | None = None

    def describe(self) -> str:
        """What was read, in words: '2,048 tokens of wikitext2-valid.txt, 32 states (one every 64 tokens)'."""
        name, n = Path(self.text).name, int(next(iter(self.states.values())).shape[0])
        if self.sampling is None:
            return f"{self.tokens:,} tokens of {name}, {n} states (one every {self.sample_every} tokens)"
        return f"{self.tokens:,} tokens of {name} ({self.sampling.describe()}), {n} states"

    @property
    def decays(self) -> dict[int, torch.Tensor]:
        """The log decays ``{layer: g [T', HV]}``."""
        return {layer: x["g"] for layer, x in self.inputs.items()}


def calibration_samples(loaded: LoadedModel, text_path: str | os.PathLike | None = None, *, tokens: int = 2048,
                        sample_every: int = 64,
                        progress: Callable[[int], None] | None = None) -> CalibrationSamples:
    """The reference samples of the first ``tokens`` tokens of the text at ``text_path`` (default: WikiText-2
    valid; the test split is refused), one every ``sample_every`` tokens. ``progress(n)``: units of
    :func:`calibration_progress_total`."""
    path = _calibration_text(text_path)
    if sample_every < 1:
        raise PaceError(f"sample_every: must be >= 1, got {sample_every}")
    if tokens < sample_every:
        raise PaceError(f"tokens: must be >= sample_every={sample_every}, got {tokens}")
    ids = tokenize(loaded.tokenizer, read_text(path), tokens, min_tokens=sample_every)
    states, inputs = reference_samples(loaded, ids, sample_every, progress)
    return CalibrationSamples(str(path), int(ids.shape[1]), sample_every, states, inputs)


def _calibration_text(text_path: str | os.PathLike | None) -> str | os.PathLike:
    """The calibration text's path (default WikiText-2 valid); PaceError for the test split."""
    path = CALIBRATION_TEXT if text_path is None else text_path
    if is_test_split(path):
        raise PaceError(
            f"text: {str(path)!r} is the WikiText-2 test split; allowed: any other text "
            f"(default {CALIBRATION_TEXT.name}); the test split is for held-out perplexity only"
        )
    return path


def protocol_samples(loaded: LoadedModel, text_path: str | os.PathLike | None, sampling: Sampling, *,
                     progress: Callable[[int], None] | None = None) -> CalibrationSamples:
    """The samples of a method's own ``sampling`` (:class:`pace_core.methods.Sampling`) of the text at ``text_path``
    (default WikiText-2 valid): the whole text tokenised; ``sampling.segments`` windows of ``sampling.tokens`` tokens
    at offsets ``randint(T − tokens + 1)`` of a generator seeded ``sampling.seed``, each read by the fp32 reference
    from a zero state; every ``sampling.every``-th state of each GDN layer offered to its :class:`Reservoir`, the
    layer's inputs of each window reduced by ``sampling.reduce`` and added up. ``progress(n)``: units of
    :func:`calibration_progress_total` with this sampling."""
    path = _calibration_text(text_path)
    ids = tokenize(loaded.tokenizer, read_text(path), min_tokens=1)
    if ids.shape[1] < sampling.tokens:
        raise PaceError(f"text: {str(path)!r} gives {ids.shape[1]:,} tokens; {sampling.name} read windows of "
                        f"{sampling.tokens:,}; allowed: a longer text, or the shared calibration samples")
    rng = torch.Generator().manual_seed(sampling.seed)
    starts = [int(torch.randint(ids.shape[1] - sampling.tokens + 1, (), generator=rng))
              for _ in range(sampling.segments)]
    reservoirs = {layer: Reservoir(sampling.reservoir, sampling.seed) for layer in loaded.gdn_layers}
    sums: dict[int, dict[str, torch.Tensor]] = {}
    decays: dict[int, list[torch.Tensor]] = {layer: [] for layer in loaded.gdn_layers}
    for start in starts:
        _, inputs = reference_samples(loaded, ids[:, start:start + sampling.tokens], sampling.every, progress,
                                      on_state=lambda layer, S: reservoirs[layer].offer(S))
        for layer, x in inputs.items():
            window = sampling.reduce(x)
            sums[layer] = window if layer not in sums else {k: sums[layer][k] + v for k, v in window.items()}
            decays[layer].append(x["g"])
    return CalibrationSamples(str(path), sampling.total_tokens, sampling.every,
                              {layer: torch.stack(r.kept) for layer, r in reservoirs.items()},
                              {layer: {"g": torch.stack(g)} for layer, g in decays.items()}, sampling, sums)


def calibration_progress_total(loaded: LoadedModel, sampling: Sampling | None = None) -> int:
    """The progress units of :func:`calibration_samples` (and of :func:`calibrate` without samples), or of
    :func:`protocol_samples` with ``sampling``."""
    return len(loaded.gdn_layers) * (1 if sampling is None else sampling.segments)


def calibrate(
    loaded: LoadedModel,
    cfg: PaceConfig,
    text_path: str | os.PathLike | None = None,
    *,
    tokens: int = 2048,
    sample_every: int = 64,
    samples: CalibrationSamples | None = None,
    progress: Callable[[int], None] | None = None,
) -> Calibration:
    """Calibrate ``cfg`` on ``loaded`` with the text at ``text_path`` (default: WikiText-2 valid), or on the
    ``samples`` of an earlier :func:`calibration_samples` (then the text and its settings are theirs). A method with
    its own sampling for ``cfg`` (:attr:`pace_core.methods.Method.sampling`, e.g. STEPQuant's authors' protocol)
    calibrates on :func:`protocol_samples` of that text (``tokens`` and ``sample_every`` are the sampling's), unless
    ``samples`` are those.

    Every configuration gets ``a`` and, with a group quantiser, ``e, E`` (for DAMP without its outlier rows);
    a share of high-bit heads gets ``high_heads``; per-layer tensors its method calibrates for these settings
    (:attr:`pace_core.methods.Method.calibration`) come as ``calibrated``.
    """
    method = method_of(cfg)
    if not (method.head_widths or method.calibrate):
        able = ", ".join(name for name, m in METHODS.items() if m.head_widths or m.calibrate)
        raise PaceError(f"config method {cfg.method!r} has nothing to calibrate; allowed: {able}")
    sampling = method.sampling(cfg)
    if samples is not None and samples.sampling != sampling:
        text_path, samples = samples.text, None
    if samples is None and sampling is not None:
        samples = protocol_samples(loaded, text_path, sampling, progress=progress)
    elif samples is None:
        samples = calibration_samples(loaded, text_path, tokens=tokens, sample_every=sample_every, progress=progress)
    states, decays = samples.states, samples.decays
    layers = list(loaded.gdn_layers)
    a = torch.stack([head_decay(decays[layer]).cpu() for layer in layers])
    if method.grouped:
        spec = cfg.quant_spec()
        e = torch.stack([rounding_error(states[layer], spec).cpu() for layer in layers])
    else:
        e = torch.zeros_like(a)
    E = retained_error(e, a, cfg.decode_period)
    if method.calibration(cfg) is not None:
        cfg = cfg.replace(calibrated=Calibrated(method.calibrate(cfg, samples, layers)))
    calibration = Calibration(cfg, layers, a, e, E, samples.tokens, int(next(iter(states.values())).shape[0]))
    if cfg.high_share > 0:
        calibration.config = calibration.allocate(cfg)
    return calibration
