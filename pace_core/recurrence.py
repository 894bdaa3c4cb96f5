"""Gated DeltaNet (GDN) reference math: plain recurrence, chunked form, and the buffered decode token and
fold of PACE (spec §1 and §3). When to round and flush is :mod:`pace_core.schedule`'s.

Conventions (as transformers' Qwen3.5 / Qwen3-Next):

- ``q, k [B, T, H, K]`` (H key heads), ``v [B, T, HV, V]`` (HV value heads), ``g, beta [B, T, HV]``,
  state ``S [B, HV, K, V]``. With ``gamma = HV / H`` value head ``h`` reads key head ``h // gamma``;
  the key axis is never repeated in memory: value heads are viewed as ``[H, gamma]``.
- ``q`` and ``k`` are already L2-normalised and ``q`` is scaled by ``K**-0.5`` (see :func:`prepare_qk`).
- Per token: ``alpha_t = exp(g_t)``, ``u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)``,
  ``S_t = alpha_t S_{t-1} + k_t u_t^T``, ``o_t = S_t^T q_t``.

All functions compute in the promoted float dtype of their inputs, at least float32 (float64 inputs
stay float64; bfloat16 / float16 inputs are computed in float32), and return that dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError

L2NORM_EPS = 1e-6
"""The epsilon of transformers' (and FLA's) ``l2norm``: ``x * rsqrt(sum(x*x) + eps)``."""


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if not t.is_floating_point():
            raise PaceError(f"tensor dtype: {t.dtype} is not allowed; allowed: floating point dtypes")
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise ``q [..., K]`` and ``k [..., K]`` (eps as transformers' ``l2norm``) and scale ``q``
    by ``K**-0.5``. Returns ``(q, k)`` in the compute dtype (at least float32)."""
    dtype = _compute_dtype(q, k)
    q, k = q.to(dtype), k.to(dtype)
    return _l2norm(q) * q.shape[-1] ** -0.5, _l2norm(k)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's gates from its projections ``a, b [..., HV]`` and parameters ``A_log, dt_bias [HV]`` (Qwen3.5 /
    Qwen3-Next, as vLLM and transformers compute them): ``g = −exp(A_log) · softplus(a + dt_bias)`` in float32 and
    ``beta = sigmoid(b)`` in ``b``'s dtype, both returned float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid().float()


def _check_sequence(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int, int, int, int]:
    """Validate shapes; return ``(B, T, H, gamma, HV, K, V)``."""
    if q.dim() != 4 or k.shape != q.shape:
        raise PaceError(f"q, k: shapes {tuple(q.shape)}, {tuple(k.shape)} not allowed; allowed: equal [B, T, H, K]")
    B, T, H, K = k.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise PaceError(f"v: shape {tuple(v.shape)} not allowed; allowed: [B={B}, T={T}, HV, V]")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise PaceError(f"v: {HV} value heads not allowed; allowed: a multiple of the {H} key heads")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed; allowed: [B, T, HV] = {(B, T, HV)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise PaceError(
            f"initial_state: shape {tuple(initial_state.shape)} not allowed; allowed: [B, HV, K, V] = {(B, HV, K, V)}"
        )
    return B, T, H, HV // H, HV, K, V


def _initial(initial_state, B, H, gamma, K, V, dtype, device) -> torch.Tensor:
    """The state as ``[B, H, gamma, K, V]`` in ``dtype`` (zeros when ``initial_state`` is None)."""
    if initial_state is None:
        return torch.zeros(B, H, gamma, K, V, dtype=dtype, device=device)
    return initial_state.to(dtype).reshape(B, H, gamma, K, V)


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: one token at a time.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, ``initial_state [B, HV, K, V]``
    or None (zeros). Returns ``o [B, T, HV, V]`` and the final state ``S [B, HV, K, V]``.
    """
    B, T, H, gamma, HV, K, V = _check_sequence(q, k, v, g, beta, initial_state)
    dtype = _compute_dtype(q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    v = v.reshape(B, T, H, gamma, V)
    alpha = g.exp().reshape(B, T, H, gamma)
    beta = beta.reshape(B, T, H, gamma)
    S = _initial(initial_state, B, H, gamma, K, V, dtype, q.device)
    outputs = []
    for t in range(T):  # matmuls over [B, H, γ] (the key head broadcast over its γ value heads)
        S = S * alpha[:, t, :, :, None, None]
        read = (k[:, t, :, None, None, :] @ S)[..., 0, :]  # S_{t-1}ᵀ k_t, decayed
        u = beta[:, t, :, :, None] * (v[:, t] - read)
        S = torch.addcmul(S, k[:, t, :, None, :, None], u[..., None, :])  # + k_t u_tᵀ
        outputs.append((q[:, t, :, None, None, :] @ S)[..., 0, :])
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, gamma, V)
    return o.reshape(B, T, HV, V), S.reshape(B, HV, K, V)


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form: within a chunk of C tokens starting from state ``S0`` and with the
    in-chunk cumulative log decay ``Γ_i = Σ_{j<=i} g_j``,

    - ``(I + A) U = β ⊙ (V - e^Γ ⊙ K S0)`` with ``A_ij = β_i e^{Γ_i-Γ_j} k_i·k_j`` for ``j < i``
      (so ``U`` holds the delta values ``u_i`` of the recurrence),
    - ``O = e^Γ ⊙ Q S0 + (M ⊙ Q Kᵀ) U`` with ``M_ij = e^{Γ_i-Γ_j}`` for ``j <= i``, else 0,
    - ``S_C = e^{Γ_C} S0 + (e^{Γ_C-Γ} ⊙ K)ᵀ U``.

    ``chunk_size`` is any positive integer (need not divide T; the tail is padded with tokens that
    have ``k = 0, β = 0, g = 0``, which leave the state unchanged). Shapes as :func:`gdn_recurrent`.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise PaceError(f"chunk_size: {chunk_size!r} not allowed; allowed: an integer >= 1")
    B, T, H, gamma, HV, K, V = _check_sequence(q, k, v, g, beta, initial_state)
    dtype = _compute_dtype(q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, ...] -> zero-padded [B, N, C, ...]
        x = x.to(dtype)
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
        return x.reshape(B, N, C, *x.shape[2:])

    qc = chunks(q).permute(0, 3, 1, 2, 4)  # [B, H, N, C, K]
    kc = chunks(k).permute(0, 3, 1, 2, 4)  # [B, H, N, C, K]
    vc = chunks(v).reshape(B, N, C, H, gamma, V).permute(0, 3, 4, 1, 2, 5)  # [B, H, gamma, N, C, V]
    gc = chunks(g).reshape(B, N, C, H, gamma).permute(0, 3, 4, 1, 2)  # [B, H, gamma, N, C]
    bc = chunks(beta).reshape(B, N, C, H, gamma).permute(0, 3, 4, 1, 2)  # [B, H, gamma, N, C]

    cum = gc.cumsum(dim=-1)  # Γ
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay_ij = diff.exp()  # M: e^{Γ_i - Γ_j} for j <= i, 0 above the diagonal
    kk = (kc @ kc.transpose(-1, -2)).unsqueeze(2)  # [B, H, 1, N, C, C]
    qk = (qc @ kc.transpose(-1, -2)).unsqueeze(2)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    system = torch.eye(C, dtype=dtype, device=q.device) + (bc[..., :, None] * decay_ij * kk) * strict
    attn = decay_ij * qk  # [B, H, gamma, N, C, C]

    # Precompute (I + A)^-1 β V and (I + A)^-1 β e^Γ K once for all chunks; U = W - Kr S0 per chunk.
    rhs_v = bc[..., None] * vc
    rhs_k = (bc * cum.exp())[..., None] * kc.unsqueeze(2)
    w = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    kr = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    chunk_decay = cum[..., -1].exp()  # [B, H, gamma, N]
    write_weight = (cum[..., -1:] - cum).exp()  # e^{Γ_C - Γ_j} [B, H, gamma, N, C]

    S = _initial(initial_state, B, H, gamma, K, V, dtype, q.device)
    outputs = []
    for n in range(N):
        u = w[:, :, :, n] - kr[:, :, :, n] @ S  # [B, H, gamma, C, V]
        read = cum[:, :, :, n, :, None].exp() * (qc[:, :, None, n] @ S)
        outputs.append(read + attn[:, :, :, n] @ u)
        # Σ_c w_c k_c u_cᵀ as one matmul (a three-operand einsum searches its contraction path on every call)
        S = chunk_decay[:, :, :, n, None, None] * S + kc[:, :, None, n].transpose(-1, -2) @ (
            write_weight[:, :, :, n, :, None] * u)
    if outputs:
        o = torch.stack(outputs, dim=3)  # [B, H, gamma, N, C, V]
    else:
        o = torch.zeros(B, H, gamma, 0, C, V, dtype=dtype, device=q.device)
    o = o.reshape(B, H, gamma, N * C, V)[:, :, :, :T].permute(0, 3, 1, 2, 4).reshape(B, T, HV, V)
    return o, S.reshape(B, HV, K, V)


RECURRENT_BELOW = 16
"""Below this many tokens a segment runs as the plain recurrence (:func:`gdn_segment`)."""


def gdn_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of tokens from ``initial_state`` (shapes as :func:`gdn_recurrent`): chunked
    (:func:`gdn_chunked`), or for fewer than :data:`RECURRENT_BELOW` tokens the plain recurrence (the same
    function; a chunk's triangular solves cost more than a few recurrent steps, e.g. one decode token of
    the fp32 reference)."""
    if q.shape[1] < RECURRENT_BELOW:
        return gdn_recurrent(q, k, v, g, beta, initial_state)
    return gdn_chunked(q, k, v, g, beta, initial_state, chunk_size)


def _suffix_log_decays(gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gs [B, n, HV]`` -> (``G_n [B, HV]`` total, ``G_n - G_i [B, n, HV]``), summed directly as
    suffix sums (no difference of two cumulative sums)."""
    inclusive = gs.flip(1).cumsum(1).flip(1)  # Σ_{j>=i} g_j
    exclusive = torch.cat([inclusive[:, 1:], torch.zeros_like(inclusive[:, :1])], dim=1)  # Σ_{j>i} g_j
    return inclusive[:, 0], exclusive


Records = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Buffered records ``(keys [B, n, H, K], us [B, n, HV, V], log decays [B, n, HV])``, dequantised. A row that
holds fewer than ``n`` has ``u = 0`` and ``g = 0`` in the rest (:func:`pace_core.buffer.masked_records`): such a
record writes nothing and decays nothing, so rows of different counts step together."""


def _buffer_read(S_hat: torch.Tensor, records: Records, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(e^{G} Ŝ + Σ_i e^{G-G_i} k_i u_iᵀ)ᵀ x`` for queries ``x [B, H, m, K]`` (m per key head) without
    forming the state; returns ``[B, H, γ, m, V]`` with ``G`` the records' total log decay."""
    B, HV, K, V = S_hat.shape
    keys, us, gs = records
    H = x.shape[1]
    gamma = HV // H
    read = x[:, :, None] @ S_hat.to(dtype).view(B, H, gamma, K, V)  # [B, H, γ, m, V]
    n = keys.shape[1]
    if n == 0:
        return read
    total, after = _suffix_log_decays(gs.to(dtype))  # [B, HV], [B, n, HV]
    dots = keys.to(dtype).transpose(1, 2) @ x.transpose(-1, -2)  # k_iᵀ x: [B, H, n, m]
    weights = after.exp().view(B, n, H, gamma).permute(0, 2, 3, 1)[..., None] * dots[:, :, None]  # [B, H, γ, n, m]
    records = weights.transpose(-1, -2) @ us.to(dtype).view(B, n, H, gamma, V).permute(0, 2, 3, 1, 4)
    return total.exp().view(B, H, gamma, 1, 1) * read + records


def buffered_step(
    S_hat: torch.Tensor,
    buf: DecodeBuffer,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    beta_t: torch.Tensor,
    exact_current: bool = True,
) -> torch.Tensor:
    """One decode token against the fixed checkpoint ``Ŝ`` and the buffer (spec §3).

    ``S_hat [B, HV, K, V]`` (dequantised checkpoint), ``q_t, k_t [B, H, K]``, ``v_t [B, HV, V]``,
    ``g_t, beta_t [B, HV]``. Computes ``S_{t-1}ᵀ k_t`` and ``S_{t-1}ᵀ q_t`` from the checkpoint and the
    buffer's stored records, ``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t)``, appends ``(k_t, u_t, g_t)`` to
    ``buf`` (stored in its precision, for the later tokens and the fold) and returns ``o_t = S_tᵀ q_t
    [B, HV, V]``: with ``exact_current`` **[ours]** ``e^{g_t} S_{t-1}ᵀ q_t + u_t (k_tᵀ q_t)``, the current
    token exact as it is at hand; without, read back from the buffer, the current token's stored record
    included. Shapes are the caller's to get right (checked once per call at
    :class:`pace_core.state_store.LayerState`).
    """
    o, u = step_records(S_hat, buf.records(), q_t, k_t, v_t, g_t, beta_t, exact_current, buf.rounded, buf.dtype)
    buf.append(k_t.to(u.dtype), u, g_t.to(u.dtype))
    return o


def step_records(S_hat: torch.Tensor, records: Records, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                 g_t: torch.Tensor, beta_t: torch.Tensor, exact_current: bool,
                 rounded: Callable[[str, torch.Tensor], torch.Tensor],
                 record_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`buffered_step`'s arithmetic on given records (:data:`Records`, rows of any counts) without a buffer:
    returns ``(o_t [B, HV, V], u_t [B, HV, V])``, the record to store being ``(k_t, u_t, g_t)``. ``rounded(part,
    x)``: a key (``part`` "key") or delta value ("value") as the buffer stores and reads it back (the current
    token's own record, which it reads without ``exact_current``); ``record_dtype``: the dtype the records are
    read back in."""
    dtype = torch.promote_types(_compute_dtype(S_hat, q_t, k_t, v_t, g_t, beta_t), record_dtype)
    q_t, k_t, v_t, g_t, beta_t = (x.to(dtype) for x in (q_t, k_t, v_t, g_t, beta_t))
    B, HV = g_t.shape
    H = k_t.shape[1]
    gamma, V = HV // H, v_t.shape[-1]
    alpha = g_t.exp().view(B, H, gamma, 1)
    if exact_current:
        previous = _buffer_read(S_hat, records, torch.stack([k_t, q_t], 2), dtype)  # S_{t-1}ᵀ [k_t, q_t]
        previous_k, previous_q = previous[:, :, :, 0], previous[:, :, :, 1]
    else:
        previous_k = _buffer_read(S_hat, records, k_t[:, :, None], dtype)[:, :, :, 0]
    u_t = beta_t.view(B, H, gamma, 1) * (v_t.view(B, H, gamma, V) - alpha * previous_k)  # [B, H, γ, V]
    if not exact_current:
        keys, us, gs = records
        stored = (torch.cat([keys.to(dtype), rounded("key", k_t)[:, None].to(dtype)], 1),
                  torch.cat([us.to(dtype), rounded("value", u_t.reshape(B, HV, V))[:, None].to(dtype)], 1),
                  torch.cat([gs.to(dtype), g_t.to(record_dtype).to(dtype)[:, None]], 1))
        return _buffer_read(S_hat, stored, q_t[:, :, None], dtype)[:, :, :, 0].reshape(B, HV, V), u_t.reshape(B, HV, V)
    kq = (k_t * q_t).sum(-1).view(B, H, 1, 1)  # k_tᵀ q_t
    return (alpha * previous_q + kq * u_t).reshape(B, HV, V), u_t.reshape(B, HV, V)


def buffered_window(
    S_hat: torch.Tensor,
    buf: DecodeBuffer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    exact_current: bool = True,
) -> torch.Tensor:
    """``n`` decode tokens against the fixed checkpoint ``Ŝ`` and the buffer: the function of ``n`` calls of
    :func:`buffered_step`, with the work that does not wait for the previous token done for all of them.

    ``S_hat [B, HV, K, V]``, ``q, k [B, n, H, K]``, ``v [B, n, HV, V]``, ``g, beta [B, n, HV]``, with room
    for ``n`` more records in ``buf``. Every token reads the state after the buffer's records and the earlier
    tokens' stored records (spec §3). The reads of ``Ŝ``, the stored keys and the record weights of all ``n``
    tokens are batched; only ``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t)`` and its stored form run token by
    token, as each needs the stored ``u`` of the tokens before it. A record's decay in a later token's state,
    ``Σ_{i<j<=t-1} g_j``, is a masked sum of the log decays (no difference of cumulative sums). Appends the
    ``n`` records and returns ``o [B, n, HV, V]`` (``exact_current`` as :func:`buffered_step`); agrees with
    the token-by-token steps to float rounding (a record that rounds to another code then differs by that
    code's step).
    """
    dtype = torch.promote_types(_compute_dtype(S_hat, q, k, v, g, beta), buf.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    B, n, H, K = k.shape
    HV, V = v.shape[2:]
    gamma, m = HV // H, len(buf)
    keys_old, us_old, gs_old = buf.records()
    keys = torch.cat([keys_old.to(dtype), buf.rounded("key", k).to(dtype)], 1)  # [B, L, H, K], L = m + n
    gs = torch.cat([gs_old.to(dtype), g], 1)  # [B, L, HV]
    L = m + n
    i = torch.arange(L, device=k.device)
    last = torch.arange(n, device=k.device) + m - 1  # the last record in the state token t reads
    seen = i[None, :] <= last[:, None]  # [n, L]
    between = (i[None, None, :] > i[None, :, None]) & seen[:, None, :]  # [n, L, L]: records j after i, seen by t
    after = torch.einsum("tij,bjh->bhti", between.to(dtype), gs)  # Σ_{i<j<=t-1} g_j: [B, HV, n, L]
    total = torch.einsum("tj,bjh->bht", seen.to(dtype), gs)  # Σ_{j<=t-1} g_j: [B, HV, n]
    weights = torch.where(seen, after.exp(), 0.0).view(B, H, gamma, n, L)
    x = torch.cat([k, q], 1).transpose(1, 2)  # [B, H, 2n, K]
    read = x[:, :, None] @ S_hat.to(dtype).view(B, H, gamma, K, V)  # Ŝᵀ x: [B, H, γ, 2n, V]
    dots = (x @ keys.permute(0, 2, 3, 1))[:, :, None]  # k_iᵀ x: [B, H, 1, 2n, L]
    on_k, on_q = weights * dots[..., :n, :], weights * dots[..., n:, :]  # [B, H, γ, n, L]
    decay = total.exp().view(B, H, gamma, n, 1)
    us = torch.empty(B, H, gamma, L, V, dtype=dtype, device=k.device)  # stored u: the buffer's, then the tokens'
    us[..., :m, :] = us_old.to(dtype).view(B, m, H, gamma, V).permute(0, 2, 3, 1, 4)
    previous_k = decay * read[..., :n, :] + on_k[..., :m] @ us[..., :m, :]  # the buffer's part of S_{t-1}ᵀ k_t
    alpha = g.exp().view(B, n, H, gamma).permute(0, 2, 3, 1)[..., None]  # [B, H, γ, n, 1]
    weighted = beta.view(B, n, H, gamma).permute(0, 2, 3, 1)[..., None]
    vs = v.view(B, n, H, gamma, V).permute(0, 2, 3, 1, 4)
    u = torch.empty(B, H, gamma, n, V, dtype=dtype, device=k.device)
    for t in range(n):
        earlier = previous_k[..., t, :]
        if t:
            earlier = earlier + (on_k[..., t:t + 1, m:m + t] @ us[..., m:m + t, :])[..., 0, :]
        u[..., t, :] = weighted[..., t, :] * (vs[..., t, :] - alpha[..., t, :] * earlier)
        us[..., m + t, :] = buf.rounded("value", u[..., t, :].reshape(B, HV, V)).view(B, H, gamma, V)
    previous_q = decay * read[..., n:, :] + on_q @ us  # S_{t-1}ᵀ q_t: [B, H, γ, n, V]
    if exact_current:
        current, written = k, u
    else:
        current, written = keys[:, m:], us[..., m:, :]
    kq = (current * q).sum(-1).transpose(1, 2)[:, :, None, :, None]  # k_tᵀ q_t: [B, H, 1, n, 1]
    o = alpha * previous_q + kq * written
    buf.extend(k, u.permute(0, 3, 1, 2, 4).reshape(B, n, HV, V), g)
    return o.permute(0, 3, 1, 2, 4).reshape(B, n, HV, V)


def fold(S_hat: torch.Tensor, buf: DecodeBuffer) -> torch.Tensor:
    """The state after the buffered tokens: ``S = e^{G} Ŝ + Σ_i e^{G - G_i} k_i u_iᵀ``.

    ``S_hat [B, HV, K, V]``; returns ``S [B, HV, K, V]`` in the compute dtype (a new tensor)."""
    B, HV, K, V = buf.batch, buf.num_v_heads, buf.d_k, buf.d_v
    if tuple(S_hat.shape) != (B, HV, K, V):
        raise PaceError(f"S_hat: shape {tuple(S_hat.shape)} not allowed; allowed: {(B, HV, K, V)}")
    return fold_records(S_hat, (buf.keys(), buf.values(), buf.log_decays()), buf.dtype)


def fold_records(S_hat: torch.Tensor, records: Records, record_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`fold` of given records (:data:`Records`, rows of any counts): ``S [B, HV, K, V]`` in the compute
    dtype (a new tensor)."""
    dtype = torch.promote_types(_compute_dtype(S_hat), record_dtype)
    S = S_hat.to(dtype)
    keys, us, gs = records
    B, n, H, K = keys.shape
    HV, V = S.shape[1], S.shape[-1]
    if n == 0:
        return S.clone()
    gamma = HV // H
    total, after = _suffix_log_decays(gs.to(dtype))
    us = us.to(dtype).reshape(B, n, H, gamma, V)
    weights = after.exp().reshape(B, n, H, gamma)
    wu = (weights[..., None] * us).permute(0, 2, 1, 3, 4).reshape(B, H, n, gamma * V)  # e^{G - G_i} u_i
    keys = keys.to(dtype).permute(0, 2, 3, 1)  # [B, H, K, n]
    writes = (keys @ wu).view(B, H, K, gamma, V).transpose(2, 3).reshape(B, HV, K, V)  # Σ_i k_i (w_i u_i)ᵀ
    return total.exp()[..., None, None] * S + writes
