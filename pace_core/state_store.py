"""The quantised recurrent state of a model (spec §2–§4): per GDN layer a
:class:`~pace_core.schedule.PeriodicState` (checkpoint in its method's format, decode buffer, the
rounding schedule) on the layer's backend.

This is the public entry of the state: inputs are checked here, once per call (shapes, device, and the
finiteness of ``k, v, g``); the configuration was validated when it was made
(:class:`~pace_core.config.PaceConfig`, and :meth:`~pace_core.config.PaceConfig.validate_for` the model
shape, once, when the store is built). The schedule (:mod:`pace_core.schedule`), the storage formats
(:mod:`pace_core.checkpoint`) and the backends (:mod:`pace_core.backend`) trust what comes from here.

A layer's tensors live on the construction ``device`` until its first tokens arrive; if those are on
another device (``device_map="auto"``), the still-empty layer is re-created there (with its backend
chosen again, on that device). Later tokens must come on that device.

Bytes (:meth:`StateStore.layer_nbytes`), all counted from the stored tensors: ``payload`` and
``metadata`` of the checkpoint (:mod:`pace_core.checkpoint`), ``buffer`` = the decode buffer's allocated
storage for dP records (0 at dP = 1).

All batch rows step together (as in HF ``generate``). Computation is float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from pace_core.backend import backend_setting, refuse_non_finite
from pace_core.errors import PaceError
from pace_core.graphs import DecodeGraphs
from pace_core.pool import StatePool
from pace_core.schedule import Capture
from pace_core.shapes import ModelShape

if TYPE_CHECKING:
    from pace_core.buffer import DecodeBuffer
    from pace_core.checkpoint import Checkpoint
    from pace_core.config import PaceConfig


class LayerState:
    """One GDN layer's state for ``batch`` sequences (``cfg`` validated for the layer's shape).

    ``gdn_index``: the layer's position among the GDN layers (selects ``cfg.high_heads``);
    ``name`` is used in error messages;
    ``backend``: ``auto`` / ``reference`` / ``triton`` (default ``$PACE_KERNELS``, see
    :mod:`pace_core.backend`).
    """

    def __init__(self, cfg: PaceConfig, batch: int, num_k_heads: int, num_v_heads: int, d_k: int, d_v: int,
                 device: torch.device | str, gdn_index: int = 0,
                 name: str = "state", chunk_size: int = 64, backend: str | None = None) -> None:
        self.cfg, self.name, self.chunk_size, self.gdn_index = cfg, name, chunk_size, gdn_index
        self.setting = backend_setting(backend)
        self.shape = (batch, num_k_heads, num_v_heads, d_k, d_v)
        self._allocate(torch.device(device))

    def _allocate(self, device: torch.device) -> None:
        """(Re-)create the empty layer state on ``device``: a pool of the batch's slots (a zero state in each, its
        backend) and the schedule over all of them."""
        B, H, HV, K, V = self.shape
        self.device = device
        self.pool = StatePool(self.cfg, (H, HV, K, V), B, device, gdn_index=self.gdn_index, name=self.name,
                              backend=self.setting, chunk_size=self.chunk_size)
        self.fmt = self.pool.fmt
        self.state = self.pool.state()
        self.used = False

    @property
    def bits_per_head(self) -> tuple[int, ...]:
        """Storage bits of each value head."""
        return self.fmt.bits_per_head

    @property
    def checkpoint(self) -> Checkpoint:
        """The stored checkpoint (see :mod:`pace_core.checkpoint`)."""
        return self.state.checkpoint

    @property
    def buffer(self) -> DecodeBuffer | None:
        """The decode buffer (None at dP = 1)."""
        return self.state.buffer

    def records_held(self) -> int:
        """The decode buffer's record count, which the host keeps (0 at dP = 1)."""
        return 0 if self.buffer is None else len(self.buffer)

    def recount(self, n: int) -> None:
        """Set the buffer's record count to ``n``: the count a recorded call left, after its replay wrote the
        records (:mod:`pace_core.graphs`)."""
        if self.buffer is not None:
            self.buffer.recount(n)

    def uses_kernels(self) -> bool:
        """Whether the layer runs on the Triton kernels (fixed per device; :mod:`pace_core.backend`)."""
        return self.state.steps.name == "triton"

    def _check(self, q, k, v, g, beta, finite: bool) -> int:
        if q.dim() != 4:
            raise PaceError(f"q: shape {tuple(q.shape)} not allowed; allowed: [B, T, H, K]")
        T = q.shape[1]
        B, H, HV, K, V = self.shape
        for name, t, shape in (("q", q, (B, T, H, K)), ("k", k, (B, T, H, K)), ("v", v, (B, T, HV, V)),
                               ("g", g, (B, T, HV)), ("beta", beta, (B, T, HV))):
            if tuple(t.shape) != shape:
                raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed ({self.name}); allowed: {shape}")
        if q.device != self.device:
            if self.used:
                raise PaceError(f"q: device {q.device} not allowed ({self.name}); allowed: {self.device}")
            self._allocate(q.device)
        if finite and T:
            refuse_non_finite(k, v, g, self.name)
        self.used = self.used or T > 0
        return T

    def prefill(self, q, k, v, g, beta, capture: Capture | None = None) -> torch.Tensor:
        """Prompt tokens ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` in
        P-token segments (:meth:`PeriodicState.prefill`, with its ``capture``); returns ``o [B, T, HV, V]``
        float32. A state that turns non-finite is refused before it is stored."""
        self._check(q, k, v, g, beta, finite=False)
        with self._on_device():
            return self.state.prefill(q.float(), k.float(), v.float(), g.float(), beta.float(), capture)

    def decode(self, q, k, v, g, beta, capture: Capture | None = None, checked: bool = False) -> torch.Tensor:
        """Decode tokens one by one (shapes as :meth:`prefill`), flushing every dP tokens
        (:meth:`PeriodicState.decode`, with its ``capture``). Non-finite ``k, v, g`` are refused before any
        token runs (:func:`refuse_non_finite`), unless the caller has ``checked`` them."""
        self._check(q, k, v, g, beta, finite=not checked)
        with self._on_device():
            return self.state.decode(q.float(), k.float(), v.float(), g.float(), beta.float(), capture)

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """One call of the layer (:meth:`PeriodicState.call`: its workspaces end with it), launched on the
        layer's own GPU (under ``device_map``)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext(), self.state.call():
            yield

    def flush(self) -> None:
        """Fold the buffered records into the checkpoint, store it and clear the buffer."""
        with self._on_device():
            self.state.flush()

    def effective_state(self) -> torch.Tensor:
        """Checkpoint plus folded buffer: ``S [B, HV, K, V]`` float32."""
        with self._on_device():
            return self.state.effective_state()

    def dequantized(self) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32."""
        with self._on_device():
            return self.state.dequantized()

    def nbytes(self) -> dict[str, int]:
        """``{"payload", "metadata", "buffer"}`` real bytes (module docstring)."""
        payload, metadata = self.fmt.nbytes(self.checkpoint)
        buffer = 0 if self.buffer is None else self.buffer.nbytes_allocated()
        return {"payload": payload, "metadata": metadata, "buffer": buffer}

    def reorder(self, index: torch.Tensor) -> None:
        """Batch row ``b`` becomes old row ``index[b]``."""
        self.state.reorder(index.to(self.device))

    def reset(self) -> None:
        """Zero state, empty buffer (the layer counts as unused again)."""
        self.state.reset()
        self.used = False


class StateStore:
    """The recurrent state of one model: a :class:`LayerState` per GDN layer.

    ``layers`` are the model's layer indices of the GDN layers (``cfg.high_heads`` and ``cfg.calibrated`` are
    in the same order). ``device``: where the layers' states are first allocated, one device for all or one
    per layer (under ``device_map`` each layer's GPU, so that no GPU holds another's states even briefly).
    ``cfg`` is validated here for ``shape`` (the model's, or, when None, a shape of
    these head counts and dims with ``len(layers)`` GDN layers), once. q, k passed to :meth:`prefill` /
    :meth:`decode` are prepared (:func:`pace_core.recurrence.prepare_qk`).
    """

    def __init__(self, cfg: PaceConfig, shape: ModelShape | None, batch: int,
                 device: torch.device | str | Mapping[int, torch.device | str],
                 num_k_heads: int, num_v_heads: int, d_k: int, d_v: int, layers: list[int], *,
                 chunk_size: int = 64,
                 backend: str | None = None) -> None:
        layers = list(layers)
        if len(set(layers)) != len(layers):
            raise PaceError(f"layers: {layers} not allowed; allowed: distinct layer indices")
        if shape is None:
            shape = ModelShape("state store", len(layers), len(layers), num_k_heads, num_v_heads, d_k, d_v, 0)
        else:
            for field, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads), ("d_k", d_k),
                                 ("d_v", d_v)):
                if getattr(shape, field) != value:
                    raise PaceError(f"{field}: {value} not allowed; allowed: {getattr(shape, field)} "
                                    f"(model shape {shape.name})")
        cfg.validate_for(shape)
        if cfg.high_heads is not None and len(cfg.high_heads) != len(layers):
            raise PaceError(f"high_heads: {len(cfg.high_heads)} layers not allowed; allowed: one entry per GDN "
                            f"layer ({len(layers)})")
        devices = device if isinstance(device, Mapping) else dict.fromkeys(layers, device)
        if set(devices) != set(layers):
            raise PaceError(f"device: layers {sorted(devices)} not allowed; allowed: one device per GDN layer {layers}")
        self.cfg, self.batch, self.layers, self.device = cfg, batch, layers, torch.device(devices[layers[0]])
        self.teacher_forcing = False
        """While True, every core call's tokens are decode tokens (a teacher-forced forward over many tokens
        runs them as ``generate`` would, one at a time: pace_core.model.teacher)."""
        self.capture: Callable[[int], Capture | None] | None = None
        """``capture(layer)``: the states wanted from that layer's next core call (or None)."""
        self._states = {
            layer: LayerState(cfg, batch, num_k_heads, num_v_heads, d_k, d_v, devices[layer], gdn_index=i,
                              name=f"state of GDN layer {layer}", chunk_size=chunk_size, backend=backend)
            for i, layer in enumerate(layers)
        }

    def layer(self, layer: int) -> LayerState:
        """The :class:`LayerState` of model layer ``layer``."""
        if layer not in self._states:
            raise PaceError(f"layer: {layer!r} not allowed; allowed: the GDN layers {self.layers}")
        return self._states[layer]

    def run(self, layer: int, q, k, v, g, beta, decode: bool, checked: bool = False) -> torch.Tensor:
        """One core call of a GDN layer (the model's forward): decode tokens (``decode``, or every token
        while :attr:`teacher_forcing`) or a prompt, with the states :attr:`capture` asks for. ``checked``:
        the caller refused non-finite decode inputs already."""
        capture = None if self.capture is None else self.capture(layer)
        if decode or self.teacher_forcing:
            return self.layer(layer).decode(q, k, v, g, beta, capture, checked)
        return self.layer(layer).prefill(q, k, v, g, beta, capture)

    def prefill(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """Prompt tokens of one layer (:meth:`LayerState.prefill`): ``o [B, T, HV, V]``."""
        return self.layer(layer).prefill(q, k, v, g, beta)

    def decode(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """Decode tokens of one layer (:meth:`LayerState.decode`): ``o [B, T, HV, V]``."""
        return self.layer(layer).decode(q, k, v, g, beta)

    def effective_state(self, layer: int) -> torch.Tensor:
        """Checkpoint + folded buffer of one layer: ``S [B, HV, K, V]`` float32."""
        return self.layer(layer).effective_state()

    def checkpoint_dequantized(self, layer: int) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32 of one layer."""
        return self.layer(layer).dequantized()

    def bits_per_head(self, layer: int) -> tuple[int, ...]:
        """Storage bits of each value head of one layer."""
        return self.layer(layer).bits_per_head

    def buffer(self, layer: int) -> DecodeBuffer | None:
        """The decode buffer of one layer (None at dP = 1)."""
        return self.layer(layer).buffer

    def has_state(self, layer: int) -> bool:
        """True once the layer has received tokens (since construction or :meth:`reset`)."""
        return self.layer(layer).used

    def layer_nbytes(self, layer: int) -> dict[str, int]:
        """``{"payload", "metadata", "buffer"}`` real bytes of one layer."""
        return self.layer(layer).nbytes()

    def nbytes(self) -> int:
        """Real bytes of all layers (payload + metadata + buffer)."""
        return sum(sum(s.nbytes().values()) for s in self._states.values())

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch rows of every layer: row ``b`` becomes old row ``beam_idx[b]``."""
        index = torch.as_tensor(beam_idx, dtype=torch.long, device=self.device)
        if index.shape != (self.batch,) or not 0 <= int(index.min()) <= int(index.max()) < self.batch:
            raise PaceError(f"beam_idx: {index.tolist()} not allowed; allowed: {self.batch} row indices in "
                            f"0..{self.batch - 1}")
        for s in self._states.values():
            s.reorder(index)

    def reset(self) -> None:
        """Zero state and empty buffers in every layer."""
        for s in self._states.values():
            s.reset()



class StoreStack:
    """Several configurations in one batch: rows ``[i·rows, (i+1)·rows)`` of every forward belong to
    ``stores[i]`` (a :class:`StateStore` of its own configuration, ``rows`` sequences). It serves the model
    like one store (:meth:`run`), so configurations share a forward; each keeps its own state, scales and
    buffer. ``capture(member, layer)``: the states wanted from that member's layer in the next core call."""

    def __init__(self, stores: Sequence[StateStore], rows: int) -> None:
        self.stores, self.rows = list(stores), rows
        self.batch = rows * len(self.stores)
        self.layers = self.stores[0].layers
        self.teacher_forcing = False
        self.capture: Callable[[int, int], Capture | None] | None = None
        self.progress: Callable[[int], None] | None = None
        """Called with 1 for each member after each core call (a progress bar's unit)."""
        self.graphs: DecodeGraphs | None = None
        """Where teacher-forced calls are recorded and replayed as CUDA graphs (None: every call runs as it is)."""

    def run(self, layer: int, q, k, v, g, beta, decode: bool) -> torch.Tensor:
        """One core call of a GDN layer, each member on its rows (:meth:`StateStore.run`): ``o [B, T, HV, V]``.
        Decode inputs are checked once for every member. A teacher-forced call that captures no state runs through
        :attr:`graphs` where the stack has them (:mod:`pace_core.graphs`)."""
        checked = (decode or self.teacher_forcing) and q.shape[1] > 0
        captures = [None if self.capture is None else self.capture(i, layer) for i in range(len(self.stores))]
        for i, store in enumerate(self.stores):
            store.teacher_forcing = self.teacher_forcing
            store.capture = (lambda lay, c=captures[i]: c) if captures[i] is not None else None
        inputs = (q, k, v, g, beta)
        if self.graphs is not None and checked and self.teacher_forcing and not any(captures):
            o = self.graphs.run(self.graph_key(layer, q), lambda *x: self._run(layer, decode, *x), inputs,
                                lambda: self._host_state(layer), lambda counts: self._set_host_state(layer, counts),
                                lambda: self.generators(layer))
        else:
            o = self._run(layer, decode, *inputs)
        if self.progress is not None:
            for _ in self.stores:
                self.progress(1)
        return o

    def _run(self, layer: int, decode: bool, q, k, v, g, beta) -> torch.Tensor:
        """Every member's part of one core call (the inputs' finiteness checked first, for all members at once)."""
        checked = (decode or self.teacher_forcing) and q.shape[1] > 0
        if checked:
            refuse_non_finite(k, v, g, f"state of GDN layer {layer}")
        outputs = [store.run(layer, *inputs, decode, checked)
                   for store, *inputs in zip(self.stores, *(t.split(self.rows) for t in (q, k, v, g, beta)))]
        return torch.cat(outputs)

    def graph_key(self, layer: int, q: torch.Tensor) -> tuple:
        """What a teacher-forced call's CUDA graph is recorded under: the layer, the inputs' shape and the host's part
        of the layer's states (:meth:`_host_state`)."""
        return layer, tuple(q.shape), self._host_state(layer)

    def generators(self, layer: int) -> list[torch.Generator]:
        """The random generators of the layer's states (stochastic rounding's), which its calls draw from."""
        return [s.layer(layer).fmt.generator for s in self.stores if s.layer(layer).fmt.generator is not None]

    def _host_state(self, layer: int) -> tuple[int, ...]:
        """What the host keeps of one layer's states: each member's count of buffered records."""
        return tuple(s.layer(layer).records_held() for s in self.stores)

    def _set_host_state(self, layer: int, counts: tuple[int, ...]) -> None:
        for store, n in zip(self.stores, counts):
            store.layer(layer).recount(n)

    def effective_state(self, layer: int) -> torch.Tensor:
        """Every member's checkpoint + folded buffer, stacked like the rows: ``S [B, HV, K, V]`` float32."""
        return torch.cat([s.effective_state(layer) for s in self.stores])

    def layer_nbytes(self, layer: int) -> dict[str, int]:
        """``{"payload", "metadata", "buffer"}`` real bytes of one layer over all members."""
        sizes = [s.layer_nbytes(layer) for s in self.stores]
        return {k: sum(x[k] for x in sizes) for k in sizes[0]}

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Not supported: a stack's rows belong to its members."""
        raise PaceError("reorder: not supported for several configurations in one batch; allowed: one configuration")

    def reset(self) -> None:
        """Zero state and empty buffers in every member."""
        for s in self.stores:
            s.reset()
