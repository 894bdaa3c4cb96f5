"""Grid sweep of bits × dP × group axis × group size on one text, layer-local and batched.

Running every grid point through the whole model token by token is far too slow on a CPU (one
decode step of the embedded model is tens of milliseconds, and the default grid has 30 points), so
the sweep measures the state error where it arises, in each GDN layer, with the layer's own inputs:

1. One fp32 forward of the model over the ``T`` tokens records every GDN layer's core inputs
   ``q, k, v, g, beta`` (:func:`record_gdn_inputs`, the arguments transformers passes to its chunked
   gated delta rule; q, k then go through :func:`pace_core.recurrence.prepare_qk` as in PACE).
2. All GDN layers are stacked in the batch dimension. The reference state runs the exact chunked
   recurrence. Each grid point prefills the first ``T − N`` tokens in P-token segments with its
   quantiser, then decodes the last ``N`` tokens: per-token rounding (dP = 1), otherwise the buffered
   decode in the configured buffer precision with a flush every dP, both by the schedule of
   :class:`pace_core.schedule.PeriodicState` on a fake-quantised checkpoint (bit-identical to the stored
   format). Grid points with the same dP and buffer run as one batch.

**[ours]** The measurement is layer-local (teacher-forced at every layer's input): it isolates each
layer's state rounding error from the error its inputs inherit from earlier layers. Whole-model
effects (excess NLL, agreement) are measured by ``drift`` and ``perplexity``.

Measurements per grid point: relative state error ``‖S̃ − S‖_F / ‖S‖_F`` (all GDN layers pooled)
after the prefill, every ``record_every`` decode steps and at the end; the relative error of the GDN
outputs over the decoded tokens; resident bits per state value (:mod:`pace_core.accounting`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from pace_core.accounting import resident_bits
from pace_core.analysis.metrics import relative_error, squared_norms
from pace_core.backend import REFERENCE
from pace_core.checkpoint import RoundingFormat
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.methods import METHODS, method_of
from pace_core.methods.groups import GroupFormat
from pace_core.model.loading import LoadedModel
from pace_core.model.patch import core_inputs, gdn_modules, pace, tapped
from pace_core.quant import fake_quantize
from pace_core.recurrence import gdn_chunked
from pace_core.schedule import PeriodicState

DEFAULT_BITS = (3, 4, 5, 6, 8)
DEFAULT_PERIODS = (1, 8, 32)
DEFAULT_AXES = ("key", "value")
DEFAULT_GROUP_SIZES = (32,)


@dataclass
class GDNInputs:
    """Core inputs of all GDN layers stacked in the batch dim (L = GDN layers, ``layers`` order):
    q, k [L, T, H, K] (prepared), v [L, T, HV, V], g, beta [L, T, HV], float32 (float64: a float64 sweep, whose
    checkpoints are float64 too)."""

    layers: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def part(self, sl: slice, repeat: int = 1) -> tuple[torch.Tensor, ...]:
        """(q, k, v, g, beta) of tokens ``sl``, repeated ``repeat`` times along the batch."""
        return tuple(
            x[:, sl].repeat(repeat, *([1] * (x.dim() - 1))) for x in (self.q, self.k, self.v, self.g, self.beta)
        )


@torch.no_grad()
def record_gdn_inputs(loaded: LoadedModel, ids: torch.Tensor) -> GDNInputs:
    """Run the fp32 reference model on ids [1, T] and record every GDN layer's core inputs (the arguments
    transformers passes to its chunked gated delta rule, through :func:`pace_core.model.patch.tapped`)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise PaceError(f"ids: expected shape [1, T], got {tuple(ids.shape)}")
    model = loaded.model
    modules = gdn_modules(model)
    records: dict[int, tuple[torch.Tensor, ...]] = {}

    def record(module, arguments: dict, decode: bool) -> None:  # on one device: layers may sit on several
        records[int(module.layer_idx)] = tuple(t.to(loaded.device) for t in core_inputs(module, arguments))

    with pace(model, get_config("fp32")), tapped(model, record):
        model(input_ids=ids.to(loaded.device))
    q, k, v, g, beta = (torch.cat(x) for x in zip(*(records[layer] for layer, _ in modules)))
    return GDNInputs([layer for layer, _ in modules], q, k, v, g, beta)


def grid_configs(
    bits: Sequence[int] = DEFAULT_BITS,
    periods: Sequence[int] = DEFAULT_PERIODS,
    axes: Sequence[str] = DEFAULT_AXES,
    group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
    base: PaceConfig | None = None,
) -> list[PaceConfig]:
    """The grid points as PaceConfigs (method pace, everything else from ``base``, default pace-4),
    named ``b{bits}-dP{dP}-{axis}-g{group}``."""
    base = base if base is not None else get_config("pace-4")
    for field, values in (("bits", bits), ("periods", periods), ("axes", axes), ("group_sizes", group_sizes)):
        if not values:
            raise PaceError(f"{field}: need at least one value")
    return [
        base.replace(name=f"b{b}-dP{dp}-{ax}-g{gs}", method="pace", bits=b, decode_period=dp, group_axis=ax,
                     group_size=gs, high_share=0.0, high_heads=None)
        for b, dp, ax, gs in itertools.product(bits, periods, axes, group_sizes)
    ]


def _decode_group(cfg: PaceConfig) -> tuple:
    """Grid points that decode as one batch: the same dP and, when buffered, the same buffer format and
    reading of the current token."""
    buffered = cfg.decode_period > 1
    return cfg.decode_period, cfg.buffer_format if buffered else None, cfg.exact_current_token and buffered


def sweep_states(
    inputs: GDNInputs,
    configs: Sequence[PaceConfig],
    decode_tokens: int,
    *,
    record_every: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Layer-local state errors of ``configs`` (methods rtn/pace, no high-bit heads, no combinations) on ``inputs``.

    The last ``decode_tokens`` tokens are decoded, the rest prefilled. ``record_every`` (default:
    the lcm of the decode periods, capped to ``decode_tokens``) must be a multiple of every dP.
    Returns (summary: one row per config; steps: config, step, rel_error at each recorded step).
    """
    L, T = inputs.q.shape[:2]
    if not 1 <= decode_tokens < T:
        raise PaceError(f"decode_tokens: must be in 1..{T - 1} (tokens T={T}), got {decode_tokens}")
    for cfg in configs:
        if method_of(cfg).format is not GroupFormat or cfg.high_share > 0 or cfg.combined:
            allowed = ", ".join(name for name, m in METHODS.items() if m.format is GroupFormat)
            raise PaceError(f"configs: {cfg.name!r} not allowed in a sweep; allowed: methods {allowed} (packed groups) "
                            "without high-bit heads and without combinations (stochastic rounding, key rotation, "
                            "static scales)")
    periods = sorted({c.decode_period for c in configs})
    every = record_every if record_every is not None else min(math.lcm(*periods), decode_tokens)
    if every < 1 or (every < decode_tokens and any(every % p for p in periods)):
        raise PaceError(f"record_every: {every} not allowed; allowed: a positive multiple of every dP {periods}")
    D = T - decode_tokens
    blocks = [(s, min(s + every, T)) for s in range(D, T, every)]
    # reference: exact recurrence, states at each block end and the decode outputs
    _, S = gdn_chunked(*inputs.part(slice(0, D)))
    ref_states, ref_out = [S], []
    for s, e in blocks:
        o, S = gdn_chunked(*inputs.part(slice(s, e)), S)
        ref_states.append(S)
        ref_out.append(o)
    ref_sq = [squared_norms(S, 1)[0] for S in ref_states]
    ref_out_sq = sum(float(squared_norms(o, 1)[0]) for o in ref_out)
    # prefill per distinct quantiser and P; with P >= the prompt the prefill is one segment, whose
    # rounded end state is the rounded reference state (no second run needed)
    _, _, H, K = inputs.q.shape
    HV, V = inputs.v.shape[2:]
    prefilled: dict[tuple, torch.Tensor] = {}
    for cfg in configs:
        spec = cfg.quant_spec()
        key = (spec, min(cfg.prefill_period, D))
        if key in prefilled:
            continue
        if cfg.prefill_period >= D:
            prefilled[key] = fake_quantize(ref_states[0], spec)
        else:
            fmt = RoundingFormat(lambda S, spec=spec: fake_quantize(S, spec), dtype=inputs.q.dtype)
            st = PeriodicState(fmt, REFERENCE, (L, H, HV, K, V), inputs.q.device, prefill_period=cfg.prefill_period,
                               decode_period=1)
            st.prefill(*inputs.part(slice(0, D)))
            prefilled[key] = st.loaded()
    if progress is not None:
        progress(1)
    summary, steps = [], []
    groups: dict[tuple, list[PaceConfig]] = {}
    for cfg in configs:
        groups.setdefault(_decode_group(cfg), []).append(cfg)
    for (dp, buffer, exact), members in groups.items():
        n = len(members)
        specs = [c.quant_spec() for c in members]

        def round_fn(S: torch.Tensor, specs=specs) -> torch.Tensor:
            """Each member's slice [L, HV, K, V] of S [n·L, HV, K, V] through its quantiser."""
            return torch.cat([fake_quantize(S[i * L:(i + 1) * L], sp) for i, sp in enumerate(specs)])

        st = PeriodicState(RoundingFormat(round_fn, dtype=inputs.q.dtype), REFERENCE, (n * L, H, HV, K, V),
                           inputs.q.device, prefill_period=D, decode_period=dp, buffer=buffer or "fp32",
                           exact_current=exact)
        st.set_checkpoint(torch.cat([prefilled[(c.quant_spec(), min(c.prefill_period, D))] for c in members]))
        errs = [(squared_norms(st.loaded() - ref_states[0].repeat(n, 1, 1, 1), n))]
        out_err = torch.zeros(n, dtype=torch.float64, device=inputs.q.device)
        for b, (s, e) in enumerate(blocks):
            o = st.decode(*inputs.part(slice(s, e), n))
            errs.append(squared_norms(st.effective_state() - ref_states[b + 1].repeat(n, 1, 1, 1), n))
            out_err += squared_norms(o - ref_out[b].repeat(n, 1, 1, 1), n)
            if progress is not None:
                progress(1)
        for i, cfg in enumerate(members):
            rel = [relative_error(err[i], ref_sq[j]) for j, err in enumerate(errs)]
            steps += [{"config": cfg.name, "step": (blocks[j - 1][1] - D) if j else 0, "rel_error": r}
                      for j, r in enumerate(rel)]
            summary.append({"config": cfg, "prefill_rel_error": rel[0], "final_rel_error": rel[-1],
                            "mean_rel_error": sum(rel[1:]) / len(rel[1:]),
                            "output_rel_error": relative_error(out_err[i], ref_out_sq)})
    order = {c.name: i for i, c in enumerate(configs)}
    summary.sort(key=lambda r: order[r["config"].name])
    return pd.DataFrame(summary), pd.DataFrame(steps)


def summary_table(summary: pd.DataFrame, shape) -> pd.DataFrame:
    """Flatten :func:`sweep_states`' summary: config fields plus resident bits on ``shape``."""
    rows = []
    for r in summary.to_dict("records"):
        cfg: PaceConfig = r.pop("config")
        bits = resident_bits(cfg, shape)
        rows.append({"config": cfg.name, "bits": cfg.bits, "decode_period": cfg.decode_period,
                     "group_axis": cfg.group_axis, "group_size": cfg.group_size, "buffer": cfg.buffer, **r,
                     "payload_bits": float(bits.payload_bits), "metadata_bits": float(bits.metadata_bits),
                     "buffer_bits": float(bits.buffer_bits), "resident_bits": float(bits.resident_bits)})
    return pd.DataFrame(rows)


def sweep(
    loaded: LoadedModel,
    ids: torch.Tensor,
    configs: Sequence[PaceConfig],
    *,
    decode_tokens: int = 128,
    record_every: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Record the GDN inputs of ``ids [1, T]`` and run :func:`sweep_states`; returns (summary with
    resident bits, per-step table)."""
    for cfg in configs:
        cfg.validate_for(loaded.shape)
    inputs = record_gdn_inputs(loaded, ids)
    if progress is not None:
        progress(1)
    summary, steps = sweep_states(inputs, configs, decode_tokens, record_every=record_every, progress=progress)
    return summary_table(summary, loaded.shape), steps


def sweep_progress_total(
    configs: Sequence[PaceConfig], T: int, decode_tokens: int, record_every: int | None = None
) -> int:
    """Number of progress ticks :func:`sweep` makes (for a progress bar)."""
    periods = sorted({c.decode_period for c in configs})
    every = record_every if record_every is not None else min(math.lcm(*periods), decode_tokens)
    n_blocks = math.ceil(decode_tokens / every)
    n_groups = len({_decode_group(c) for c in configs})
    return 2 + n_groups * n_blocks
