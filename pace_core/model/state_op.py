"""The GDN state as one ``torch.library`` operator, so that ``torch.compile`` graphs hold PACE's state.

``torch.ops.pace.gdn_state(q, k, v, g, beta, store, layer, decode) -> o`` is one core call of a GDN
layer on a registered state store (:meth:`pace_core.state_store.StateStore.run`, or a
:class:`~pace_core.state_store.StoreStack`'s): ``q, k [B, T, H, K]`` prepared, ``v [B, T, HV, V]``,
``g, beta [B, T, HV]``; returns ``o [B, T, HV, V]`` float32. ``store`` is the handle :func:`register`
gave the store, ``layer`` the model's layer index, ``decode`` whether the tokens are decode tokens.

The compiler sees the operator as one opaque node (its fake implementation gives the output's shape):
the state's checks, its schedule on the host (the buffer's record count, the flush every dP) and its
kernels run when the graph calls it. So one compiled graph of the model serves every buffer position,
and the CUDA graphs captured per buffer position around it (``kernels/bench/bench_e2e.py``) replay the
kernels that position launches. The state's tensors are not arguments: it is the store's, as in eager
runs, and the compiler neither reads nor moves it.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from pace_core.errors import PaceError

_HANDLE_ATTR = "_pace_op_handle"
_STORES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(store) -> int:
    """The operator's handle of ``store`` (a StateStore or StoreStack), given once and kept by the store
    (the registry holds it weakly: a handle outlives no store)."""
    handle = getattr(store, _HANDLE_ATTR, None)
    if handle is None:
        handle = next(_NEXT)
        setattr(store, _HANDLE_ATTR, handle)
        _STORES[handle] = store
    return handle


def handle_of(store) -> int:
    """The handle :func:`register` gave ``store``; PaceError when it has none."""
    handle = getattr(store, _HANDLE_ATTR, None)
    if handle is None:
        raise PaceError("state store: not registered for the compiled path; allowed: a store attached to a cache "
                        "by pace_core.model.patch (a forward with a cache)")
    return handle


@torch.library.custom_op("pace::gdn_state", mutates_args=())
def gdn_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              store: int, layer: int, decode: bool) -> torch.Tensor:
    """One core call of GDN layer ``layer`` on the store of handle ``store`` (module docstring)."""
    found = _STORES.get(store)
    if found is None:
        raise PaceError(f"state store {store}: no longer exists; allowed: the handle of a live store")
    return found.run(layer, q, k, v, g, beta, decode)


@gdn_state.register_fake
def _(q, k, v, g, beta, store, layer, decode):
    return v.new_empty(v.shape, dtype=torch.float32)
