"""kernels/bench_e2e.py: the end-to-end TPOT harness, run small on the CPU (its numbers come from the
GPU machine), and the model it builds there."""

from __future__ import annotations

import json
import math

import pytest
import torch
from numerics import assert_same_greedy, fp32_bound
from transformers import DynamicCache

from kernels.bench import bench_e2e
from pace_core.config import get_config
from pace_core.model.patch import get_state_store, pace
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


def test_compiled_run_writes_its_own_table_with_compile_times(tmp_path):
    """``--compile`` (AOT autograd here: no C++ compiler needed) times the same rows through torch.compile
    into bench_e2e_compiled.json, each row with the time of its first, compiling step."""
    out = tmp_path / "e2e"
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--batches", "2", "--context", "8", "--tokens", "8",
                           "--compile", "--compile-backend", "aot_eager", "--out", str(out)]) == 0
    results = json.loads((out / "bench_e2e_compiled.json").read_text())
    assert results["mode"] == "torch.compile + eager" and results["compile_backend"] == "aot_eager"
    assert not (out / "bench_e2e.json").exists()
    for r in results["rows"]:
        assert r["mode"] == "torch.compile + eager" and r["outputs_finite"]
        assert r["compile_s"] > r["tpot_median_s"] > 0


def test_state_kernel_names_are_the_kernels_of_the_package():
    names = bench_e2e.state_kernel_names()
    assert {"_quant_kernel", "_dequant_kernel"} <= names
    assert not any(n.startswith("triton_") for n in names)  # inductor's generated kernels are not the state's


TINY_TOL = fp32_bound(4 * (128 + 22 * 64 + 4 * 32 + 128 + 256) + 128)
"""The harness's tiny model over 10 + 12 tokens, two code paths of one function: per layer the 128-wide
projections, the GDN state over 22 tokens of 64-wide keys, 4 value heads of 32, the MLP (128 + 256); 4
layers, then the 128-wide LM head (tests/numerics.py)."""
UNROUNDED = {"bf16": get_config("fp32"),
             "pace-4": get_config("fp32").replace(name="fp32-buffered", decode_period=8, buffer="fp32")}
"""The variants' structure with the rounding off (per token; a dP = 8 buffer with its flush): a state
rounding after two paths of float32 arithmetic could flip a code, which float32 bounds cannot cover."""


@pytest.mark.parametrize("config_name", list(bench_e2e.VARIANTS.values()))
def test_static_cache_step_matches_transformers_decode(config_name):
    """The harness's step (static cache, its decode attention, next token fed back in place: what the
    CUDA graphs capture) decodes what transformers' own loop decodes (dynamic cache, SDPA), with each
    variant's state structure: the same greedy tokens and logits to float32 rounding."""
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (3, 10))
    steps = 12  # one flush of dP = 8 and records after it
    with torch.no_grad(), pace(model, UNROUNDED[config_name]):
        decoder = bench_e2e._Decoder(model, ids, bench_e2e.cache_length(10, steps))
        static = torch.stack([decoder.step()[:, -1] for _ in range(steps)])
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        dynamic = []
        for _ in range(steps):
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
            nxt = logits[:, -1:].argmax(-1)
            dynamic.append(logits[:, -1])
    dynamic = torch.stack(dynamic)
    assert static.shape == (steps, 3, model.config.vocab_size)
    assert_same_greedy(static.argmax(-1).T, dynamic.argmax(-1).T, static, dynamic, TINY_TOL)


def test_cache_length_is_aligned_and_the_same_for_every_variant():
    assert bench_e2e.cache_length(512, 32) == 576  # 512 + 16 warm-up + 2 x 8 + 32
    assert bench_e2e.cache_length(512, 8) == 576 and bench_e2e.cache_length(10, 12) == 64


class _ReplayByStep:
    """A stand-in for a captured graph on a CPU: ``replay()`` runs the step into fixed logits, then
    ``after`` (a fault to inject, or None)."""

    def __init__(self, step, logits: torch.Tensor, after=None) -> None:
        self.step, self.logits, self.after = step, logits, after

    def replay(self) -> None:
        self.logits.copy_(self.step())
        if self.after is not None:
            self.after()


def test_graph_check_compares_logits_tokens_and_the_whole_state(monkeypatch):
    """:func:`_check_graphs` with replays that redo the eager steps finds no difference: the snapshot
    puts the whole state back (on the kernel path, interpreted here, which updates it in place as
    graphs need). A fault after the period's flush, one bit of a stored checkpoint, leaves every
    logit and token equal and is found in the state."""
    from kernels_support import kernel_modules

    kernel_modules()
    monkeypatch.setenv("PACE_KERNELS", "triton")
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    period = 4
    with torch.no_grad(), pace(model, get_config("pace-4").replace(decode_period=period)):
        decoder = bench_e2e._Decoder(model, ids, 32)
        store = get_state_store(decoder.cache)
        codes = store.layer(store.layers[-1]).checkpoint.codes

        def flip() -> None:
            codes.view(-1)[0] ^= 1

        graphs = [_ReplayByStep(decoder.step, torch.empty(1, 1, model.config.vocab_size)) for _ in range(period)]
        faithful = [(g, g.logits) for g in graphs]
        clean = bench_e2e._check_graphs(decoder, faithful)
        faulty = faithful[:-1] + [(_ReplayByStep(decoder.step, graphs[-1].logits, after=flip), graphs[-1].logits)]
        found = bench_e2e._check_graphs(decoder, faulty)
    assert clean == {"graph_vs_eager_max_abs_logit": 0.0, "graph_vs_eager_token_mismatches": 0,
                     "graph_vs_eager_state_tensors_differing": 0}
    assert found == {"graph_vs_eager_max_abs_logit": 0.0, "graph_vs_eager_token_mismatches": 0,
                     "graph_vs_eager_state_tensors_differing": 1}


def test_gqa_decode_attention_hands_prompts_to_causal_sdpa():
    """More than one query token (a prompt) gets transformers' SDPA: causal attention over repeated
    heads, checked against float64."""
    model = bench_e2e.build_model(True, torch.device("cpu"), torch.float32)
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    B, T, D = 2, 5, attn.head_dim
    H, KVH = model.config.num_attention_heads, model.config.num_key_value_heads
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KVH, T, D), torch.randn(B, KVH, T, D)
    out, _ = bench_e2e.gqa_decode_attention(attn, q, k, v, None, scaling=D ** -0.5)
    kr, vr = (x.double().repeat_interleave(H // KVH, dim=1) for x in (k, v))
    scores = (q.double() @ kr.transpose(-1, -2) * D ** -0.5).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out.double(), (scores.softmax(-1) @ vr).transpose(1, 2), rtol=1e-5, atol=1e-6)


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
