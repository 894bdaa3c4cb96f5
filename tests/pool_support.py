"""The pool steps under test (the fused CPU step, pace_core.pool_cpu; the kernels' in-place step, kernels.pool_step)
against the pool's reference step, over random schedules (random slot orders, rows at every position of their
buffer, flush boundaries, B = 1 to every slot). Each step starts both pools from the same stored state (the tested
pool's, copied), so every step is compared alone and a difference of one code cannot grow over the steps that follow.

Tolerances (tests/numerics.py):

- ``o_t``: ``STEP_TOL = fp32_bound(4 K + 2 dP)``: the checkpoint's dots of length K, the records' key dots, the sum
  over at most dP records and the output's sum, each in another order (a blocked sum, a per-group scale applied
  after the group's sum); float32 throughout.
- the records' keys and log decays: equal. A key record is the same float32 ``k_t`` rounded by the same correctly
  rounded operations (a maximum, one IEEE division per group, round half to even, fp16 and bfloat16 rounding to
  nearest even), so both sides store the same bits on any CPU.
- the records' delta values ``u_t`` and a flushed or per-token checkpoint: computed from float32 sums in another
  order, so a stored entry may land on the other side of a rounding boundary: within one storage step of the
  reference's (``within_one_step``; float32 and bfloat16 storage: the fold's float32 bound, then bfloat16's half
  ulp), and nearly all equal.
"""

from __future__ import annotations

import torch
from calibration_support import calibrated
from numerics import assert_within_one_step, fp32_bound, rel

from pace_core import quant
from pace_core.config import NAMED_CONFIGS, PaceConfig
from pace_core.pool import StatePool
from pace_core.recurrence import prepare_qk
from pace_core.vllm.slots import SlotLayout

SLOTS = 7
VARIANTS = {f"{name}-zero": NAMED_CONFIGS[name].replace(symmetric=False) for name in ("pace-3", "rtn-int5")}
"""Odd widths with zero points (dense packing of codes and zero points at widths no named configuration combines)."""


def config(name: str, hv: int, k: int, v: int) -> PaceConfig:
    cfg = {**NAMED_CONFIGS, **VARIANTS}[name]
    if cfg.quantized and cfg.group_axis == "value" and v % cfg.group_size:  # value heads of 48: groups of 16
        cfg = cfg.replace(group_size=16)
    if cfg.high_share:
        cfg = cfg.replace(high_heads=(tuple(h for h in range(hv) if h % 4 == 1),))
    return calibrated(cfg, hv, k, 1, d_v=v)


def pools(name: str, dims: tuple[int, int, int, int], backend: str | None = None,
          device: torch.device | str = "cpu", pages: bool = False, launch=None) -> tuple[StatePool, StatePool]:
    """The pool under test (``backend`` None: the fused CPU step; ``triton``: the kernels' in-place step with
    ``launch``'s settings; ``pages``: over an engine's rows of bytes, :class:`pace_core.vllm.slots.SlotLayout`) and
    the reference pool, of configuration ``name`` at ``dims``."""
    cfg = config(name, dims[1], dims[2], dims[3])
    tensors = None
    if pages:
        layout = SlotLayout(cfg, *dims)
        tensors = layout.views(torch.zeros(SLOTS, layout.nbytes, dtype=torch.uint8, device=device))
    fast = StatePool(cfg, dims, SLOTS, device, backend=backend, tensors=tensors, launch=launch)
    reference = StatePool(cfg, dims, SLOTS, device, backend="reference")
    assert (fast.fused if backend is None else fast.in_place) is not None, fast.step
    assert reference.fused is None
    return fast, reference


def token(dims, B: int, gen: torch.Generator, scale: float = 1.0):
    """A decode token's prepared inputs for ``B`` rows, drawn on the CPU from ``gen`` (also where CUDA is the default
    device: the GPU check)."""
    H, HV, K, V = dims
    with torch.device("cpu"):
        q, k = prepare_qk(torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen))
        return (q, k, torch.randn(B, HV, V, generator=gen) * scale, -torch.rand(B, HV, generator=gen) * 0.7,
                torch.rand(B, HV, generator=gen))


def within_one_step(got, ref) -> None:
    """Two stored checkpoints of the same slots: each entry within one storage step of the other, nearly all equal
    (:func:`numerics.assert_within_one_step`); dense: float32 / bfloat16 rounding."""
    if isinstance(ref, torch.Tensor):
        assert rel(got, ref) <= (fp32_bound(4 * got.shape[-2]) if ref.dtype == torch.float32 else 2.0**-8)
        return
    if hasattr(ref, "codes") and isinstance(ref.codes, dict):  # static scales: the codes alone
        for b in ref.codes:
            d = quant.unpack_codes(got.codes[b], b, got.shape[-1]).int() - \
                quant.unpack_codes(ref.codes[b], b, ref.shape[-1]).int()
            assert d.abs().max() <= 1 and (d == 0).float().mean() > 0.98
        return
    assert_within_one_step(got, ref)


def compare(fused: StatePool, reference: StatePool, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """The pools' tensors after one step of ``slots`` (their record counts before it ``counts``): rows not stepped
    and checkpoints not flushed are untouched on both sides (the same bytes), records and flushed checkpoints as the
    module docstring says."""
    cfg = fused.cfg
    period = cfg.decode_period if cfg.buffered else 1
    flushed = slots[counts + 1 == period] if cfg.buffered else slots
    kept = slots[counts + 1 < period] if cfg.buffered else slots[:0]
    others = torch.tensor([s for s in range(SLOTS) if s not in set(slots.tolist())], dtype=torch.long)
    for name, t in fused.tensors.items():
        assert torch.equal(t[others], reference.tensors[name][others]), name
        if name in fused.checkpoint_names:
            assert torch.equal(t[kept], reference.tensors[name][kept]), name
    if flushed.numel():
        f, r = fused.state({n: t[flushed] for n, t in fused.tensors.items()}), \
            reference.state({n: t[flushed] for n, t in reference.tensors.items()})
        within_one_step(f.checkpoint, r.checkpoint)
    if not cfg.buffered:
        return
    assert torch.equal(fused.tensors["log_decays"], reference.tensors["log_decays"])
    rows, at = kept, counts[counts + 1 < period]
    if rows.numel():
        for part, fmt_part in (("key", "keys"), ("value", "values")):
            got = fused.records._keys if part == "key" else fused.records._values
            ref = reference.records._keys if part == "key" else reference.records._values
            mine = got.read(period, torch.float32, rows=rows)[torch.arange(rows.numel()), at]
            theirs = ref.read(period, torch.float32, rows=rows)[torch.arange(rows.numel()), at]
            if part == "key":
                assert torch.equal(mine, theirs), fmt_part
            elif got.spec is not None:  # one integer step per vector group at most, nearly all equal
                span = (theirs.amax(-1, keepdim=True) - theirs.amin(-1, keepdim=True)).clamp(min=0)
                step = theirs.abs().amax(-1, keepdim=True) / got.spec.qmax * 1.01 if got.spec.symmetric else \
                    span / got.spec.levels * 1.02
                assert ((mine - theirs).abs() <= step + 1e-30).all() and (mine == theirs).float().mean() > 0.95
            else:
                tol = fp32_bound(4 * fused.dims[2]) if got.kind == torch.float32 else 2.0**-8
                assert rel(mine, theirs) <= tol


def run_schedule(name: str, dims: tuple[int, int, int, int], steps: int, seed: int, backend: str | None = None,
                 device: torch.device | str = "cpu", pages: bool = False, launch=None) -> None:
    """``steps`` steps of random batches of the pool under test (:func:`pools`) against the reference, each from the
    same stored state (module docstring)."""
    fused, reference = pools(name, dims, backend, device, pages, launch)
    period = fused.cfg.decode_period if fused.cfg.buffered else 1
    gen = torch.Generator().manual_seed(seed)
    H, HV, K, V = dims
    for s in range(SLOTS):  # a prompt of 3..9 tokens in every slot (the reference prefill on both pools)
        T = 3 + s
        x = [y[0] for y in token(dims, 1, gen)]
        prompt = [torch.stack([y] * T) + 0.01 * torch.randn(T, *y.shape, generator=gen, device="cpu") for y in x]
        prompt[0], prompt[1] = prepare_qk(prompt[0], prompt[1])
        prompt[3] = -prompt[3].abs()
        fused.prefill(s, *(y.to(device) for y in prompt), initial=False)
    tol = fp32_bound(4 * K + 2 * period)
    for t in range(steps):
        for n_, tensor in fused.tensors.items():  # both from the same stored state
            reference.tensors[n_].copy_(tensor)
        B = 1 if t % 5 == 0 else (SLOTS if t % 5 == 1 else int(torch.randint(2, SLOTS, (1,), generator=gen,
                                                                            device="cpu")))
        slots = torch.randperm(SLOTS, generator=gen, device="cpu")[:B].to(device)
        counts = fused.counts(slots)
        x = [y.to(device) for y in token(dims, B, gen)]
        static = fused.cfg.scales == "static"
        before = [(p.fmt.saturated, p.fmt.stored) for p in (fused, reference)] if static else None
        if t % 3 == 2:  # an engine's call: int32 slots, o written into its bfloat16 output, rounded once
            out = torch.empty(x[2].shape, dtype=torch.bfloat16, device=device)
            o_fused = fused.decode(slots.int(), *x, out=out)
            assert o_fused is out
            step_tol = tol + 2.0**-8 * (1 + tol)  # bfloat16 rounding: ‖o' - o‖ <= 2^-8 ‖o‖ (its unit roundoff)
        else:
            o_fused, step_tol = fused.decode(slots, *x), tol
        o_ref = reference.decode(slots, *x)
        assert rel(o_fused, o_ref) <= step_tol, (t, rel(o_fused, o_ref))
        compare(fused, reference, slots, counts)
        if static:  # the values stored and those saturated (GroupFormat's counts), counted alike
            after = [(p.fmt.saturated, p.fmt.stored) for p in (fused, reference)]
            counted = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
            assert counted[0] == counted[1]
