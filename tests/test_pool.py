"""pace_core.pool.StatePool: slots at different positions of their schedule stepped together, each exactly as it
would be stepped alone; in place; nothing beside the pool's tensors."""

from __future__ import annotations

import pytest
import torch
from calibration_support import calibrated
from numerics import rel

from pace_core.accounting import state_bytes
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.pool import StatePool, pool_fields
from pace_core.recurrence import gdn_recurrent, prepare_qk
from pace_core.shapes import ModelShape

pytestmark = pytest.mark.numerics

H, HV, K, V = 2, 4, 64, 32
SHAPE = ModelShape("pool", 1, 1, H, HV, K, V, 0, gdn_layers=(0,))
F64_TOL = 1e-12
"""Rows stepped in another batch composition, float64 arithmetic throughout (the quantiser's working dtype for
float64 input): sums in another order, some 10^4 float64 roundings; a code at a rounding boundary within that is
as unlikely as 1e-12 of a step, so the stored states agree to it as well."""


def tokens(n: int, T: int, seed: int, dtype=torch.float64):
    """Prepared inputs of ``n`` sequences and ``T`` tokens: q, k [n, T, H, K], v [n, T, HV, V], g, beta [n, T, HV]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(n, T, H, K, generator=gen, dtype=dtype), torch.randn(n, T, H, K, generator=gen,
                                                                                         dtype=dtype))
    v = torch.randn(n, T, HV, V, generator=gen, dtype=dtype)
    g = torch.empty(n, T, HV, dtype=dtype).uniform_(0.9, 0.999, generator=gen).log()
    return q, k, v, g, torch.rand(n, T, HV, generator=gen, dtype=dtype)


def pool_for(name: str, slots: int, **changes) -> StatePool:
    cfg = calibrated(get_config(name).replace(**changes) if changes else get_config(name), HV, K, 1)
    return StatePool(cfg, (H, HV, K, V), slots, "cpu")


def at(x: tuple, rows, t) -> list:
    return [y[rows, t] for y in x]


@pytest.mark.parametrize("name", ["pace-4", "pace-4-8", "rtn-int4", "fp32", "stepquant-4"])
def test_slots_at_different_positions_step_as_each_would_alone(name):
    """Four sequences start at different times in a pool of six slots and are stepped together by slot index (a
    serving engine's continuous batching); each ends where the same tokens take it alone in a pool of its own."""
    changes = {"high_heads": ((1,),)} if name == "pace-4-8" else {}
    pool = pool_for(name, 6, **changes)
    x = tokens(4, 24, seed=1)
    slots = torch.tensor([4, 0, 2, 5])
    starts = [0, 3, 5, 9]  # each first decodes from its 6-token prompt at step starts[i]
    outputs = {i: [] for i in range(4)}
    for t in range(24):
        active = [i for i in range(4) if starts[i] + 6 <= t]
        for i in range(4):
            if t == starts[i] + 6:  # its prompt (the first 6 tokens) fills its slot
                outputs[i].append(pool.prefill(int(slots[i]), *(y[i, :6] for y in x), initial=False))
        if active:
            o = pool.decode(slots[active], *(y[active, t] for y in x))
            for j, i in enumerate(active):
                outputs[i].append(o[j:j + 1])
    for i in range(4):
        alone = pool_for(name, 1, **changes)
        n = len(outputs[i]) - 1
        want = [alone.prefill(0, *(y[i, :6] for y in x), initial=False)]
        for t in range(24 - n, 24):
            want.append(alone.decode(torch.tensor([0]), *(y[i:i + 1, t] for y in x)))
        assert rel(torch.cat(outputs[i]), torch.cat(want)) < F64_TOL, i
        mine = pool.state({n_: t[int(slots[i]):int(slots[i]) + 1] for n_, t in pool.tensors.items()})
        theirs = alone.state()
        with mine.call(), theirs.call():
            assert rel(mine.effective_state(), theirs.effective_state()) < F64_TOL, i


def test_unrounded_pool_is_the_recurrence():
    """Quantisation off (fp32 reference with a float32 buffer, dP = 4): slots stepped at different positions equal the
    plain recurrence of their own tokens (PACE_SPEC §3's first test, per slot)."""
    pool = pool_for("fp32", 3, decode_period=4, buffer="fp32")
    x = tokens(3, 13, seed=2, dtype=torch.float32)
    for s in range(3):
        pool.prefill(s, *(y[s, :3 + s] for y in x), initial=False)
    outs = {s: [] for s in range(3)}
    for t in range(5, 13):
        o = pool.decode(torch.arange(3), *(y[:, t] for y in x))
        for s in range(3):
            outs[s].append(o[s])
    for s in range(3):  # slot s decoded tokens 5..12 after a prompt of 3 + s tokens: tokens 3+s..4 are skipped
        keep = list(range(3 + s)) + list(range(5, 13))
        o_ref, _ = gdn_recurrent(*(y[s:s + 1, keep].double() for y in x))
        assert rel(torch.stack(outs[s]), o_ref[0, 3 + s:]) < 1e-5


def test_a_step_writes_only_what_changes():
    """A row whose buffer the token does not fill keeps its stored checkpoint untouched; a row it fills is flushed
    and its buffer emptied; counts are read from the storage."""
    pool = pool_for("pace-4", 3)
    x = tokens(3, 20, seed=3, dtype=torch.float32)
    for s in range(3):
        pool.prefill(s, *(y[s, :4] for y in x), initial=False)
    for t in range(4, 11):  # slot 0 holds 7 records, slots 1 and 2 one
        pool.decode(torch.tensor([0] if t < 10 else [0, 1, 2]), *(y[[0] if t < 10 else [0, 1, 2], t] for y in x))
    assert pool.counts(torch.arange(3)).tolist() == [7, 1, 1]
    codes = {s: pool.tensors["codes"][s].clone() for s in range(3)}
    pool.decode(torch.tensor([2, 0]), *(y[[2, 0], 11] for y in x))  # slot 0's 8th: flushed; slot 2's 2nd
    assert pool.counts(torch.arange(3)).tolist() == [0, 1, 2]
    assert not torch.equal(pool.tensors["codes"][0], codes[0])
    assert torch.equal(pool.tensors["codes"][1], codes[1]) and torch.equal(pool.tensors["codes"][2], codes[2])


def test_prefill_from_zero_or_from_the_stored_state():
    pool = pool_for("pace-4", 2)
    x = tokens(1, 12, seed=4, dtype=torch.float32)
    pool.prefill(1, *(y[0, :8] for y in x), initial=False)
    stored = {n: t[1].clone() for n, t in pool.tensors.items()}
    whole = pool_for("pace-4", 1)
    whole.prefill(0, *(y[0, :8] for y in x), initial=False)
    whole.prefill(0, *(y[0, 8:] for y in x), initial=True)  # a prompt continued: from the stored state
    pool.prefill(1, *(y[0, 8:] for y in x), initial=True)
    assert all(torch.equal(t[1], whole.tensors[n][0]) for n, t in pool.tensors.items())
    pool.prefill(1, *(y[0, :8] for y in x), initial=False)  # a new sequence in the slot: from zero
    assert all(torch.equal(t[1], stored[n]) for n, t in pool.tensors.items())


WIDTHS = [(name, b) for b in range(2, 9) for name in ("rtn-int4", "pace-4", "pace-4-8", "damp-int4", "qmamba-dsq")]
"""Every code width of each method a pool row holds (issue 48: stored densely, rows padded only to whole bytes)."""


@pytest.mark.parametrize("name", ["pace-3", "pace-4", "pace-4-8", "rtn-int8", "bf16", "damp-int4",
                                  "qmamba-dsq", "stepquant-4"])
def test_the_pool_holds_the_accounted_bytes_per_slot(name):
    _holds_the_accounted_bytes(name)


@pytest.mark.parametrize("name,bits", WIDTHS)
def test_the_pool_holds_the_accounted_bytes_at_every_width(name, bits):
    _holds_the_accounted_bytes(name, bits=bits, **({} if name == "pace-4-8" else {"symmetric": False}))


def _holds_the_accounted_bytes(name: str, **changes) -> None:
    """A pool of five slots holds five times its fields' bytes, each slot what the accounting adds per sequence."""
    if get_config(name).high_share > 0:
        changes["high_heads"] = ((1,),)
    if get_config(name).method in ("damp", "dsq"):
        changes.pop("symmetric", None)  # symmetric only
    pool = pool_for(name, 5, **changes)
    per_slot = sum(f.nbytes for f in pool_fields(pool.cfg, (H, HV, K, V)))
    assert sum(t.numel() * t.element_size() for t in pool.tensors.values()) == 5 * per_slot
    assert per_slot == state_bytes(pool.cfg, SHAPE, 2) - state_bytes(pool.cfg, SHAPE, 1)


def test_tensors_of_another_layout_are_refused():
    pool = pool_for("pace-4", 2)
    with pytest.raises(PaceError, match="not allowed for state"):
        StatePool(pool.cfg, (H, HV, K, V), 3, "cpu", tensors=pool.tensors)


@pytest.mark.parametrize("name", ["pace-4-8", "damp-int4", "stepquant-4"])
def test_tensor_parallel_ranks_hold_their_heads(name):
    """Two ranks, each a pool of half the heads (its own widths and calibrated tensors), step as the whole layer's
    pool does: their outputs side by side are the whole pool's, and their bytes add up to it."""
    changes = {"high_heads": ((0, 3),), "high_share": 0.5} if name == "pace-4-8" else {}
    whole = pool_for(name, 2, **changes)
    ranks = [StatePool(whole.cfg, (H // 2, HV // 2, K, V), 2, "cpu", tp=(r, 2)) for r in range(2)]
    x = tokens(2, 14, seed=5)
    for s in range(2):  # the heads are axis 2 of every input [n, T, heads, ...]
        want = whole.prefill(s, *(y[s, :5] for y in x), initial=False)
        got = [rank.prefill(s, *(y.chunk(2, dim=2)[r][s, :5] for y in x), initial=False)
               for r, rank in enumerate(ranks)]
        assert rel(torch.cat(got, dim=1), want) < F64_TOL
    for t in range(5, 14):
        want = whole.decode(torch.arange(2), *(y[:, t] for y in x))
        got = [rank.decode(torch.arange(2), *(y.chunk(2, dim=2)[r][:, t] for y in x)) for r, rank in enumerate(ranks)]
        assert rel(torch.cat(got, dim=1), want) < F64_TOL
    assert sum(f.nbytes for r in range(2) for f in pool_fields(whole.cfg, (H // 2, HV // 2, K, V), tp=(r, 2))) == \
        sum(f.nbytes for f in pool_fields(whole.cfg, (H, HV, K, V)))
