"""pace_core/model/state_op.py: the GDN state as one torch.library operator, so torch.compile graphs hold
it (the end-to-end variant of kernels/bench/bench_e2e.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from numerics import assert_same_greedy, fp32_bound, rel

from kernels.bench import bench_e2e
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model import state_op
from pace_core.model.patch import get_state_store, pace
from pace_core.state_store import StateStore

STEPS = 10
"""Decode steps: one flush of dP = 8 and two records after it."""
TOL = fp32_bound(4 * (128 + 22 * 64 + 4 * 32 + 128 + 256) + 128)
"""The tiny model over 6 + 10 tokens through two code paths of one function (as test_kernels_bench_e2e's
TINY_TOL: per layer the projections, the GDN state, the MLP; 4 layers, then the LM head)."""
UNROUNDED = get_config("fp32").replace(name="fp32-buffered", decode_period=8, buffer="fp32")
"""PACE-4's structure with the rounding off (a dP = 8 buffer and its flush): a rounding after two float32 paths
could flip a code, which float32 bounds cannot cover, so the real variants are compared by structure only."""


def _recording_backend(graphs: list):
    """A torch.compile backend that keeps dynamo's graphs and compiles them with AOT autograd (eager
    kernels): the functionalisation inductor sees, without a C++ compiler."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.parametrize("name", ["unrounded", *bench_e2e.VARIANTS.values()])
def test_compiled_decode_holds_one_state_node_per_gdn_layer_and_decodes_as_eager(name):
    """fullgraph compilation (no graph break) of the harness's decode step, for the rounding-free buffered
    structure and both benchmark variants: the state is one ``pace::gdn_state`` node per GDN layer, whose
    schedule runs at every call (the buffer fills and flushes as in eager steps, from one graph). Without
    rounding, greedy tokens and logits equal eager steps' to float32 rounding, and so do the final states."""
    cfg = UNROUNDED if name == "unrounded" else get_config(name)
    torch._dynamo.reset()
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    graphs: list = []
    compiled = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True, dynamic=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad(), pace(model, cfg):
        eager = bench_e2e._Decoder(model, ids, 32)
        traced = bench_e2e._Decoder(model, ids, 32)
        traced.model = compiled
        want = torch.stack([eager.step()[:, -1] for _ in range(STEPS)])
        got = torch.stack([traced.step()[:, -1] for _ in range(STEPS)])
        stores = [get_state_store(d.cache) for d in (eager, traced)]
        states = [[s.effective_state(layer) for layer in s.layers] for s in stores]
    assert len(graphs) == 1
    nodes = [n for n in graphs[0].graph.nodes if "gdn_state" in str(n.target)]
    assert len(nodes) == len(stores[0].layers) == 3
    assert all(n.args[5] == state_op.handle_of(stores[1]) for n in nodes)
    if cfg.decode_period == 8:
        assert [len(stores[1].buffer(layer)) for layer in stores[1].layers] == [STEPS - 8] * 3
    assert torch.isfinite(got).all()
    if name != "unrounded":
        return
    assert_same_greedy(got.argmax(-1).T, want.argmax(-1).T, got, want, TOL)
    for a, b in zip(*states):
        assert rel(a, b) <= TOL


def test_handles_are_kept_by_their_store_and_refused_once_it_is_gone():
    store = StateStore(get_config("pace-4"), None, 1, "cpu", 2, 4, 64, 32, [0])
    handle = state_op.register(store)
    assert state_op.register(store) == handle == state_op.handle_of(store)
    other = StateStore(get_config("pace-4"), None, 1, "cpu", 2, 4, 64, 32, [0])
    with pytest.raises(PaceError, match="not registered"):
        state_op.handle_of(other)
    assert state_op.register(other) != handle
    q = k = torch.randn(1, 1, 2, 64)
    v, g, beta = torch.randn(1, 1, 4, 32), -torch.rand(1, 1, 4), torch.rand(1, 1, 4)
    o = torch.ops.pace.gdn_state(q, k, v, g, beta, handle, 0, True)
    assert o.shape == (1, 1, 4, 32) and o.dtype == torch.float32
    del store
    gc.collect()
    with pytest.raises(PaceError, match="no longer exists"):
        torch.ops.pace.gdn_state(q, k, v, g, beta, handle, 0, True)
