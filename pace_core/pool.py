"""One GDN layer's PACE state for N slots as fixed tensors: a serving engine's state pool, the rows of a
transformers batch, the benchmark's layer. The one storage of the state (PACE_SPEC §2-§3) and the one place that
steps it.

- **Fields** (:func:`pool_fields`): per slot the checkpoint's stored tensors (:mod:`pace_core.checkpoint`: the
  plain state of a reference; codes, fp16 scales and zero points of PACE / RTN, one packed part per width for
  PACE-4/8; each method's own) and, at dP >= 2, the decode buffer's storage for dP records
  (:meth:`pace_core.buffer.DecodeBuffer.storage`). Their bytes are exactly what
  :func:`pace_core.accounting.state_bytes` counts per sequence; what is kept once per layer (head maps, DAMP's
  rows, STEPQuant's widths) stays with the format. A slot's record count is read from its storage (a record's
  log decay is <= 0, an empty slot's :data:`pace_core.buffer.EMPTY`), so rows at different positions of their
  schedule share one pool with nothing beside it.
- **Tensors**: allocated here (a zero state in every slot), or given as views into an engine's memory (vLLM's
  pages: :class:`pace_core.vllm.slots.SlotLayout`); never reallocated, written in place.
- **Steps**: :meth:`state` is the schedule (:class:`pace_core.schedule.PeriodicState`) over every slot at once,
  all at the same position (a transformers batch: ``generate``, the analyses). :meth:`decode` steps the slots
  ``slots [B]`` by one token each, whatever their positions: each row's record goes into its own buffer and a
  row whose buffer this token fills is flushed, the others' checkpoints are left as they are; :meth:`prefill`
  runs a prompt in one slot, from its stored state or from zero. On the fused CPU step and the kernels' in-place
  step the rows step where they lie; elsewhere they are gathered by their record count (a pool step is one
  schedule step per count present, at most dP), run by the same schedule and backend as the transformers path,
  and written back: the arithmetic is the same function on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pace_core.backend import PoolStep, backend_setting, refuse_non_finite, select_steps
from pace_core.buffer import EMPTY, DecodeBuffer, records_held
from pace_core.checkpoint import checkpoint_tensors, with_tensors
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.methods import state_format
from pace_core.pool_cpu import Failure, FusedPool
from pace_core.recurrence import fold_records, step_records
from pace_core.schedule import PeriodicState

if TYPE_CHECKING:
    from kernels.settings import Launch


@dataclass(frozen=True)
class Field:
    """One per-slot tensor of a pool: ``name``, ``shape`` (without the slot axis), ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


class StatePool:
    """The state of one GDN layer for ``slots`` sequences under ``cfg`` (module docstring).

    ``dims = (H, HV, K, V)`` of the heads this pool holds; ``gdn_index``: the layer's position among the GDN
    layers (its 8-bit heads, its calibrated tensors); ``tp = (rank, size)``: a tensor-parallel rank holds the
    layer's value heads ``rank·HV`` to ``(rank + 1)·HV`` (and their key heads) of ``size·HV``; ``tensors``:
    the pool's tensors by :func:`pool_fields` name, ``[slots, *shape]`` each (an engine's memory), else allocated
    on ``device`` with a zero state in every slot; ``backend`` and ``launch`` (the kernels' settings) as
    :func:`pace_core.backend.select_steps`;
    ``chunk_size``: the chunked GDN's chunk length.
    """

    def __init__(self, cfg: PaceConfig, dims: tuple[int, int, int, int], slots: int, device: torch.device | str,
                 *, gdn_index: int = 0, tp: tuple[int, int] = (0, 1), tensors: dict[str, torch.Tensor] | None = None,
                 name: str = "state", backend: str | None = None, launch: Launch | None = None,
                 chunk_size: int = 64) -> None:
        H, HV, K, V = dims
        self.cfg, self.dims, self.slots, self.name, self.chunk_size = cfg, dims, slots, name, chunk_size
        self.device = torch.device(device)
        self.fmt = layer_format(cfg, HV, gdn_index, tp, name).to(self.device)
        self.steps = select_steps(self.fmt, cfg.buffer_format if cfg.buffered else None, K, V, self.device, backend,
                                  launch)
        zero = self.fmt.zeros((1, HV, K, V), self.device)
        self.checkpoint_names = tuple(checkpoint_tensors(zero))
        fields = pool_fields(cfg, dims, gdn_index, tp, zero)
        if tensors is None:
            tensors = {f.name: torch.zeros(slots, *f.shape, dtype=f.dtype, device=self.device) for f in fields}
        want = {f.name: ((slots, *f.shape), f.dtype) for f in fields}
        have = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        if have != want:
            raise PaceError(f"tensors: {have} not allowed for {name}; allowed: {want} (pace_core.pool.pool_fields)")
        self.tensors = tensors
        self.template = with_tensors(zero, {n: tensors[n][:1] for n in self.checkpoint_names})
        """The checkpoint's structure (and what it keeps once per layer) that rows fill in, over the first slot (no
        bytes of its own)."""
        self.records = None if not cfg.buffered else DecodeBuffer(
            slots, H, HV, K, V, cfg.decode_period, cfg.buffer_format, self.device,
            {n: t for n, t in tensors.items() if n not in self.checkpoint_names}, per_row=True)
        """The decode buffer over every slot's records, each row holding its own count (its per-row methods)."""
        self._backend = backend
        self._fused: tuple[FusedPool | None, str | None] | None = None
        self._in_place: tuple[PoolStep | None, str | None] | None = None
        self.reset()

    @property
    def fused(self) -> FusedPool | None:
        """The fused CPU step of :meth:`decode` and :meth:`prefill`, or None; chosen at the first step that asks (so
        a pool that is never stepped by slot, such as the transformers path's, never builds it), once."""
        if self._fused is None:
            why = "the backend setting is not auto" if backend_setting(self._backend) != "auto" else (
                "not on a CPU" if self.device.type != "cpu" else None)
            self._fused = (None, why) if why else FusedPool.for_pool(self.cfg, self.fmt, self.dims, self.tensors,
                                                                    self.checkpoint_names)
        return self._fused[0]

    @property
    def in_place(self) -> PoolStep | None:
        """The backend's in-place step of :meth:`decode` (the GPU kernels: :meth:`pace_core.backend.Steps.pool_step`),
        or None; made at the first step that asks, once."""
        if self._in_place is None:
            checkpoint = with_tensors(self.template, {n: self.tensors[n] for n in self.checkpoint_names})
            made = self.steps.pool_step(self.fmt, checkpoint, self.records, self.dims, self.cfg.exact_current_token)
            self._in_place = (None, made) if isinstance(made, str) else (made, None)
        return self._in_place[0]

    @property
    def step(self) -> str:
        """Who steps the pool by slot: the fused CPU step, the backend in place, or the backend by count groups and
        why not the fused step (on a CPU) or the in-place one."""
        if self.fused is not None:
            return "fused CPU step (pace_core.pool_cpu)"
        if self.in_place is not None:
            return f"{self.steps.name} in place (kernels.pool_step)"
        return f"{self.steps.name} ({self._fused[1] if self.device.type == 'cpu' else self._in_place[1]})"

    def state(self, rows: dict[str, torch.Tensor] | None = None) -> PeriodicState:
        """The schedule over every slot of the pool at once (``rows``: over these gathered rows instead), all at the
        same position of their schedule."""
        tensors = self.tensors if rows is None else rows
        n = next(iter(tensors.values())).shape[0]
        H, HV, K, V = self.dims
        cfg = self.cfg
        checkpoint = with_tensors(self.template, {name: tensors[name] for name in self.checkpoint_names})
        records = {name: t for name, t in tensors.items() if name not in self.checkpoint_names} or None
        return PeriodicState(self.fmt, self.steps, (n, H, HV, K, V), self.device, prefill_period=cfg.prefill_period,
                             decode_period=cfg.decode_period, buffer=cfg.buffer_format,
                             after_decode=cfg.prefill_after_decode, exact_current=cfg.exact_current_token,
                             chunk_size=self.chunk_size, checkpoint=checkpoint, records=records)

    def reset(self, slots: torch.Tensor | None = None) -> None:
        """The zero state in ``slots`` (long ``[n]``; None: every slot, and the format started again:
        :meth:`pace_core.checkpoint.StateFormat.restart`)."""
        zero = checkpoint_tensors(self.fmt.zeros((1, *self.dims[1:]), self.device))
        for name, t in self.tensors.items():
            target = t if slots is None else t.index_select(0, slots)
            if name in zero:
                target.copy_(zero[name].expand_as(target))
            else:
                target.fill_(EMPTY if name == "log_decays" else 0)
            if slots is not None:
                t.index_copy_(0, slots, target)
        if slots is None:
            self.fmt.restart()

    def counts(self, slots: torch.Tensor) -> torch.Tensor:
        """The records each of ``slots [n]`` holds in its buffer (zeros at dP = 1): ``[n]`` long."""
        if "log_decays" not in self.tensors:
            return torch.zeros(slots.shape[0], dtype=torch.long, device=slots.device)
        return records_held(self.tensors["log_decays"].index_select(0, slots))

    def _rows(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: t.index_select(0, slots) for name, t in self.tensors.items()}

    def _write(self, slots: torch.Tensor, rows: dict[str, torch.Tensor], names) -> None:
        for name in names:
            self.tensors[name].index_copy_(0, slots, rows[name])

    def decode(self, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token for each slot of ``slots [B]`` (integers, distinct): ``q, k [B, H, K]`` prepared,
        ``v [B, HV, V]``, ``g, beta [B, HV]`` float32 (float64 computes in float64) -> ``o [B, HV, V]``, or written
        into ``out [B, HV, V]`` (in its dtype) and returned. Each row's
        record goes into its own buffer; a row whose buffer the token fills is flushed (its checkpoint written back,
        its buffer emptied); the other rows' checkpoints are not written. Non-finite ``k, v, g`` are refused before
        anything is written.

        On the reference backend all rows step at once (:func:`pace_core.recurrence.step_records` on each row's
        records, a slot beyond its count masked; the record written at each row's own position; the rows the token
        fills folded and stored together); on the kernels in place where they can (:attr:`in_place`: each row at
        its own count, no host read), else in groups of equal count through the schedule."""
        if self.fused is not None and all(x.dtype == torch.float32 for x in (q, k, v, g, beta)):
            out = torch.empty(v.shape, dtype=torch.float32) if out is None else out
            self._run_fused(slots, (q, k, v, g, beta), out, None)
            return out
        refuse_non_finite(k, v, g, self.name)
        if self.in_place is not None and v.dtype != torch.float64:  # the kernels compute in float32
            return self.in_place.decode(slots, q, k, v, g, beta, out)
        slots = slots.long()
        o = self._decode_rows(slots, q, k, v, g, beta) if self.records is not None and self.steps.name == "reference" \
            else self._decode_groups(slots, q, k, v, g, beta)
        return o if out is None else out.copy_(o)

    def _decode_groups(self, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` in groups of rows at equal counts, each through the schedule (the method's docstring)."""
        out = torch.empty(v.shape, dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
        counts = self.counts(slots)
        for count in counts.unique().tolist():
            pick = (counts == count).nonzero().squeeze(1)
            sub = slots.index_select(0, pick)
            rows = self._rows(sub)
            state = self.state(rows)
            with state.call():
                o = state.decode(*(x.index_select(0, pick).unsqueeze(1) for x in (q, k, v, g, beta)))
            out.index_copy_(0, pick, o[:, 0])
            changed = rows if state.buffer is None or len(state.buffer) == 0 else (
                name for name in rows if name not in self.checkpoint_names)
            self._write(sub, rows, changed)
        return out

    def decode_projected(self, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         out: torch.Tensor) -> None:
        """:meth:`decode` of a GDN layer's projections: ``q, k [B, H, K]`` before
        :func:`pace_core.recurrence.prepare_qk`, ``v [B, HV, V]``, ``a, b [B, HV]`` and the layer's
        ``A_log, dt_bias [HV]`` (:func:`pace_core.recurrence.gdn_gates`),
        ``o`` written into ``out [B, HV, V]`` in its dtype. The fused CPU step does it all in one operator."""
        if self.fused is not None and all(x.dtype != torch.float64 for x in (q, k, v, a, b)):
            self._run_fused(slots, (q, k, v, a, b), out, (A_log, dt_bias))
            return
        self.decode(slots, *self.steps.step_inputs(q, k, v, a, b, A_log, dt_bias), out=out)

    def _run_fused(self, slots: torch.Tensor, inputs: tuple[torch.Tensor, ...], out: torch.Tensor,
               gates: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The fused step (:meth:`decode`, :meth:`decode_projected`), raising the reference's error when a row could
        not be stepped."""
        failure = self.fused.decode(slots.contiguous(), *inputs, out, gates)
        if failure is not None:
            self._refuse(slots, failure)

    def _refuse(self, slots: torch.Tensor, failure: Failure) -> None:
        """Raise the error the reference raises for the step the fused operator could not complete: its inputs, its
        slot, or the state or record it could not store (stored here by the reference's own format or buffer, which
        refuses it). The failing row and head wrote nothing; the batch's other rows may have stepped."""
        H, HV, K, V = self.dims
        if failure.kind == "input":
            raise PaceError(f"k, v, g of {self.name}: non-finite values; allowed: finite inputs")
        if failure.kind == "slot":
            raise PaceError(f"slots: {int(slots[failure.row])} not allowed for {self.name}; "
                            f"allowed: 0..{self.slots - 1}")
        if failure.kind == "record":
            u = torch.zeros(1, HV, V)
            u[0, failure.head] = failure.u
            self.records.rounded("value", u)
        else:
            S = torch.zeros(1, HV, K, V)
            S[0, failure.head] = failure.S
            self.fmt.store(self.fmt.unrotate(S) if self.cfg.key_hadamard else S)
        raise PaceError(f"{self.name}: the {failure.kind} of slot {int(slots[failure.row])}, value head {failure.head} "
                        "lies at the limit of what its format stores (float32 or an fp16 scale); allowed: states "
                        "within range")

    def _decode_rows(self, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of rows at any counts at once (the reference: the method's docstring)."""
        cfg, records = self.cfg, self.records
        counts = records_held(self.tensors["log_decays"].index_select(0, slots))
        checkpoint = with_tensors(
            self.template, {n: self.tensors[n].index_select(0, slots) for n in self.checkpoint_names}
        )
        S_hat = self.fmt.load(checkpoint)
        o, u = step_records(S_hat, records.masked_records(slots, counts, int(counts.max())), q, k, v, g, beta,
                            cfg.exact_current_token, records.rounded, records.dtype)
        records.write_at(slots, counts, k, u, g)
        full = (counts + 1 == cfg.decode_period).nonzero().squeeze(1)
        if full.numel():  # these rows' buffers are full: fold, store, empty
            rows = slots.index_select(0, full)
            S = fold_records(S_hat.index_select(0, full), records.masked_records(rows, counts[full] + 1,
                                                                                 cfg.decode_period), records.dtype)
            for name, t in checkpoint_tensors(self.fmt.store(S)).items():
                self.tensors[name].index_copy_(0, rows, t)
            records.empty_rows(rows)
        return o

    def prefill(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial: bool) -> torch.Tensor:
        """A prompt in ``slot``: ``q, k [T, H, K]`` prepared, ``v [T, HV, V]``, ``g, beta [T, HV]`` float32, from
        the slot's stored state (``initial``: a prompt continued, e.g. a chunked prefill's next part) or from
        zero -> ``o [T, HV, V]`` float32."""
        if self.fused is not None and q.shape[0] and all(x.dtype == torch.float32 for x in (q, k, v, g, beta)):
            out = torch.empty(v.shape, dtype=torch.float32)
            slots = torch.tensor([slot])
            failure = self.fused.prefill(slots, torch.tensor([0, q.shape[0]]), torch.tensor([initial]), q, k, v, g,
                                         beta, out)
            if failure is not None:
                self._refuse(slots, failure)
            return out
        sub = torch.tensor([slot], device=self.tensors[self.checkpoint_names[0]].device)
        if not initial:
            self.reset(sub)
        rows = self._rows(sub)
        state = self.state(rows)
        with state.call():
            o = state.prefill(*(x.unsqueeze(0) for x in (q, k, v, g, beta)))
        self._write(sub, rows, rows)
        return o[0]

    def prefill_projected(self, slots: torch.Tensor, starts: torch.Tensor, initial: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`prefill` of several prompts from a GDN layer's projections (as :meth:`decode_projected`'s, one row
        per token): prompt ``p`` in slot ``slots[p]`` is rows ``starts[p] .. starts[p + 1]`` (``starts [n + 1]``), from
        its stored state where ``initial[p]``; ``o`` written into the same rows of ``out``. The fused CPU step runs
        every prompt and head in one operator."""
        bounds = starts.tolist()
        if self.fused is not None and all(e > s for s, e in zip(bounds, bounds[1:])) and \
                all(x.dtype != torch.float64 for x in (q, k, v, a, b)):
            failure = self.fused.prefill(slots.contiguous(), starts.contiguous(), initial.bool().contiguous(), q, k, v,
                                         a, b, out, (A_log, dt_bias))
            if failure is not None:
                self._refuse(slots, failure)
            return
        q, k, v, g, beta = self.steps.step_inputs(q, k, v, a, b, A_log, dt_bias)
        for p, (s, e) in enumerate(zip(bounds, bounds[1:])):
            out[s:e] = self.prefill(int(slots[p]), q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], bool(initial[p])
                                    ).to(out.dtype)


def layer_format(cfg: PaceConfig, num_v_heads: int, gdn_index: int = 0, tp: tuple[int, int] = (0, 1),
                 name: str = "state"):
    """The checkpoint format of the ``num_v_heads`` value heads of GDN layer ``gdn_index`` that tensor-parallel
    rank ``tp = (rank, size)`` holds (the layer's heads ``rank·num_v_heads`` onwards, of ``size·num_v_heads``):
    their widths (:meth:`PaceConfig.head_bits`) and their share of the method's calibrated tensors (each
    ``[HV, ...]``, the value head first)."""
    rank, size = tp
    if not 0 <= rank < size:
        raise PaceError(f"tp: {tp} not allowed for {name}; allowed: (rank, size) with 0 <= rank < size")
    heads = slice(rank * num_v_heads, (rank + 1) * num_v_heads)
    total = size * num_v_heads
    bits = cfg.head_bits(gdn_index, total) if cfg.quantized else (cfg.bits,) * total
    layer = None if cfg.calibrated is None else {k: t[heads] for k, t in cfg.calibrated.layers[gdn_index].items()}
    return state_format(cfg, bits[heads], layer, name, gdn_index)


def pool_fields(cfg: PaceConfig, dims: tuple[int, int, int, int], gdn_index: int = 0, tp: tuple[int, int] = (0, 1),
                template=None) -> tuple[Field, ...]:
    """The per-slot tensors of one GDN layer's state under ``cfg`` (``dims = (H, HV, K, V)`` of the heads
    tensor-parallel rank ``tp`` holds, as :class:`StatePool`): the checkpoint's stored tensors and, at dP >= 2,
    the decode buffer's storage for dP records, in decreasing element size (so that fields laid one after another
    in a row of bytes start aligned). ``template``: a one-slot checkpoint of them, when at hand."""
    H, HV, K, V = dims
    if template is None:
        template = layer_format(cfg, HV, gdn_index, tp).zeros((1, HV, K, V), torch.device("cpu"))
    tensors = dict(checkpoint_tensors(template))
    if cfg.buffered:
        tensors.update(DecodeBuffer(1, H, HV, K, V, cfg.decode_period, cfg.buffer_format).storage())
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    return tuple(Field(name, tuple(tensors[name].shape[1:]), tensors[name].dtype) for name in order)
