"""Comparisons that hold on any CPU: float32 bounds derived from the arithmetic, and greedy outputs
compared only where a float32 difference cannot explain a change.

Bit-equality (``torch.equal``) is asserted only where both sides run the same code on the same inputs:
the same functions in the same order, the same shapes, in one process. Two paths that compute the same
function in another way (another summation order, a batched instead of a single GEMM, a chunked instead
of a token-by-token recurrence, MKL's kernels, which it picks by CPU model, vector width and data
alignment, e.g. of weights memory-mapped from a safetensors file) agree only to float32 rounding, so
they are compared with :func:`fp32_bound`:

- ``U = 2^-24`` is float32's unit roundoff. A sum or dot product of ``n`` terms, in any order, is off by
  at most ``γ_n ≈ n U`` times the sum of the terms' magnitudes (Higham, *Accuracy and Stability of
  Numerical Algorithms*, 2nd ed., §3.1), and a chain of such operations adds their ``n``.
- ``fp32_bound(n) = n U`` is that first-order bound for ``n`` float32 operations along the longest
  dependent chain of the computation. Each test states its ``n``. A wiring mistake (a wrong head, a lost
  token, a missed rounding) is off by orders of magnitude more.

Where a rounding to few bits follows two such paths (a quantiser, a greedy argmax), a float32 difference
can move a value across a rounding boundary; those results are compared by the same code on both sides,
or with :func:`assert_same_greedy`, which lets two greedy continuations part only where the measured
logit difference can swap the reference's top two tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from pace_core import quant

U = 2.0**-24
"""float32 unit roundoff."""


def fp32_bound(ops: int) -> float:
    """First-order relative error bound ``ops · U`` of ``ops`` dependent float32 operations."""
    return ops * U


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖_F / ‖b‖_F`` in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den else num


def assert_same_greedy(tokens: torch.Tensor, ref_tokens: torch.Tensor, logits: torch.Tensor,
                       ref_logits: torch.Tensor, tol: float | torch.Tensor) -> int:
    """Two greedy continuations of the same prompts by two code paths: ``tokens, ref_tokens [B, N]`` and
    the logits each path chose them from, ``logits, ref_logits [N, B, vocab]`` (step-major, as
    ``generate(output_logits=True)`` gives them).

    Row by row and step by step, until the rows' tokens first differ: the logits agree to ``tol``
    (relative; one for all, or ``[N, B]`` one per step and row), and a differing token is allowed only where the
    reference's top-1 margin is at most twice the largest measured logit difference (a near tie that float32
    rounding can swap). After that step the continuations have different prefixes and are not compared. Returns
    the number of rows that parted."""
    parted = 0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            step, ref_step = logits[t][b].double(), ref_logits[t][b].double()
            bound = float(tol[t][b]) if isinstance(tol, torch.Tensor) else tol
            assert rel(step, ref_step) <= bound, (f"row {b}, step {t}: logits differ by {rel(step, ref_step):.3g} > "
                                                  f"{bound:.3g}")
            if tokens[b, t] != ref_tokens[b, t]:
                top2 = ref_step.topk(2).values
                margin = float(top2[0] - top2[1])
                delta = float((step - ref_step).abs().max())
                assert margin <= 2 * delta, (f"row {b}, step {t}: token {int(tokens[b, t])} != {int(ref_tokens[b, t])} "
                                             f"although the reference's top-1 margin {margin:.3g} exceeds twice the "
                                             f"logit difference {delta:.3g}")
                parted += 1
                break
    return parted


def assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module, rename=lambda name: name) -> None:
    """Every parameter and buffer of ``model`` equals, bit for bit, the one of ``reference`` named
    ``rename(name)`` (no arithmetic involved: a load keeps the saved values exactly)."""
    ref = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in mine.items():
        other = ref[rename(name)]
        assert tensor.shape == other.shape and torch.equal(tensor, other), f"{name} differs from {rename(name)}"


def mean_difference_bound(diff: np.ndarray, blocks: int = 8, z: float = 4.0) -> float:
    """How far the mean of ``diff`` (per decode step, the difference of one statistic between two code paths) may
    lie from 0 when the paths are two realisations of one rounding process: ``z`` standard errors of the mean,
    estimated from the means of ``blocks`` consecutive blocks of steps (all steps, blocks of nearly equal size;
    blocks absorb the correlation between
    neighbouring steps of one decode). Where a rounding's float32 differences put a code on the other side of a
    boundary, the two states part by a code step, and the delta rule spreads it over the state: from then on the
    paths round independently (the same distribution, other draws), so per-step values differ by the rounding
    noise itself and only their means are comparable."""
    means = np.array([b.mean() for b in np.array_split(np.asarray(diff, dtype=np.float64), blocks) if len(b)])
    return z * float(means.std(ddof=1)) / len(means) ** 0.5


def assert_within_one_step(got, ref, head_slack: float = 0.0, slack: torch.Tensor | None = None) -> None:
    """Two requantisations of (nearly) the same values, ``got`` and ``ref`` (a :class:`quant.PackedTensor` or a
    format's checkpoint with ``parts`` by width): equal except near a rounding boundary, each entry within
    :func:`pace_core.quant.steps_apart`'s bound (so where the two sides' scales differ by an fp16 ulp an 8-bit entry
    with a zero point may differ by a little more than one step). With ``head_slack = 0`` and no ``slack`` the values
    agree to float32 rounding, so nearly every entry is equal (> 98 %; a ``slack [..., HV, K, V]`` of a few columns'
    difference, entry by entry, which each entry's bound adds, leaves that so); else they differ by up to
    ``head_slack`` of the largest |value| of the head, which each entry's bound adds and which may move a group's
    scale and every entry of it."""
    parts_ref = {ref.spec.bits: ref} if isinstance(ref, quant.PackedTensor) else ref.parts
    parts_got = {got.spec.bits: got} if isinstance(got, quant.PackedTensor) else got.parts
    for b, r in parts_ref.items():
        g = parts_got[b]
        bound = head_slack * quant.dequantize(r).abs().amax((-2, -1), keepdim=True) if head_slack else 0.0
        if slack is not None:
            bound = bound + (slack if isinstance(ref, quant.PackedTensor) else slack[..., ref.heads[b].long(), :, :])
        apart = quant.steps_apart(g, r, bound)
        assert torch.isfinite(apart).all()
        worst = int(apart.argmax())
        assert (apart <= 1.01).all(), (f"{b}-bit entry {worst}: {apart.flatten()[worst]:.4g} times the rounding "
                                       f"bound; steps {quant.code_step(g).flatten()[worst]:.4g} / "
                                       f"{quant.code_step(r).flatten()[worst]:.4g}")
        if not head_slack:
            assert (apart == 0).float().mean() > 0.98
