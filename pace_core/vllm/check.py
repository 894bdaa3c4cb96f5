"""Does vLLM with the plugin serve what the transformers path computes? The figures of the vLLM issue.

    python -m pace_core.vllm.check [--model data/models/pace-tiny-qwen35] [--configs vllm-own fp32 pace-4 FILE ...]
                                   [--prompts 10] [--tokens 64] [--out data/bench]

(in the vLLM environment: ``make vllm-env``). For each configuration, the same prompts (the first lines
of ``wikitext2-valid`` long enough, cut to ``PROMPT_TOKENS`` tokens) are decoded greedily ``--tokens``
steps by vLLM (bf16, all prompts submitted together: continuous batching) and by the project's
transformers path (the same checkpoint in bf16, ``pace_core.apply`` of the same configuration, one prompt
at a time). ``vllm-own`` is vLLM without the plugin's state against the fp32 reference. Reported per
configuration:

- ``free_running``: the share of the ``prompts x tokens`` positions where both chose the same token
  (after a first difference the two continue from different texts, so this counts that position's
  consequences too);
- ``teacher_forced``: vLLM's tokens fed to the transformers path (the prompt as a prefill, the rest
  through the decode path, a flush every dP: :func:`pace_core.model.teacher.teacher_forced`), the share
  of positions whose transformers greedy choice is vLLM's token: agreement token by token, from the same
  text;
- ``staggered``: the prompts submitted one by one, each after the previous has decoded ``--join-every``
  steps, with ``--tokens`` minus a per-prompt offset each (so sequences join and leave while others
  decode), their continuations teacher-forced through the transformers path one prompt at a time as
  above: a sequence served another's checkpoint, buffer or flush point would part from it.
  (Compared with the same prompts served alone by vLLM, free-running, they part at near ties as well:
  a batch of another size changes vLLM's bf16 arithmetic.)

Written to ``<out>/vllm_cpu.json`` with provenance. A measurement, not a test (tests/vllm_plugin uses it).

``--own-state CONFIG`` measures instead how closely the plugin follows vLLM's own arithmetic: vLLM with its own
state and vLLM with the plugin serving ``CONFIG`` (``fp32``: the plugin's unrounded path) decode the same prompts
greedily (all submitted together, top-2 log-probabilities kept), and each prompt whose tokens differ is
reported at its first differing step with vLLM's top-2 margin there and the largest change of a top-2 margin
between the two engines at the steps before it (same text): a difference is a near tie when that margin is
within that change, up to the rounding of the log-probabilities (:data:`TIE_SLACK`; :func:`own_state_agreement`).
Written to ``<out>/vllm_cpu_own.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pace_core.config import get_config, tagged

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = REPO_ROOT / "data" / "models" / "pace-tiny-qwen35"
SHIPPED_RESULTS = REPO_ROOT / "data" / "results" / "pace-tiny-qwen35"
"""The embedded model's shipped results, with the exports of its calibrated configurations."""
PROMPT_TOKENS = 24
VLLM_OWN = "vllm-own"
"""The configuration name that runs vLLM without the plugin's state (its own fp32 state), compared with the
transformers path's fp32 reference: how far two bf16 engines part without PACE."""
MAX_MODEL_LEN = 512


SHIPPED = REPO_ROOT / "data" / "bench" / "vllm_cpu.json"
"""The figures this project measured (``python -m pace_core.vllm.check``), shown on the Export page."""


@dataclass(frozen=True)
class Agreement:
    """Shares of equal greedy tokens (module docstring) for one configuration."""

    config: str
    free_running: float
    teacher_forced: float
    staggered: float | None


@dataclass(frozen=True)
class Measured:
    """A ``vllm_cpu.json``: its :class:`Agreement` rows and how many prompts and greedy steps they count."""

    rows: list[Agreement]
    prompts: int
    tokens: int


def shipped(path: Path = SHIPPED) -> Measured | None:
    """The measured figures of a ``vllm_cpu.json`` (None when it is missing or unreadable)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return Measured([Agreement(**row) for row in doc["rows"]], int(doc["prompts"]), int(doc["tokens"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prompts(tokenizer: Any, n: int, tokens: int = PROMPT_TOKENS, *, fewer: bool = False) -> list[list[int]]:
    """``n`` prompts of ``tokens`` token ids: the first lines of the validation text that are that long (``fewer``:
    as many as it has, at least one, when it has fewer than ``n``)."""
    from pace_core.analysis.text import CALIBRATION_TEXT

    out = []
    for line in CALIBRATION_TEXT.read_text(encoding="utf-8").splitlines():
        ids = tokenizer(line.strip(), add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            return out
    if fewer and out:
        return out
    raise ValueError(f"wikitext2-valid has fewer than {n} lines of {tokens} tokens")


def vllm_engine(model: str | os.PathLike, config: str | None, *, eager: bool = True, tp: int = 1) -> Any:
    """vLLM's offline engine on ``model`` (bf16, no prefix caching; ``eager``, else compiled by torch.compile;
    ``tp`` tensor-parallel ranks) serving ``config`` (None: vLLM's own state). The config is passed as
    ``additional_config``, as ``vllm serve --additional-config`` does."""
    from vllm import LLM

    extra = {} if config is None else {"additional_config": {"pace_config": config}}
    return LLM(model=str(model), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enforce_eager=eager,
               enable_prefix_caching=False, seed=0, tensor_parallel_size=tp, **extra)


def _params(tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def vllm_greedy(llm: Any, prompt_ids: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, all submitted together."""
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], _params(tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def vllm_staggered(llm: Any, prompt_ids: Sequence[Sequence[int]], tokens: int, join_every: int) -> list[list[int]]:
    """Greedy continuations with prompt ``i`` submitted after ``join_every`` engine steps of the previous one
    and asking ``tokens - 3 i`` tokens (at least 1): requests join and leave while others decode."""
    engine, done, pending, step = llm.llm_engine, {}, list(enumerate(prompt_ids)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"p{i}", {"prompt_token_ids": list(p)}, _params(max(1, tokens - 3 * i)))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = list(out.outputs[0].token_ids)
        step += 1
    return [done[i] for i in range(len(prompt_ids))]


def transformers_greedy(loaded: Any, config: str, prompt_ids: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations by the transformers path under ``config`` (one prompt at a time)."""
    import pace_core
    from pace_core.model.patch import remove_pace

    pace_core.apply(loaded.model, config)
    try:
        outs = []
        for p in prompt_ids:
            ids = torch.tensor([list(p)], device=loaded.device)
            gen = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                        min_new_tokens=tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
        return outs
    finally:
        remove_pace(loaded.model)


def teacher_forced_margins(loaded: Any, config: str, prompt_ids: Sequence[Sequence[int]],
                           continuations: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The given continuations fed to the transformers path under ``config``: per prompt, how far each
    continuation token's logit lies below the top logit (0 where it is the greedy choice) and the top
    logit, both ``[len(continuation)]`` float32."""
    from pace_core.export import admit
    from pace_core.model.teacher import Member, teacher_forced

    member = Member(config, admit(config, loaded.shape, loaded.fingerprint))
    out = []
    for p, c in zip(prompt_ids, continuations):
        ids = torch.tensor([list(p) + list(c)], device=loaded.device)
        chunks: list[torch.Tensor] = []
        teacher_forced(loaded, [member], ids, len(p), logits_from=len(p) - 1,
                       on_logits=lambda logits, first, chunks=chunks: chunks.append(logits[0]))
        logits = torch.cat(chunks)[: len(c)]
        top = logits.max(-1).values
        out.append((top - logits[torch.arange(len(c)), torch.tensor(list(c))], top))
    return out


def share_equal(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """The share of positions where two sets of continuations hold the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def agreement(loaded: Any, config: str, prompt_ids: Sequence[Sequence[int]],
              continuations: Sequence[Sequence[int]]) -> float:
    """The teacher-forced share: positions whose transformers greedy choice is the continuation's token."""
    margins = torch.cat([m for m, _ in teacher_forced_margins(loaded, config, prompt_ids, continuations)])
    return float((margins == 0).float().mean())


def measure(model: str | os.PathLike, configs: Sequence[str], n_prompts: int, tokens: int, join_every: int = 4,
            staggered: Sequence[str] = ()) -> list[Agreement]:
    """:class:`Agreement` of each configuration (module docstring); ``staggered``: the configurations whose
    continuous-batching check runs too."""
    from pace_core.model.loading import load_model

    loaded = load_model(str(model), dtype="bfloat16")
    ids = prompts(loaded.tokenizer, n_prompts)
    results = []
    for config in configs:
        llm = vllm_engine(model, None if config == VLLM_OWN else config)
        served = vllm_greedy(llm, ids, tokens)
        joined = vllm_staggered(llm, ids, tokens, join_every) if config in staggered else None
        del llm
        pace = "fp32" if config == VLLM_OWN else config
        reference = transformers_greedy(loaded, pace, ids, tokens)
        results.append(Agreement(config, share_equal(served, reference), agreement(loaded, pace, ids, served),
                                 None if joined is None else agreement(loaded, pace, ids, joined)))
    return results


@dataclass(frozen=True)
class OwnStateRow:
    """One prompt of :func:`own_state_agreement`: the first step where the two engines chose differently (None:
    all equal), vLLM's own top-2 margin there and the largest change of a top-2 margin before it."""

    prompt: int
    first_difference: int | None
    margin: float | None
    drift: float
    near_tie: bool | None


TIE_SLACK = 2.0**-12
"""How far a margin may exceed the largest margin change and still count as within it: vLLM's log-probabilities are
float32 log-softmax values, each off by at most two roundings of half an ulp of the logits (below 2^9 in magnitude:
2^-15 each), and a margin against a change of margins takes six of them: 6 x 2^-15 < 2^-12, far below the 2^-4
steps in which the margins of a bf16 model's logits of that size move."""


def near_tie(margin: float, drift: float) -> bool:
    """Whether a top-2 ``margin`` is within the largest change of a margin between the engines, ``drift``."""
    return margin <= drift + TIE_SLACK


def _margins(step: dict) -> tuple[tuple[int, int], float]:
    """The top-2 token ids of one step's log-probabilities (vLLM's ``{token: Logprob}``) and their margin."""
    (a, la), (b, lb) = sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]
    return (a, b), la - lb


def own_state_agreement(model: str | os.PathLike, config: str, prompt_ids: Sequence[Sequence[int]],
                        tokens: int) -> list[OwnStateRow]:
    """vLLM's own state against the plugin serving ``config`` (module docstring), one row per prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for served in (None, config):
        llm = vllm_engine(model, served)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
        runs.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
        del llm
    rows = []
    for i, ((own, own_lp), (pace, pace_lp)) in enumerate(zip(*runs)):
        t = next((s for s, (a, b) in enumerate(zip(own, pace)) if a != b), None)
        drift = 0.0
        for s in range(tokens if t is None else t):
            pair, margin = _margins(own_lp[s])
            if set(pair) <= set(pace_lp[s]):
                drift = max(drift, abs(margin - (pace_lp[s][pair[0]].logprob - pace_lp[s][pair[1]].logprob)))
        margin = None if t is None else _margins(own_lp[t])[1]
        rows.append(OwnStateRow(i, t, margin, drift, None if t is None else near_tie(margin, drift)))
    return rows


def _label(config: str) -> str:
    """A configuration as reported: a name, or a file's path relative to the repository when inside it."""
    path = Path(config)
    return str(path.resolve().relative_to(REPO_ROOT)) if path.is_file() and path.resolve().is_relative_to(REPO_ROOT) \
        else config


def served_configs(tag: str) -> list[str]:
    """The named configurations of ``tag`` as vLLM is given them: by name, or as the embedded model's shipped export
    (``data/results/pace-tiny-qwen35/config-<name>.json``) where a configuration needs a calibration on it."""
    return [str(SHIPPED_RESULTS / f"config-{name}.json") if get_config(name).needs_calibration else name
            for name in tagged(tag)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EMBEDDED))
    parser.add_argument("--configs", nargs="+", default=[VLLM_OWN, *served_configs("serve-check")])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--join-every", dest="join_every", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "bench")
    parser.add_argument("--own-state", dest="own_state", metavar="CONFIG",
                        help="measure the plugin serving CONFIG against vLLM's own state instead (module docstring)")
    args = parser.parse_args(argv)
    import vllm

    from pace_core.analysis.text import CALIBRATION_TEXT
    from pace_core.model.reference import portable_reference
    from pace_core.results import atomic_write, make_provenance

    provenance = make_provenance(portable_reference(str(args.model)), text_path=CALIBRATION_TEXT,
                                 extra={"vllm": vllm.__version__, "platform": platform.platform(),
                                        "cpu": platform.processor()})
    if args.own_state:
        from transformers import AutoTokenizer

        ids = prompts(AutoTokenizer.from_pretrained(args.model), args.prompts)
        own = own_state_agreement(args.model, args.own_state, ids, args.tokens)
        equal = sum(r.first_difference is None for r in own)
        print(f"{_label(args.own_state)}: {equal} of {len(own)} prompts equal over {args.tokens} greedy tokens")
        for r in own:
            if r.first_difference is not None:
                print(
                    f"  prompt {r.prompt}: step {r.first_difference}, vLLM's top-2 margin {r.margin:.4f}, "
                    f"largest margin change before it {r.drift:.4f}: {'near tie' if r.near_tie else 'NOT a near tie'}"
                )
        doc = {"kind": "vllm-own-state", "config": _label(args.own_state), "prompts": args.prompts,
               "tokens": args.tokens, "equal_prompts": equal, "rows": [r.__dict__ for r in own],
               "provenance": provenance}
        text = json.dumps(doc, indent=1) + "\n"
        atomic_write(args.out / "vllm_cpu_own.json", lambda p: p.write_text(text))
        return 0

    rows = measure(args.model, args.configs, args.prompts, args.tokens, args.join_every, staggered=args.configs)
    print(f"{'config':<48} {'free-running':>12} {'teacher-forced':>14} {'staggered':>10}")
    for r in rows:
        print(f"{_label(r.config):<48} {r.free_running:>12.4f} {r.teacher_forced:>14.4f} "
              f"{'-' if r.staggered is None else f'{r.staggered:.4f}':>10}")
    doc = {"kind": "vllm-agreement", "prompts": args.prompts, "tokens": args.tokens, "join_every": args.join_every,
           "rows": [{**r.__dict__, "config": _label(r.config)} for r in rows], "provenance": provenance}
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write(args.out / "vllm_cpu.json", lambda p: p.write_text(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
