import math

import pytest
import torch
from numerics import fp32_bound

from pace_core.analysis import quality
from pace_core.analysis.quality import (
    MOST_WINDOWS_PER_BATCH,
    WINDOW_COLUMNS,
    batched_windows,
    evaluate_quality,
    perplexity,
    prompt_tokens,
    quality_run,
    scored_bytes,
    sliding_windows,
    window_sums,
    windows_per_batch,
)
from pace_core.analysis.text import tokenize
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import Calibrated
from pace_core.model.loading import load_model
from pace_core.model.teacher import DECODE_CHUNK

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


def _plain_transformers_ppl(model, ids, window, stride):
    """The transformers documentation's sliding-window loop (labels masked with -100)."""
    nlls, n_tokens, prev_end = [], 0, 0
    T = ids.shape[1]
    for begin in range(0, T, stride):
        end = min(begin + window, T)
        trg_len = end - prev_end
        chunk = ids[:, begin:end]
        labels = chunk.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(chunk, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        nlls.append(loss.double() * n)
        n_tokens += n
        prev_end = end
        if end == T:
            break
    return math.exp(float(torch.stack(nlls).sum()) / n_tokens), n_tokens


def test_windows_score_every_token_once():
    for T, w, s in [(10, 4, 2), (7, 10, 3), (50, 16, 5), (9, 4, 4)]:
        scored = [t for win in sliding_windows(T, w, s) for t in range(win.first_target, win.end)]
        # overlapping windows score every token after the first once; with stride == window a
        # window's first token has no context and is not scored (as in the transformers recipe)
        skipped = set(range(s, T, s)) if s == w else set()
        assert scored == [t for t in range(1, T) if t not in skipped]
        assert all(win.end - win.begin <= w for win in sliding_windows(T, w, s))
    with pytest.raises(PaceError, match="stride"):
        sliding_windows(10, 4, 5)
    with pytest.raises(PaceError, match="window"):
        sliding_windows(10, 1, 1)


def test_reference_perplexity_equals_plain_transformers(loaded, tmp_path):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    text = "".join(chr(c) for c in torch.randint(32, 127, (150,), generator=g).tolist())
    path = tmp_path / "t.txt"
    path.write_text(text)
    table = perplexity(loaded, [get_config("fp32")], path, window=48, stride=20)
    ids = tokenize(loaded.tokenizer, text)
    want, n = _plain_transformers_ppl(loaded.model, ids, 48, 20)
    row = table.iloc[0]
    assert row.config == "fp32" and row.tokens == n == ids.shape[1] - 1
    assert row.ppl == pytest.approx(want, rel=1e-5)
    assert row.agreement == 1.0 and row.kl == 0.0
    # character tokenizer: one byte per scored token
    assert scored_bytes(loaded.tokenizer, ids, sliding_windows(ids.shape[1], 48, 20)) == n
    assert scored_bytes(loaded.tokenizer, ids, sliding_windows(ids.shape[1], 20, 20)) == n - (n // 20)
    assert row.bpb == pytest.approx(math.log(want) / math.log(2), rel=1e-5)


def test_quantised_configs_move_away_from_reference(loaded):
    ids = torch.randint(3, 100, (1, 96))
    cfgs = [get_config("rtn-int8"), get_config("rtn-int2")]
    table = evaluate_quality(loaded, cfgs, ids, window=64, stride=32, decode_from=40).set_index("config")
    assert list(table.index) == ["fp32", "rtn-int8", "rtn-int2"]
    assert table.loc["rtn-int2", "kl"] > table.loc["rtn-int8", "kl"] > 0
    assert table.loc["rtn-int2", "agreement"] <= table.loc["rtn-int8", "agreement"] <= 1
    # the reference row is unaffected by what else is evaluated: alone it runs as a batch of one, not of
    # three, so its GEMMs may sum in another order. Per layer of the tiny model (4 layers) the 64-wide
    # projections, the GDN state over a 64-token window of 64-wide keys, 4 value heads of 32, the MLP (64 +
    # 96); then the LM head (64) and the log-softmax over 128 tokens (tests/numerics.py)
    alone = evaluate_quality(loaded, [get_config("fp32")], ids, window=64, stride=32, decode_from=40)
    bound = fp32_bound(4 * (64 + 64 * 64 + 4 * 32 + 64 + 96) + 64 + 128)
    assert alone.iloc[0].nll == pytest.approx(table.loc["fp32", "nll"], rel=bound)


def test_each_window_holds_its_own_figures(loaded):
    """The per-window sums are those of the window run by itself (the reference's and the configuration's logits
    from run_with_states), and add up to the totals."""
    from pace_core.model.capture import run_with_states

    ids = torch.randint(3, 100, (1, 100))
    cfg = get_config("rtn-int4")
    run = quality_run(loaded, [cfg], ids, window=40, stride=20, decode_from=20)
    windows = sliding_windows(100, 40, 20)
    table, w = run.table.set_index("config"), run.windows
    assert list(w.columns) == list(WINDOW_COLUMNS) and len(w) == 2 * len(windows)
    for name in ("fp32", "rtn-int4"):
        mine = w[w.config == name]
        assert list(mine.window) == list(range(len(windows))) and mine.tokens.sum() == table.loc[name, "tokens"]
        # the same terms summed in another order (float64)
        assert mine.nll.sum() / mine.tokens.sum() == pytest.approx(table.loc[name, "nll"], rel=1e-12)
        assert mine.kl.sum() / mine.tokens.sum() == pytest.approx(table.loc[name, "kl"], rel=1e-9, abs=1e-15)
        assert mine.agreed.sum() / mine.tokens.sum() == pytest.approx(table.loc[name, "agreement"], rel=1e-12)
    for j, win in enumerate(windows):
        chunk = ids[:, win.begin:win.end]
        d = prompt_tokens(20, chunk.shape[1])
        ref, got = (run_with_states(loaded, c, chunk, decode_from=d).logits[0].double().log_softmax(-1)
                    for c in (get_config("fp32"), cfg))
        at = slice(win.first_target - win.begin - 1, win.end - win.begin - 1)  # positions predicting the targets
        targets = chunk[0, win.first_target - win.begin:]
        row = w[(w.config == "rtn-int4") & (w.window == j)].iloc[0]
        assert row.begin == win.begin and row.end == win.end and row.tokens == len(targets)
        # one member per run here, two together there: the GEMMs may sum in another order (see the reference
        # row's bound above), which can move a 4-bit rounding boundary of this random-init model: the NLL within
        # test_batched_windows_score_as_one_by_one's 1e-3; the KL, a difference of two such runs, 10x that
        # (measured over 5 seeds: 5e-5 and 5e-4)
        assert row.nll == pytest.approx(float(-got[at].gather(1, targets[:, None]).sum()), rel=1e-3)
        assert row.kl == pytest.approx(float((ref[at].exp() * (ref[at] - got[at])).sum()), rel=1e-2)
        assert abs(row.agreed - int((got[at].argmax(-1) == ref[at].argmax(-1)).sum())) <= 1


@pytest.mark.parametrize("first", [0, 5, 11])
@pytest.mark.parametrize("slice_windows", [1, 2, 8])
def test_window_sums_are_each_window_and_member_reduced_alone(monkeypatch, first, slice_windows):
    """The reduction of a forward's logits, all windows and members at once (in slices of ``slice_windows``
    windows), against the spec's formulas applied to one member's window at a time (float64; the same terms, each
    sum over a window's tokens taken in another grouping: 1e-12 relative)."""
    g = torch.Generator().manual_seed(7)
    M, N, W, t, vocab = 3, 5, 16, 6, 11
    logits = torch.randn(M * N, t, vocab, generator=g)
    logits[N:2 * N] = logits[:N] + 0.05 * torch.randn(N, t, vocab, generator=g)  # a member near the reference
    ids = torch.randint(0, vocab, (N, W), generator=g)
    first_scored = [1, 9, 9, 9, 12]  # the text's first window, then windows whose first target is later
    monkeypatch.setattr(quality, "REDUCE_BYTES", slice_windows * t * vocab * 8)
    got = window_sums(logits, first, ids, first_scored)
    for m in range(M):
        for i, f in enumerate(first_scored):
            lo, hi = max(f - 1, first), min(W - 1, first + t)
            want = torch.zeros(3, dtype=torch.float64)
            if lo < hi:
                ref = logits[i, lo - first:hi - first].double().log_softmax(-1)
                logp = logits[m * N + i, lo - first:hi - first].double().log_softmax(-1)
                targets = ids[i, lo + 1:hi + 1]
                want = torch.stack([-logp[torch.arange(hi - lo), targets].sum(),
                                    (logp.argmax(-1) == ref.argmax(-1)).sum().double(),
                                    (ref.exp() * (ref - logp)).sum()])
            assert got[m, i].tolist() == pytest.approx(want.tolist(), rel=1e-12, abs=1e-15)
    assert (got[0, :, 2].abs() < 1e-15).all() and (got[0, :, 1] == got[0, :, 1].round()).all()
    assert got[1, :, 2].sum() > 0 and got[2, :, 2].sum() > got[1, :, 2].sum()  # the near member is nearer


def test_batched_windows_group_equal_lengths_in_order():
    windows = sliding_windows(100, 32, 16)
    groups = batched_windows(windows, 3)
    assert [w for g in groups for w in g] == windows
    assert all(len(g) <= 3 and len({w.end - w.begin for w in g}) == 1 for g in groups)
    assert [len(g) for g in groups] == [3, 2, 1]  # five full windows, then the short last one
    with pytest.raises(PaceError, match="batch"):
        batched_windows(windows, 0)


def _on_gpus(loaded, first: int, last: int, dtype: torch.dtype = torch.float32):
    """``loaded`` as if placed on GPUs: input embeddings on ``cuda:first``, output embeddings on
    ``cuda:last`` (a stand-in model with the real config; no GPU needed to size a batch)."""
    from types import SimpleNamespace

    head = SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda", last)))
    model = SimpleNamespace(config=loaded.model.config, get_output_embeddings=lambda: head)
    return type(loaded)(**{**vars(loaded), "model": model, "device": torch.device("cuda", first), "dtype": dtype})


def test_default_batch_is_one_on_the_cpu_and_what_half_the_free_gpu_memory_holds(loaded, monkeypatch):
    assert windows_per_batch(loaded, 9, 1024, 512) == 1
    vocab = loaded.model.config.get_text_config(decoder=True).vocab_size
    for dtype, item in ((torch.float32, 4), (torch.bfloat16, 6)):  # fp32 logits, plus the bf16 ones they come from
        gpu = _on_gpus(loaded, 0, 0, dtype)
        per_window = 9 * 512 * vocab * item  # 9 members x max(prompt 512, decode chunk) positions
        for windows in (1, 3, 7):
            free = 2 * windows * per_window + per_window  # half of it holds `windows` and a half window
            monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
            assert windows_per_batch(gpu, 9, 1024, 512) == windows
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1, 2))
        assert windows_per_batch(gpu, 9, 1024, 512) == 1  # never fewer than one
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 50, 1 << 51))
        assert windows_per_batch(gpu, 9, 1024, 512) == MOST_WINDOWS_PER_BATCH
        prompt = DECODE_CHUNK // 2  # the decode chunk is the larger forward
        per_chunk = 9 * DECODE_CHUNK * vocab * item
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda device, per_chunk=per_chunk: (2 * 5 * per_chunk, 1 << 51)
        )
        assert windows_per_batch(gpu, 9, 1024, prompt) == 5


def test_default_batch_counts_the_free_memory_of_the_gpu_the_logits_are_on(loaded, monkeypatch):
    """Under device_map the logits appear on the output embeddings' GPU (the last), not the first."""
    spread = _on_gpus(loaded, 0, 1)
    assert spread.output_device == torch.device("cuda", 1)
    vocab = loaded.model.config.get_text_config(decoder=True).vocab_size
    per_window = 9 * 512 * vocab * 4
    free = {0: 1 << 50, 1: 2 * 3 * per_window}  # the first GPU nearly empty, the last holding 3 windows' logits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[torch.device(device).index], 1 << 51))
    assert windows_per_batch(spread, 9, 1024, 512) == 3
    assert loaded.output_device == loaded.device  # one device: the same


def test_batched_windows_score_as_one_by_one(loaded):
    ids = torch.randint(3, 100, (1, 120))
    heads = tuple((int(torch.randint(0, loaded.shape.num_v_heads, ())),) for _ in range(loaded.shape.num_gdn_layers))
    cfgs = [get_config(n) for n in ("pace-4", "rtn-int4", "qmamba-dsq")] + [
        get_config("pace-4-8").replace(high_heads=heads)
    ]
    one = evaluate_quality(loaded, cfgs, ids, window=40, stride=20, decode_from=20).set_index("config")
    many = evaluate_quality(loaded, cfgs, ids, window=40, stride=20, decode_from=20, batch=4).set_index("config")
    assert list(many.index) == list(one.index) and (many.tokens == one.tokens).all()
    # the reference is unquantised: only the summation order of batched matmuls differs
    assert many.loc["fp32", "nll"] == pytest.approx(one.loc["fp32", "nll"], rel=1e-6)
    # quantised states: that order can move a rounding boundary, which this random-init model
    # (tiny states, coarse fp16-floored scales) amplifies; a window scored against another
    # window's state or targets would be off by far more
    assert many.nll.to_numpy() == pytest.approx(one.nll.to_numpy(), rel=1e-3)
    assert many.agreement.to_numpy() == pytest.approx(one.agreement.to_numpy(), abs=0.02)


def test_bad_text(loaded, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(PaceError, match="empty"):
        perplexity(loaded, [get_config("fp32")], empty)
    with pytest.raises(PaceError, match="does not exist"):
        perplexity(loaded, [get_config("fp32")], tmp_path / "missing.txt")


def test_damp_quality_runs_with_the_given_outlier_rows(loaded):
    from pace_core.model.capture import run_with_states

    cfg = get_config("damp-int4")
    shape = loaded.shape
    rows = [torch.stack([torch.randperm(shape.d_k)[:cfg.damp_outlier_rows].sort().values
                         for _ in range(shape.num_v_heads)]) for _ in range(shape.num_gdn_layers)]
    ids = torch.randint(3, 100, (1, 48))
    calibrated = cfg.replace(calibrated=Calibrated([{"rows": r.to(torch.int16)} for r in rows]))
    table = evaluate_quality(loaded, {"damp": calibrated}, ids, window=48, stride=24, decode_from=24).set_index(
        "config"
    )
    # one window: the damp row's NLL is that of the same run made directly
    logits = run_with_states(loaded, calibrated, ids, decode_from=24).logits[0, :-1].double()
    want = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))
    assert table.loc["damp", "nll"] == pytest.approx(want, rel=1e-9)
    with pytest.raises(PaceError, match="not calibrated"):
        evaluate_quality(loaded, {"damp": cfg}, ids, window=48, stride=24, decode_from=24)
