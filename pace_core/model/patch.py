"""Run PACE inside transformers' own Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

How it hooks in (no copy of transformers' layer code):

- Each GDN module's ``forward`` is wrapped. The wrapper finds the call's cache (the forward
  argument is ``cache_params`` in transformers 5.17-5.23 and ``cache`` in other versions: the name
  is read from the signature at run time), gets or creates the :class:`StateStore` attached to that
  cache object, and runs the original forward with a context naming the store and the layer.
- The two core functions of the layer's modeling module (``torch_chunk_gated_delta_rule`` and
  ``torch_recurrent_gated_delta_rule``, which transformers itself swaps for FLA kernels when those
  are installed) are replaced by a dispatcher. Outside a PACE context it calls the original with the
  same arguments, so unpatched models are untouched. Inside, it takes the layer's ``q, k, v, g,
  beta``: transformers' choice of the recurrent function (a cached single-token step) is a PACE
  decode step (:meth:`StateStore.decode`, buffered, flush every dP); the chunked function (prompt,
  or any forward without a cached state) is a PACE prefill (:meth:`StateStore.prefill`, P-token
  segments). q/k arrive either per key head (5.23) or already repeated to the value heads (5.17,
  the GQA repeat sits in the layer there); repeated heads are taken back to one per key head.
- The recurrent state lives only in the store (packed codes + scales + decode buffer). The cache's
  own ``recurrent_states`` entry of a GDN layer is an empty ``[B, HV, 0, V]`` tensor, so no fp32
  copy is held. Conv states, attention KV and everything else stay in transformers' cache.

``method "none"`` with ``reference_dtype "float32"`` is transformers' own full-precision path: the
layers run unwrapped (the fp32 state is the cache's own tensor), so the behaviour is exactly the
original's. Every other configuration (including the bf16 reference) goes through the store.

Taps: :func:`tapped` calls a function with every core call's arguments (``q, k, v, g, beta`` as
transformers computes them) of a model's GDN layers, PACE applied or not, and then runs the call as usual;
the layer-local sweep and the calibration record their inputs this way. PACE and taps share the one
wrapper and the one dispatcher; both are removed once neither is in use.

Scopes: :func:`apply_pace` sets the model's own configuration (every forward, every thread). The ``with``
blocks :func:`pace`, :func:`stacked` and :func:`tapped` set theirs for the code that runs inside them only
(a ``contextvars`` scope: this thread), over the model's own, and leave nothing on the model when they
end, whatever ends them (``BaseException`` included). So runs of one shared model in several threads (a
dashboard's sessions; a rerun that starts while the run it supersedes is still unwinding) never see each
other's configuration, and an interrupted run leaves the model as it was.

Limits: the store follows a cache through ``reorder_cache`` (beam search) and ``reset``;
``crop`` / batch reshaping of a PACE cache (assisted decoding, contrastive search) are not
supported and raise. With left padding the P-token segments are counted over the padded positions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.graphs import DecodeGraphs, graphs_setting
from pace_core.model import state_op
from pace_core.recurrence import prepare_qk
from pace_core.shapes import ModelShape, shape_from_hf_config
from pace_core.state_store import StateStore, StoreStack

CORE_FUNCTIONS: tuple[str, str] = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
"""Names of the GDN core functions in transformers' modeling modules: (prefill, decode step)."""

_STORE_ATTR = "_pace_state_store"
_STORE_CONFIG_ATTR = "_pace_state_config"
_CONFIG_ATTR = "_pace_config"
_SHAPE_ATTR = "_pace_shape"
_SCOPES_ATTR = "_pace_open_scopes"
_ORIGINAL_ATTR = "_pace_original_forward"
_CACHE_ARG_NAMES = ("cache_params", "cache", "past_key_values")

Tap = Callable[[nn.Module, dict, bool], None]
"""``tap(module, arguments, decode)``: a GDN module, its core call's arguments by name (``query``, ``key``,
``value``, ``g``, ``beta``, ...) and whether transformers called its decode (recurrent) function."""


@dataclasses.dataclass
class _Call:
    """What the dispatcher needs inside one wrapped GDN forward."""

    module: nn.Module
    store: StateStore | None  # PACE: the cache's store, or one for this forward only (no cache); None: original
    taps: tuple[Tap, ...]


_ACTIVE: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("pace_active_gdn_call", default=None)
_TRACED: list[_Call] = []
"""The wrapped GDN forwards being traced by ``torch.compile`` (innermost last): dynamo cannot trace a
ContextVar, and it resolves this list while it traces, so a compiled graph holds the call's store as a
constant (:mod:`pace_core.model.state_op`)."""

# modeling module name -> (original functions by name, number of wrapped GDN modules using it)
_DISPATCH: dict[str, tuple[dict[str, object], int]] = {}
_LOCK = threading.RLock()
"""Guards the wrapping and unwrapping of GDN modules, :data:`_DISPATCH` and the count of open scopes."""

_OWN = object()
"""A scope's configuration when it keeps the model's own (:func:`tapped`)."""


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a ``with`` block sets on one model for the code inside it: the configuration (a PaceConfig, a
    :class:`StackKey`, None for transformers' own path, or :data:`_OWN`: the model's own) and the taps."""

    config: object = _OWN
    taps: tuple[Tap, ...] = ()


_SCOPES: contextvars.ContextVar[dict[int, _Scope]] = contextvars.ContextVar("pace_scopes", default={})  # noqa: B039 (never mutated)
"""The open scopes of this context by ``id(model)`` (a new dict for every change: contexts never share one)."""
_TRACE_SCOPES: dict[int, _Scope] = {}
"""The scopes as the last :func:`_scoped` left them, read while ``torch.compile`` traces (dynamo cannot trace a
ContextVar; it guards on what it reads here): compiling one model in several threads at once is not supported."""


def _settings(model: nn.Module) -> tuple[object, tuple[Tap, ...]]:
    """``(configuration, taps)`` the forwards of ``model`` run with in this context."""
    scopes = _TRACE_SCOPES if torch.compiler.is_compiling() else _SCOPES.get()
    scope = scopes.get(id(model), _Scope())
    if scope.config is _OWN:
        return model.__dict__.get(_CONFIG_ATTR), scope.taps
    return scope.config, scope.taps


@contextlib.contextmanager
def _scoped(model: nn.Module, **change) -> Iterator[None]:
    """Run the block with this context's scope of ``model`` changed by ``change`` (fields of :class:`_Scope`);
    the previous scope comes back, and the layers are unwrapped once nothing uses them, on any exit."""
    scopes = _SCOPES.get()
    scope = dataclasses.replace(scopes.get(id(model), _Scope()), **change)
    with _LOCK:
        _hook(model)
        model.__dict__[_SCOPES_ATTR] = model.__dict__.get(_SCOPES_ATTR, 0) + 1
        traced = _TRACE_SCOPES.get(id(model))
        _TRACE_SCOPES[id(model)] = scope
    token = _SCOPES.set({**scopes, id(model): scope})
    try:
        yield
    finally:
        _SCOPES.reset(token)
        with _LOCK:
            model.__dict__[_SCOPES_ATTR] -= 1
            if traced is None or not model.__dict__[_SCOPES_ATTR]:  # none left open: none to trace
                _TRACE_SCOPES.pop(id(model), None)
            else:
                _TRACE_SCOPES[id(model)] = traced
            _unhook_if_idle(model)


def is_reference(cfg: PaceConfig) -> bool:
    """True for the configuration that is transformers' own fp32 path (no store, no wrapping):
    method ``none``, ``float32``, ``decode_period`` 1. (``none`` + ``float32`` with dP > 1 runs the
    decode buffer without any rounding: the "quantisation off, buffering on" check.)"""
    return cfg.exact and cfg.decode_period == 1


def gdn_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer_idx, module)`` of every Gated DeltaNet module of ``model``, in layer order."""
    found = [
        (int(m.layer_idx), m)
        for m in model.modules()
        if type(m).__name__.endswith("GatedDeltaNet") and hasattr(m, "layer_idx")
    ]
    return sorted(found, key=lambda item: item[0])


def _cache_arg_name(forward) -> str:
    params = inspect.signature(forward).parameters
    for name in _CACHE_ARG_NAMES:
        if name in params:
            return name
    raise PaceError(
        f"transformers GDN forward: no cache argument among {', '.join(_CACHE_ARG_NAMES)} "
        f"(signature {inspect.signature(forward)}); this transformers version is not supported"
    )


def get_state_store(cache) -> StateStore | None:
    """The PACE state held in a ``generate()`` / forward cache, or None (no PACE, or the fp32
    reference path whose state is the cache's own ``recurrent_states``)."""
    return getattr(cache, _STORE_ATTR, None)


def _follow_cache(cache, store: StateStore, cfg: PaceConfig) -> None:
    """Attach ``store`` (of configuration ``cfg``) to ``cache`` and make the cache's batch
    operations keep it in step."""
    setattr(cache, _STORE_ATTR, store)
    setattr(cache, _STORE_CONFIG_ATTR, cfg)
    state_op.register(store)
    reorder, reset = cache.reorder_cache, cache.reset

    def reorder_cache(self, beam_idx: torch.LongTensor):
        reorder(beam_idx)
        store.reorder(beam_idx)

    def reset_cache(self):
        reset()
        store.reset()

    def unsupported(name):
        def refuse(self, *args, **kwargs):
            raise PaceError(
                f"cache.{name}: not supported on a PACE cache; allowed: generate, forward, reorder_cache, reset"
            )

        return refuse

    cache.reorder_cache = types.MethodType(reorder_cache, cache)
    cache.reset = types.MethodType(reset_cache, cache)
    for name in ("crop", "batch_repeat_interleave", "batch_select_indices"):
        if hasattr(cache, name):
            setattr(cache, name, types.MethodType(unsupported(name), cache))


def layer_devices(modules: list[tuple[int, nn.Module]], default: torch.device) -> dict[int, torch.device]:
    """The device of each GDN layer (``(layer_idx, module)`` of :func:`gdn_modules`): its module's parameters'
    (under ``device_map``, the GPU the layer was placed on), ``default`` for a module without parameters or
    with offloaded ones (on the meta device: its inputs arrive on ``default``'s side, and its state moves to
    them on the first tokens, :class:`~pace_core.state_store.LayerState`)."""
    devices = {}
    for layer, module in modules:
        param = next(module.parameters(), None)
        devices[layer] = default if param is None or param.device.type == "meta" else param.device
    return devices


def _new_store(model: nn.Module, cfg: PaceConfig, hidden_states: torch.Tensor, layer: int | None) -> StateStore:
    """A store for every GDN layer (``layer`` None: a cache's store), or for the one GDN layer
    ``layer`` (a forward without a cache), with that layer's share of what is chosen per layer."""
    shape: ModelShape = model.__dict__[_SHAPE_ATTR]
    modules = gdn_modules(model)
    layers = [i for i, _ in modules]
    if layer is not None:
        cfg = cfg.for_layer(layers.index(layer))
        layers = [layer]
    return StateStore(
        cfg,
        shape if layer is None else None,  # the model shape counts every GDN layer
        hidden_states.shape[0],
        hidden_states.device if layer is not None else layer_devices(modules, hidden_states.device),
        shape.num_k_heads,
        shape.num_v_heads,
        shape.d_k,
        shape.d_v,
        layers,
    )


def _wrap_forward(model: nn.Module, module: nn.Module, original) -> None:
    cache_name = _cache_arg_name(original)
    signature = inspect.signature(original)
    layer_idx = int(module.layer_idx)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cfg, taps = _settings(model)
        store = None
        if cfg is not None:
            bound = signature.bind_partial(*args, **kwargs).arguments
            hidden_states = bound["hidden_states"] if "hidden_states" in bound else args[0]
            cache = bound.get(cache_name)
            if cache is None:
                store = _new_store(model, cfg, hidden_states, layer_idx)
            else:
                store = get_state_store(cache)
                if store is None:
                    if cache.get_seq_length() > 0:
                        raise PaceError("cache: it already holds the state of tokens run without PACE (a full-"
                                        "precision state); allowed: a fresh cache after apply_pace")
                    store = _new_store(model, cfg, hidden_states, None)
                    _follow_cache(cache, store, cfg)
                elif getattr(cache, _STORE_CONFIG_ATTR) != cfg:
                    raise PaceError("cache: it holds a PACE state of another configuration; allowed: a fresh "
                                    "cache after apply_pace")
        if torch.compiler.is_compiling():
            _TRACED.append(_Call(module, store, taps))
            try:
                return original(*args, **kwargs)
            finally:
                _TRACED.pop()
        token = _ACTIVE.set(_Call(module, store, taps))
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    setattr(module, _ORIGINAL_ATTR, module.__dict__.get("forward"))
    module.forward = forward


def _unwrap_forward(module: nn.Module) -> None:
    original = module.__dict__.pop(_ORIGINAL_ATTR)
    if original is None:
        del module.forward
    else:
        module.forward = original


def core_inputs(module: nn.Module, arguments: dict) -> tuple[torch.Tensor, ...]:
    """The recurrence inputs of one call of a GDN core function (``arguments``: its arguments by
    name) as pace_core uses them: ``q, k [B, T, H, K]`` prepared (L2-normalised as transformers'
    kernel does when ``use_qk_l2norm_in_kernel``, q scaled by ``K**-0.5``), ``v [B, T, HV, V]``,
    ``g, beta [B, T, HV]``, all float32. q/k repeated to the value heads by the layer (transformers
    5.17 repeats before the call, 5.23 inside it) are taken back to one per key head."""
    query, key = arguments["query"], arguments["key"]
    if query.shape[2] != module.num_k_heads:
        gamma = module.num_v_heads // module.num_k_heads
        query, key = query[:, :, ::gamma], key[:, :, ::gamma]
    if arguments.get("use_qk_l2norm_in_kernel", False):
        q, k = prepare_qk(query, key)
    else:
        q, k = query.float() * query.shape[-1] ** -0.5, key.float()
    return q, k, arguments["value"].float(), arguments["g"].float(), arguments["beta"].float()


def _run_pace(call: _Call, decode: bool, bound: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PACE replacement of one core call; returns ``(o [B, T, HV, V], empty state or None)``."""
    q, k, v, g, beta = core_inputs(call.module, bound)
    layer = int(call.module.layer_idx)
    if torch.compiler.is_compiling():  # one opaque node of the compiled graph (pace_core.model.state_op)
        o = state_op.gdn_state(q, k, v, g, beta, state_op.handle_of(call.store), layer, decode)
    else:
        o = call.store.run(layer, q, k, v, g, beta, decode)
    final = None
    if bound.get("output_final_state", False):
        B, _, HV, V = v.shape
        final = torch.empty(B, HV, 0, V, dtype=torch.float32, device=v.device)
    return o.to(bound["query"].dtype), final


def _dispatcher(original, decode: bool):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def core(*args, **kwargs):
        call = (_TRACED[-1] if _TRACED else None) if torch.compiler.is_compiling() else _ACTIVE.get()
        if call is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for tap in call.taps:
            tap(call.module, bound.arguments, decode)
        if call.store is None:
            return original(*args, **kwargs)
        return _run_pace(call, decode, bound.arguments)

    return core


def _install_dispatch(module_name: str) -> None:
    originals, users = _DISPATCH.get(module_name, ({}, 0))
    if not originals:
        modeling = sys.modules[module_name]
        missing = [name for name in CORE_FUNCTIONS if not callable(getattr(modeling, name, None))]
        if missing:
            raise PaceError(
                f"transformers: {module_name} has no {', '.join(missing)}; this transformers version is not supported"
            )
        for name, decode in zip(CORE_FUNCTIONS, (False, True)):
            originals[name] = getattr(modeling, name)
            setattr(modeling, name, _dispatcher(originals[name], decode))
    _DISPATCH[module_name] = (originals, users + 1)


def _release_dispatch(module_name: str) -> None:
    originals, users = _DISPATCH[module_name]
    if users > 1:
        _DISPATCH[module_name] = (originals, users - 1)
        return
    modeling = sys.modules[module_name]
    for name, fn in originals.items():
        setattr(modeling, name, fn)
    del _DISPATCH[module_name]


def _wrapped(model: nn.Module) -> bool:
    return any(_ORIGINAL_ATTR in m.__dict__ for _, m in gdn_modules(model))


def _hook(model: nn.Module) -> None:
    """Wrap the GDN forwards and install the dispatcher (once per model; under :data:`_LOCK`)."""
    if _wrapped(model):
        return
    for _, module in gdn_modules(model):
        _install_dispatch(type(module).__module__)
        _wrap_forward(model, module, module.forward)


def _unhook_if_idle(model: nn.Module) -> None:
    """Restore the original GDN layers once neither the model's own configuration nor an open scope uses them
    (under :data:`_LOCK`)."""
    if model.__dict__.get(_CONFIG_ATTR) is not None or model.__dict__.get(_SCOPES_ATTR):
        return
    for _, module in gdn_modules(model):
        if _ORIGINAL_ATTR in module.__dict__:
            _unwrap_forward(module)
            _release_dispatch(type(module).__module__)


def _modules_or_refuse(model: nn.Module) -> list[tuple[int, nn.Module]]:
    modules = gdn_modules(model)
    if not modules:
        raise PaceError(f"model: {type(model).__name__} has no Gated DeltaNet layers; allowed: a hybrid GDN model")
    return modules


def _checked(model: nn.Module, cfg: PaceConfig) -> PaceConfig | None:
    """``cfg`` checked for ``model`` (see :func:`apply_pace`); None for transformers' own path
    (:func:`is_reference`)."""
    if not isinstance(cfg, PaceConfig):
        raise PaceError(f"cfg: {type(cfg).__name__} not allowed; allowed: a PaceConfig")
    _modules_or_refuse(model)
    cfg.validate_for(_shape(model))
    if is_reference(cfg):
        return None
    if cfg.needs_calibration:
        raise PaceError(f"configuration {cfg.name!r} is not calibrated on this model (8-bit heads or "
                        f"{cfg.method}'s per-layer tensors); allowed: a configuration calibrated on it "
                        "(pace_core.analysis.calibration.calibrate, or an exported file)")
    return cfg


def _shape(model: nn.Module) -> ModelShape:
    """The model's state geometry (read from its config once)."""
    if _SHAPE_ATTR not in model.__dict__:
        model.__dict__[_SHAPE_ATTR] = shape_from_hf_config(model.config)
    return model.__dict__[_SHAPE_ATTR]


def apply_pace(model: nn.Module, cfg: PaceConfig) -> None:
    """Run ``model``'s GDN layers with PACE configuration ``cfg`` (idempotent; a new ``cfg``
    replaces the previous one): the model's own configuration, for every forward outside a :func:`pace` or
    :func:`stacked` block. The reference (:func:`is_reference`) restores transformers' own
    path. A configuration that needs what is calibrated on the model (:attr:`PaceConfig.needs_calibration`)
    is refused. A cache keeps the configuration it was filled with: caches from before a change are refused."""
    checked = _checked(model, cfg)
    if checked is None:
        remove_pace(model)
        return
    with _LOCK:
        model.__dict__[_CONFIG_ATTR] = checked
        _hook(model)


def remove_pace(model: nn.Module) -> None:
    """Remove ``model``'s own configuration, restoring its original GDN layers unless a scope is open
    (no-op when PACE is not applied)."""
    with _LOCK:
        model.__dict__.pop(_CONFIG_ATTR, None)
        _unhook_if_idle(model)


@dataclasses.dataclass(frozen=True)
class StackKey:
    """The configuration of a model running a :class:`~pace_core.state_store.StoreStack` (its members'
    configurations): what a cache filled by it is checked against."""

    configs: tuple[PaceConfig, ...]


def new_stack(model: nn.Module, configs: list[PaceConfig], rows: int, *, device: torch.device | None = None,
              graphs: bool = True) -> StoreStack:
    """A :class:`~pace_core.state_store.StoreStack` of ``configs`` for ``rows`` sequences each on ``model``'s GDN
    layers (zero states), to run in :func:`stacked`; on one CUDA device its teacher-forced calls are recorded as
    CUDA graphs (:mod:`pace_core.graphs`) unless ``graphs`` is False or graphs are off
    (:data:`pace_core.graphs.GRAPHS_ENV`)."""
    modules = _modules_or_refuse(model)
    shape = _shape(model)
    devices = layer_devices(modules, device if device is not None else next(model.parameters()).device)
    layers = [i for i, _ in modules]
    stores = [StateStore(cfg, shape, rows, devices, shape.num_k_heads, shape.num_v_heads, shape.d_k, shape.d_v,
                         layers) for cfg in configs]
    stack = StoreStack(stores, rows)
    places = {torch.device(d) for d in devices.values()}
    if graphs and len(places) == 1 and next(iter(places)).type == "cuda" and graphs_setting() == "auto":
        stack.graphs = DecodeGraphs(next(iter(places)))
    return stack


@contextlib.contextmanager
def stacked(model: nn.Module, configs: list[PaceConfig], rows: int, *, device: torch.device | None = None,
            stack: StoreStack | None = None) -> Iterator[tuple[object, StoreStack]]:
    """Run several configurations in one batch inside the block: yields ``(cache, stack)``, a fresh
    transformers cache whose forwards give rows ``[i·rows, (i+1)·rows)`` to ``configs[i]`` (a
    :class:`~pace_core.state_store.StoreStack`: ``stack``, made by :func:`new_stack` for these configurations and
    rows and reset to zero states, so that its recorded graphs serve again; else a new one). Feed the
    cache to the model's forwards inside the block (this context's scope: module docstring)."""
    from transformers import DynamicCache

    if stack is None:
        stack = new_stack(model, configs, rows, device=device)
    elif [s.cfg for s in stack.stores] != list(configs) or stack.rows != rows:
        raise PaceError(f"stack: made for {[s.cfg.name for s in stack.stores]} x {stack.rows} rows; allowed: one "
                        f"made for {[c.name for c in configs]} x {rows} rows")
    else:
        stack.reset()
    key = StackKey(tuple(configs))
    cache = DynamicCache(config=model.config)
    setattr(cache, _STORE_ATTR, stack)
    setattr(cache, _STORE_CONFIG_ATTR, key)
    state_op.register(stack)
    with _scoped(model, config=key):
        yield cache, stack


@contextlib.contextmanager
def tapped(model: nn.Module, tap: Tap) -> Iterator[nn.Module]:
    """Call ``tap`` (:data:`Tap`) with every core call of ``model``'s GDN layers inside the block (this
    context's scope), with or without PACE; the calls then run as they would without the tap."""
    _modules_or_refuse(model)
    with _scoped(model, taps=_SCOPES.get().get(id(model), _Scope()).taps + (tap,)):
        yield model


def current_config(model: nn.Module) -> PaceConfig | None:
    """The PACE configuration ``model``'s forwards run with here (inside a :func:`pace` block its
    configuration, else the model's own; None: transformers' own fp32 path)."""
    cfg = _settings(model)[0]
    return cfg if isinstance(cfg, PaceConfig) else None


@contextlib.contextmanager
def pace(model: nn.Module, cfg: PaceConfig) -> Iterator[nn.Module]:
    """Run ``model``'s forwards inside the block with ``cfg`` (checked as :func:`apply_pace` does), in this
    context's scope only (module docstring): the model's own configuration is untouched."""
    with _scoped(model, config=_checked(model, cfg)):
        yield model
