"""pace_core.pool_cpu: the fused CPU decode step against the pool's reference step, for every named configuration a
pool row holds, over random schedules (random slot orders, rows at every position of their buffer, flush boundaries,
B = 1 to every slot). Each step starts both pools from the same stored state (the fused pool's, copied), so every
step is compared alone and a difference of one code cannot grow over the steps that follow.


Tolerances: tests/pool_support.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import fp32_bound, rel
from pool_support import SLOTS, VARIANTS, config, pools, run_schedule, token, within_one_step

from pace_core import quant
from pace_core.config import NAMED_CONFIGS
from pace_core.errors import PaceError
from pace_core.pool import StatePool
from pace_core.pool_cpu import library
from pace_core.recurrence import gdn_gates, prepare_qk
from pace_core.vllm.slots import pool_refusal

pytestmark = pytest.mark.numerics

REPO = Path(__file__).resolve().parents[1]
SERVED = [name for name, cfg in NAMED_CONFIGS.items() if pool_refusal(cfg) is None]
"""Every named configuration a pool row holds (what the vLLM plugin serves)."""
@pytest.mark.parametrize("name", SERVED)
def test_fused_step_is_the_reference_step(name: str) -> None:
    """Every named configuration a pool row holds, H = 2, HV = 4, K = V = 64: 3 dP steps of random batches."""
    dims = (2, 4, 64, 64)
    cfg = NAMED_CONFIGS[name]
    run_schedule(name, dims, 3 * (cfg.decode_period if cfg.buffered else 4) + 2, seed=1)


@pytest.mark.parametrize("name", ["fp32", "rtn-int4", "pace-4", "pace-4-8", "pace-3", *VARIANTS])
def test_fused_step_on_other_widths(name: str) -> None:
    """Value heads 48 wide (no whole blocks of 32 or 64 columns: the step's general loops; RTN's value groups of 16)
    and 128 wide (the embedded model's), one key head per value head and three per key head; odd code widths with
    zero points packed densely."""
    for dims in ((2, 2, 64, 48), (1, 3, 128, 128)):
        run_schedule(name, dims, 10, seed=2)


def test_projected_step_is_the_reference_with_its_gates() -> None:
    """decode_projected: bfloat16 projections, q and k prepared and the gates computed in the operator, o written in
    bfloat16, against the reference path (prepare_qk, gdn_gates, decode, the cast). The output's bfloat16 rounding of
    two float32 values within STEP_TOL may part by one ulp (2^-8 relative), and beta = sigmoid(b) rounded to
    bfloat16 from two float32 sigmoids one float32 ulp apart may too, moving u_t by 2^-8 relative: 2^-7."""
    dims = (2, 4, 64, 64)
    for name in ("fp32", "pace-4", "pace-4-8"):
        fused, reference = pools(name, dims)
        gen = torch.Generator().manual_seed(3)
        A_log, dt_bias = (torch.rand(4, generator=gen) - 1).bfloat16(), torch.rand(4, generator=gen).bfloat16()
        for t in range(12):
            for n_, tensor in fused.tensors.items():
                reference.tensors[n_].copy_(tensor)
            B = 1 + t % SLOTS
            slots = torch.randperm(SLOTS, generator=gen)[:B].int()
            q, k = (torch.randn(B, 2, 64, generator=gen).bfloat16() for _ in range(2))
            v = torch.randn(B, 4, 64, generator=gen).bfloat16()
            a, b = (torch.randn(B, 4, generator=gen).bfloat16() for _ in range(2))
            outs = [torch.empty(B, 4, 64, dtype=torch.bfloat16) for _ in range(2)]
            fused.decode_projected(slots, q, k, v, a, b, A_log, dt_bias, outs[0])
            qp, kp = prepare_qk(q, k)
            g, beta = gdn_gates(a, b, A_log, dt_bias)
            outs[1].copy_(reference.decode(slots.long(), qp, kp, v.float(), g, beta))
            assert rel(outs[0].float(), outs[1].float()) <= 2.0**-7, (name, t)


def test_float64_and_the_reference_setting_run_the_reference() -> None:
    """float64 inputs compute in float64 on the reference, so the fused pool gives the reference's bits."""
    dims = (2, 4, 64, 64)
    fused, reference = pools("pace-4", dims)
    gen = torch.Generator().manual_seed(4)
    x = [y.double() for y in token(dims, 3, gen)]
    slots = torch.tensor([5, 0, 2])
    assert torch.equal(fused.decode(slots, *x), reference.decode(slots, *x))
    assert all(torch.equal(t, reference.tensors[n]) for n, t in fused.tensors.items())
    assert fused.step.startswith("fused") and reference.step == "reference (the backend setting is not auto)"


@pytest.mark.parametrize("name", ["pace-4", "fp32"])
def test_bad_steps_raise_the_reference_errors(name: str) -> None:
    """Non-finite inputs and a slot outside the pool are refused before anything is written; a state or record that
    cannot be stored raises the error the reference's format or buffer raises for it, that row and head unwritten."""
    dims = (2, 4, 64, 64)
    fused, reference = pools(name, dims)
    gen = torch.Generator().manual_seed(5)
    x = list(token(dims, 2, gen))
    before = {n: t.clone() for n, t in fused.tensors.items()}
    bad = [y.clone() for y in x]
    bad[2][1, 3, 5] = float("nan")
    for pool in (fused, reference):
        with pytest.raises(PaceError, match="non-finite values; allowed: finite inputs"):
            pool.decode(torch.tensor([1, 4]), *bad)
    with pytest.raises(PaceError, match=f"slots: {SLOTS} not allowed"):
        fused.decode(torch.tensor([1, SLOTS]), *x)
    assert all(torch.equal(t, before[n]) for n, t in fused.tensors.items())
    huge = [y.clone() for y in x]
    huge[2] = huge[2] * 1e30  # u_t beyond any fp16 scale of an 8-bit record
    huge[3] = huge[3].abs() + 80.0  # a decay of e^80 a token: float32 states overflow on the second token
    errors = []
    for pool in (fused, reference):
        with pytest.raises(PaceError) as err:
            for _ in range(8):
                pool.decode(torch.tensor([1, 4]), *huge)
        errors.append(re.split(r"\d", str(err.value))[0])  # the counts and places name the rows each side stepped
    assert errors[0] == errors[1] and errors[0]


def test_a_missing_compiler_leaves_the_reference_with_one_warning(tmp_path: Path) -> None:
    """No C++ compiler and nothing built yet: a pool steps on the reference, and the process is told why once, when
    a pool first asks for the fused step (a pool that never steps by slot never builds it)."""
    code = ("import warnings, torch\nwarnings.simplefilter('always')\n"
            "from pace_core.config import get_config\nfrom pace_core.pool import StatePool\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    pools = [StatePool(get_config('pace-4'), (2, 4, 64, 64), 2, 'cpu') for _ in range(2)]\n"
            "    built = len(seen)\n"
            "    steps = [pool.step for pool in pools]\n"
            "print(steps[0])\nprint(built, len(seen))\nprint(seen[0].message)\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "PACE_CPU_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    step, count, message = out.stdout.strip().splitlines()
    assert step == f"reference (no C++ compiler ({tmp_path / 'no-such-compiler'} not found; set CXX or install g++))"
    assert count == "0 1"  # nothing built until a pool is to step by slot; then one warning for both
    assert message.startswith("PACE: the state pool's fused CPU step is unavailable: no C++ compiler")


def test_the_library_is_built_once_and_cached(tmp_path: Path) -> None:
    """The build goes to the cache folder and a second process loads it without compiling."""
    assert library() is None
    env = {**os.environ, "PACE_CPU_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
    code = "from pace_core.pool_cpu import library\nprint(library())\n"
    for _ in range(2):
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              check=True).stdout.strip() == "None"
    assert len(list(tmp_path.glob("pool_cpu-*.so"))) == 1
    env["CXX"] = str(tmp_path / "no-such-compiler")  # built already: no compiler needed
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip() == "None"


def _steps(checkpoint) -> torch.Tensor:
    """One storage step of every entry of a stored checkpoint ``[n, HV, K, V]`` (in its format's basis)."""
    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.float().abs() * (2.0**-8 if checkpoint.dtype == torch.bfloat16 else 0.0)
    parts = {checkpoint.spec.bits: checkpoint} if isinstance(checkpoint, quant.PackedTensor) else \
        getattr(checkpoint, "parts", None)
    if parts is None:  # static scales: the layer's steps, the same on both sides
        return torch.zeros(checkpoint.shape)
    return torch.cat([quant.code_step(p).flatten() for p in parts.values()])


@pytest.mark.parametrize("name", SERVED)
def test_fused_prefill_is_the_reference_prefill(name: str) -> None:
    """Prompts of 1 to 16 tokens (one segment, P = 16) from the same stored state on both sides: from zero, and
    continued from a state with records in the buffer (folded into the prompt's starting state unrounded: "carry").
    The reference runs a segment chunked (the plain recurrence below 16 tokens), the fused step token by token: the
    same function, agreeing to float32 rounding over the segment's tokens (fp32_bound(3 K T)); stored checkpoints
    within one step. A continued prompt that stores the folded buffer first ("flush", the default) may start from
    states a step apart where a folded value lies within float32 rounding of a rounding boundary; the step
    S_t = α (I − β k kᵀ) S_{t−1} + β k vᵀ is a contraction (α <= 1, β in [0, 1], |k| = 1), so the outputs then
    differ by at most ||ΔS_0||_F · sqrt(Σ_t |q_t|²), ||ΔS_0||_F at most one step of every entry. Longer prompts: a
    prompt of several segments is, bit for bit, its segments run one after the other as continued prompts (the same
    code from the same codes), and an unrounded one (fp32) is the reference's to float32 rounding."""
    dims = (2, 4, 64, 64)
    H, HV, K, V = dims
    for after in ("carry", "flush"):
        cfg = config(name, HV, K, V).replace(prefill_period=16, prefill_after_decode=after)
        fused, reference = StatePool(cfg, dims, SLOTS, "cpu"), StatePool(cfg, dims, SLOTS, "cpu", backend="reference")
        gen = torch.Generator().manual_seed(6)
        for t, (T, initial) in enumerate([(5, False), (16, False), (1, True), (13, True), (16, True), (9, False)]):
            slot = t % SLOTS
            for _ in range(3):  # records in the buffer of a continued prompt
                fused.decode(torch.tensor([slot]), *token(dims, 1, gen))
            for n_, tensor in fused.tensors.items():
                reference.tensors[n_].copy_(tensor)
            one = torch.tensor([slot])
            rows = {n: t_[one].clone() for n, t_ in reference.tensors.items()}
            x = token(dims, T, gen)
            o_fused = fused.prefill(slot, *x, initial=initial)
            o_ref = reference.prefill(slot, *x, initial=initial)
            slack = 0.0
            if after == "flush" and initial and cfg.buffered and not cfg.exact:
                flushed = reference.state(rows)
                with flushed.call():
                    flushed.flush()
                slack = float(_steps(flushed.checkpoint).norm() * x[0].norm())
            assert float((o_fused - o_ref).norm()) <= fp32_bound(3 * K * T) * float(o_ref.norm()) + slack, (t, after)
            within_one_step(fused.state({n: t_[one] for n, t_ in fused.tensors.items()}).checkpoint,
                             reference.state({n: t_[one] for n, t_ in reference.tensors.items()}).checkpoint)
            assert int(fused.counts(one)) == int(reference.counts(one)) == 0
    x = token(dims, 40, gen)
    whole = fused.prefill(3, *x, initial=False)
    kept = {n: t_[3].clone() for n, t_ in fused.tensors.items()}
    parts = [fused.prefill(3, *(y[a:e] for y in x), initial=a > 0) for a, e in ((0, 16), (16, 32), (32, 40))]
    assert torch.equal(whole, torch.cat(parts)) and all(torch.equal(t_[3], kept[n]) for n, t_ in fused.tensors.items())
    if cfg.exact:
        assert rel(whole, reference.prefill(3, *x, initial=False)) <= fp32_bound(3 * K * 40)


def test_projected_prefill_is_the_reference_with_its_gates() -> None:
    """prefill_projected: three prompts in one call against the reference path, one prompt at a time (bfloat16
    output and beta as test_projected_step_is_the_reference_with_its_gates)."""
    dims = (2, 4, 64, 64)
    for name in ("fp32", "pace-4", "pace-4-8"):
        fused, reference = pools(name, dims)
        gen = torch.Generator().manual_seed(7)
        A_log, dt_bias = (torch.rand(4, generator=gen) - 1).bfloat16(), torch.rand(4, generator=gen).bfloat16()
        fused.decode(torch.tensor([2, 5]), *token(dims, 2, gen))
        for n_, tensor in fused.tensors.items():
            reference.tensors[n_].copy_(tensor)
        starts, slots, initial = torch.tensor([0, 7, 8, 30]), torch.tensor([2, 0, 5], dtype=torch.int32), \
            torch.tensor([True, False, True])
        q, k = (torch.randn(30, 2, 64, generator=gen).bfloat16() for _ in range(2))
        v = torch.randn(30, 4, 64, generator=gen).bfloat16()
        a, b = (torch.randn(30, 4, generator=gen).bfloat16() for _ in range(2))
        outs = [torch.empty(30, 4, 64, dtype=torch.bfloat16) for _ in range(2)]
        for pool, out in zip((fused, reference), outs):
            pool.prefill_projected(slots, starts, initial, q, k, v, a, b, A_log, dt_bias, out)
        assert rel(outs[0].float(), outs[1].float()) <= 2.0**-7, name
