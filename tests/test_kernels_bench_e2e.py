"""kernels/bench_e2e.py: the end-to-end TPOT harness, run small on the CPU (its numbers come from the
GPU machine), and the model it builds there."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from kernels import bench_e2e
from pace_core.config import get_config
from pace_core.model.patch import pace
from pace_core.shapes import BUILTIN_SHAPES, shape_from_hf_config


def test_full_model_is_qwen35_4b_sized():
    shape = shape_from_hf_config(bench_e2e.model_config(tiny=False))
    want = BUILTIN_SHAPES["qwen3.5-4b"]
    for field in ("num_layers", "num_gdn_layers", "num_k_heads", "num_v_heads", "d_k", "d_v", "weight_params"):
        assert getattr(shape, field) == getattr(want, field), field


def test_tiny_run_writes_every_variant_and_batch(tmp_path, capsys):
    out = tmp_path / "e2e"
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--batches", "1,3", "--context", "12", "--tokens", "8",
                           "--out", str(out)]) == 0
    rows = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for b in (1, 3) for v in bench_e2e.VARIANTS]
    for r in rows:
        assert r["mode"] == "eager" and "graph_vs_eager_token_mismatches" not in r  # no CUDA graphs on a CPU
        assert r["outputs_finite"] and r["tokens"] == 8 and 0 < r["spread"][0] <= r["tpot_median_s"] <= r["spread"][1]
        assert math.isclose(r["speedup_vs_bf16_per_token"],
                            next(x for x in rows if x["batch"] == r["batch"] and x["config"] == "bf16")["tpot_mean_s"]
                            / r["tpot_mean_s"])
    assert "PACE-4 vs bf16" in capsys.readouterr().out
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--tokens", "12", "--out", str(out)]) == 2


def test_profile_writes_tables_and_host_counts(tmp_path):
    out = tmp_path / "e2e"
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--batches", "2", "--context", "8", "--tokens", "8",
                           "--profile", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(bench_e2e.VARIANTS)
    tables = (out / "profile.txt").read_text()
    for r in rows:
        assert r["profiled_tpot_s"] > 0 and r["aten_calls_per_step"] > 10 and r["launches_per_step"] == 0  # CPU
        assert "gpu_busy_time_per_token_s" not in r  # no GPU, no busy time
        assert f"=== {r['variant']}, batch 2" in tables
    assert tables.count("Self CPU time total") == len(rows)


@pytest.mark.parametrize("config_name", list(bench_e2e.VARIANTS.values()))
def test_static_cache_step_matches_dynamic_cache_decode(config_name):
    """The harness's step (static cache, next token fed back in place: what the CUDA graphs capture)
    decodes what transformers' own dynamic-cache loop decodes, under each variant's PACE state."""
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (3, 10))
    steps = 12  # one flush of PACE-4 (dP = 8) and records after it
    with torch.no_grad(), pace(model, get_config(config_name)):
        decoder = bench_e2e._Decoder(model, ids, 10 + steps)
        static = torch.stack([decoder.step()[:, -1] for _ in range(steps)])
        cache = DynamicCache(config=model.config)
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        dynamic = []
        for _ in range(steps):
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
            nxt = logits[:, -1:].argmax(-1)
            dynamic.append(logits[:, -1])
    dynamic = torch.stack(dynamic)
    assert static.shape == (steps, 3, model.config.vocab_size)
    assert torch.equal(static.argmax(-1), dynamic.argmax(-1))
    # float32 rounding differs (the attention runs over the padded static length): 1.5e-7 for both on this
    # seeded model; the bound leaves room, short of the 1e-3 of one flipped code of a stored value
    error = float((static - dynamic).norm() / dynamic.norm())
    assert error < 1e-5


def test_snapshot_restores_the_whole_decoding_state(monkeypatch):
    """What the graph check relies on: after a restore the same steps give the same logits (a tensor
    of the state left out, e.g. the PACE checkpoint or buffer, would make them differ). On the kernel
    path (interpreted here), which updates the state in place as the graphs need."""
    from kernels_support import kernel_modules

    kernel_modules()
    monkeypatch.setenv("PACE_KERNELS", "triton")
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad(), pace(model, get_config("pace-4").replace(decode_period=4)):
        decoder = bench_e2e._Decoder(model, ids, 20)
        for _ in range(2):  # mid-period: 2 records buffered
            decoder.step()
        saved = decoder.snapshot()
        first = torch.stack([decoder.step()[:, -1] for _ in range(4)])  # through a flush
        moved = sum(not torch.equal(t, copy) for t, copy in saved)
        bench_e2e._restore(saved)  # one period later the buffer's host-side count is 2 again
        again = torch.stack([decoder.step()[:, -1] for _ in range(4)])
    kinds = {(t.dtype, t.dim()) for t, _ in saved}
    assert (torch.uint8, 4) in kinds and (torch.int64, 0) in kinds  # packed codes, the cache's length
    assert moved >= len(saved) // 2  # the steps changed most of the state, so the restore is tested
    assert torch.equal(first, again)


@pytest.mark.parametrize("masked", [False, True])
def test_gqa_decode_attention_matches_repeated_heads(masked):
    """The harness's decode attention against the plain float64 attention over repeated key / value
    heads (query head h reads key / value head h // 3 here), with and without a padding mask."""
    B, H, KVH, L, D = 3, 6, 2, 11, 16
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    mask = torch.rand(B, 1, 1, L) < 0.7 if masked else None
    if masked:
        mask[..., 0] = True  # every row attends somewhere
    out, weights = bench_e2e.gqa_decode_attention(None, q, k, v, mask, scaling=D ** -0.5)
    kr, vr = (x.double().repeat_interleave(H // KVH, dim=1) for x in (k, v))
    scores = q.double() @ kr.transpose(-1, -2) * D ** -0.5
    if masked:
        scores = scores.masked_fill(~mask, float("-inf"))
    want = (scores.softmax(-1) @ vr).transpose(1, 2)  # [B, 1, H, D]
    assert weights is None and out.shape == (B, 1, H, D)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
