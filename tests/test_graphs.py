"""The analyses' decode calls as CUDA graphs (pace_core.graphs) and the checks they defer (pace_core.deferred).

On the CPU: every check that reads the device records its failure instead while checks are deferred (and raises as
before otherwise); a store stack's host state round-trips; a run whose graphs report a failed check is run again
without them. With ``PACE_KERNEL_TESTS=cuda`` (the GPU check): a teacher-forced quality run through recorded graphs
is the run without them bit for bit (the same kernels on the same inputs: a replay runs what was recorded), every
GDN layer's call recorded once and replayed for the later batches.
"""

from __future__ import annotations

import math
import traceback
import warnings

import pytest
import torch
from kernels_support import DEVICE, ON_GPU, kernel_modules
from torch.overrides import TorchFunctionMode

from pace_core import deferred
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.quant import QuantSpec, all_finite, check_finite, quantize


def _recorded(run) -> list[bool]:
    with deferred.deferring() as failures:
        run()
    return [bool(f.any()) for f in failures]


def test_checks_record_their_failures_while_deferred():
    spec = QuantSpec(4, True, "key", 4)
    fine = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(0), device="cpu")
    huge = fine.clone()
    huge[1, 2, 5, 3] = 1e9  # a group's scale 1e9 / 7 > 65504
    nan = fine.clone()
    nan[0, 1, 2, 0] = math.nan
    assert not deferred.active()
    assert _recorded(lambda: quantize(fine, spec)) == [False, False]  # finiteness, scale range
    assert _recorded(lambda: quantize(huge, spec)) == [False, True]
    assert _recorded(lambda: check_finite(nan, "S"))[0]
    with deferred.deferring() as failures:
        assert deferred.active() and all_finite(nan)  # recorded, not read
    assert len(failures) == 1 and bool(failures[0])
    with pytest.raises(PaceError, match="fp16 scale overflows"):
        quantize(huge, spec, name="state")
    with pytest.raises(PaceError, match="non-finite"):
        check_finite(nan, "S")


def test_the_kernels_state_check_records_while_deferred():
    quantize_kernels = kernel_modules()["quantize"]
    spec = QuantSpec(4, True, "key", 4)
    S = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    S[0, 1, 3, 2] = 1e9
    assert _recorded(lambda: quantize_kernels._check_values(S, spec, [4, 4], "S")) == [True]
    assert _recorded(lambda: quantize_kernels._check_values(S / 1e9, spec, [4, 4], "S")) == [False]
    with pytest.raises(PaceError, match="overflows"):
        quantize_kernels._check_values(S, spec, [4, 4], "S")


@pytest.fixture(scope="module")
def embedded():
    from pace_core.model import DEFAULT_MODEL_DIR
    from pace_core.model.loading import load_model

    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        pytest.skip("no embedded model")
    return load_model(None, device=DEVICE)


def test_a_stacks_host_state_round_trips(embedded):
    from pace_core.model.patch import new_stack

    stack = new_stack(embedded.model, [get_config("fp32"), get_config("pace-4"), get_config("rtn-int4")], 2,
                      device=DEVICE, graphs=False)
    layer = stack.layers[0]
    assert stack._host_state(layer) == (0, 0, 0)
    stack._set_host_state(layer, (0, 5, 0))
    assert stack._host_state(layer) == (0, 5, 0)
    assert len(stack.stores[1].layer(layer).buffer) == 5
    with pytest.raises(PaceError, match="0..8"):
        stack._set_host_state(layer, (0, 9, 0))


class _FailingGraphs:
    """Runs every call as it is and reports a failed deferred check, as a replay whose state overflowed does."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, key, call, inputs, host_state, set_host_state, generators=tuple):
        self.calls += 1
        return call(*inputs)

    def check(self) -> bool:
        return True


def test_a_run_whose_graphs_failed_a_check_runs_again_without_them(embedded, monkeypatch):
    """The rerun without graphs passes its checks here (nothing overflows), so the disagreement itself is the
    error; where the state does fail, the rerun raises that failure's own error before (GPU test below)."""
    from pace_core.analysis.text import TEST_TEXT, read_text, tokenize
    from pace_core.model import patch, teacher

    graphs = _FailingGraphs()
    made = []

    def with_graphs(model, configs, rows, *, device=None, **kw):
        stack = original(model, configs, rows, device=device, graphs=False)
        if kw.get("graphs", True):
            stack.graphs = graphs
        made.append(stack)
        return stack

    original = patch.new_stack
    monkeypatch.setattr(teacher, "new_stack", with_graphs)
    ids = tokenize(embedded.tokenizer, read_text(TEST_TEXT), 24).to(DEVICE)
    members = [teacher.Member("fp32", get_config("fp32")), teacher.Member("pace-4", get_config("pace-4"))]
    with pytest.raises(PaceError, match="passed when the run was repeated without them"):
        teacher.teacher_forced(embedded, members, ids, 8, decode_chunk=8)
    assert graphs.calls > 0
    assert len(made) == 2 and made[1].graphs is None


def test_a_refused_capture_warns_once_and_runs_every_later_call_as_it_is(monkeypatch):
    """A capture that fails (here every capture: the CPU stands in for the device) is said once, with its reason,
    its allocation to the graphs' memory pool is ended, and every later call, of its key or another, runs as it
    is."""
    from pace_core.graphs import DecodeGraphs

    class _Refusing:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    released = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Refusing)
    monkeypatch.setattr(torch.cuda, "graph", _Refusing)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda *args: released.append(args), raising=False)
    graphs, calls = DecodeGraphs(torch.device("cpu")), []
    x = torch.arange(4.0)

    def run(key):
        return graphs.run(key, lambda t: calls.append(key) or t * 2, [x], lambda: 0, lambda state: None)

    assert torch.equal(run("a"), x * 2)  # first seen: run as it is
    with pytest.warns(RuntimeWarning, match="could not be recorded as a CUDA graph.*not permitted"):
        assert torch.equal(run("a"), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run("a"), x * 2) and torch.equal(run("b"), x * 2) and torch.equal(run("b"), x * 2)
    assert calls == ["a", "a", "a", "b", "b"] and set(graphs.refused) == {"a", "b"}
    assert "not permitted" in graphs.broken and released == [(0, "pool")]  # the failed capture's pool ended once


class _HostReads(TorchFunctionMode):
    """Counts the calls that a CUDA graph's capture cannot hold: a read of a tensor's values on the host (it waits
    for the device) and a tensor made from host data (a host-to-device copy that waits too). On the GPU either
    stops the capture, and every later capture with the same memory pool then fails as well."""

    READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "unique", "unique_consecutive", "masked_select", "equal", "tensor", "as_tensor", "from_numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "pace_core" in f.filename or "kernels" in f.filename]
            self.seen.setdefault(name, "".join(traceback.format_list(frames[-3:])))
        return func(*args, **(kwargs or {}))


def test_a_recordable_call_reads_nothing_on_the_host(embedded, monkeypatch):
    """Every named configuration (stochastic rounding and static scales included), in one stack: the
    teacher-forced calls a :class:`~pace_core.graphs.DecodeGraphs` would record (a key's second call and later: its
    first runs as it is, filling the kept head maps and plans) hold no host read while checks are deferred (the
    H100 of 2026-12-06 refused every capture after a reference dequantisation's ``torch.tensor`` of a number; the
    same day's second run found the kernels reading back the head map of PACE-4/8's pooled checkpoints:
    ``tests/test_kernels_quantize.py`` keeps that one on the CPU)."""
    from pace_core.analysis.calibration import calibrate
    from pace_core.analysis.quality import perplexity
    from pace_core.analysis.text import CALIBRATION_TEXT, TEST_TEXT
    from pace_core.config import NAMED_CONFIGS
    from pace_core.state_store import StoreStack

    cfgs = [get_config(n) for n in NAMED_CONFIGS]
    cfgs = [calibrate(embedded, c, str(CALIBRATION_TEXT), tokens=64, sample_every=16).config
            if c.needs_calibration else c for c in cfgs]
    modes, seen_keys, run = [], set(), StoreStack._run

    def watched(self, layer, decode, *inputs):
        key = self.graph_key(layer, inputs[0])
        if not (self.teacher_forcing and inputs[0].shape[1] > 0) or key not in seen_keys:
            seen_keys.add(key)
            return run(self, layer, decode, *inputs)
        modes.append(_HostReads())
        with deferred.deferring(), modes[-1]:
            return run(self, layer, decode, *inputs)

    monkeypatch.setattr(StoreStack, "_run", watched)
    perplexity(embedded, cfgs, TEST_TEXT, window=48, stride=16, max_tokens=80, decode_from=32)
    assert len(cfgs) >= 15 and len(modes) >= len(embedded.gdn_layers)
    seen = {name: where for mode in modes for name, where in mode.seen.items()}
    assert not seen, "\n".join(f"{name} at\n{where}" for name, where in seen.items())


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: the GPU check (PACE_KERNEL_TESTS=cuda)")
@pytest.mark.parametrize("names", [("bf16", "pace-4", "rtn-int4", "qmamba-dsq"), ("pace-4-8", "damp-int8"),
                                   ("pace-4-sr", "pace-4-static")])
def test_graphed_quality_is_the_run_without_graphs(embedded, monkeypatch, names):
    from pace_core.analysis.calibration import calibrate
    from pace_core.analysis.quality import perplexity
    from pace_core.analysis.text import CALIBRATION_TEXT, TEST_TEXT
    from pace_core.graphs import GRAPHS_ENV, DecodeGraphs

    cfgs = [calibrate(embedded, get_config(n), str(CALIBRATION_TEXT), tokens=256, sample_every=32).config
            if get_config(n).needs_calibration else get_config(n) for n in names]

    def run():
        return perplexity(embedded, cfgs, TEST_TEXT, window=256, stride=128, max_tokens=256 + 128 * 15, batch=4,
                          decode_from=128)

    recorded, refused = [], {}
    record = DecodeGraphs._record

    def counted(self, key, *args):
        recorded.append((key, record(self, key, *args)))
        refused.update(self.refused)  # why a call could not be recorded, for the failure message
        return recorded[-1][1]

    monkeypatch.setattr(DecodeGraphs, "_record", counted)
    monkeypatch.setenv(GRAPHS_ENV, "off")
    plain = run()
    assert not recorded
    monkeypatch.setenv(GRAPHS_ENV, "auto")
    graphed = run()
    assert plain.equals(graphed), f"{plain}\n{graphed}"
    # 4 batches of 4 windows, 2 decode chunks of 64 each starting where every buffer is empty (128 and 192 are
    # multiples of each dP): one key per layer, seen in the first chunk, recorded in the second, replayed after
    assert len(recorded) == len(embedded.gdn_layers) and all(r is not None for _, r in recorded), "\n".join(
        [f"recorded keys: {[key for key, _ in recorded]}", *(f"refused {k}: {why}" for k, why in refused.items())])
