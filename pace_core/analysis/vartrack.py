"""Synthetic variable tracking at a chosen context length, generated locally (issue 47): RULER's variable
tracking, so the state format's effect over long contexts is measured on any checkpoint, offline.

An item is RULER's (``scripts/data/synthetic/variable_tracking.py`` of NVIDIA's RULER, which lm-eval's
``ruler_vt`` also follows): the noise line :data:`NOISE` repeated, with chains of assignments inserted at
sorted random positions, each chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (``hops`` assignments after the
first; variable names of 5 capital letters, values of 5 digits, all distinct), and a question on the value of
the first chain. Two tasks are made of it:

- ``pace_vt_<length>``: RULER's own task (1 chain, 4 hops, RULER's template word for word, greedy generation of
  30 tokens, no stop sequence), scored by RULER's ``string_match_all``: the share of the chain's variables that
  the answer names (:func:`process_results`);
- ``pace_vt_mc_<length>``: the same text with 4 chains, asking which of 4 variables (one per chain, each
  ``hop`` assignments down its chain, the same ``hop`` for all) holds the first chain's value, answered by the
  log-likelihood of the option letters (lm-eval's multiple choice: accuracy), so it measures something on a
  small model too and its per-item log-likelihoods show what the state format changed.

Context length is counted in the model's tokens: each item is the longest (most noise lines) whose prompt plus
its answer (30 tokens to generate, or the longest option letter) fits ``length`` tokens of the tokenizer
(special tokens included). Items are seeded per index (``random.Random`` of ``(seed, index)``), so a prefix of
the items (lm-eval's ``--limit``) is the same at any sample count.

:func:`write_task` writes a task into a folder: ``<name>.jsonl`` (the items), ``<name>.yaml`` (the lm-eval task
config naming that file) and, for the generation task, ``pace_vt_utils.py`` (the config's ``!function``: this
module's :func:`process_results`); ``lm_eval --include_path <folder> --tasks <name>`` runs it as well.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pace_core.errors import PaceError

VT_VERSION = 1
"""The version of the generator and its task configs (the tasks' ``metadata.version``)."""

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
"""RULER's noise line."""
INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
"""RULER's template up to the question."""
GEN_QUESTION = ("Question: Find all variables that are assigned the value {query} in the text above. Answer: According "
                "to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value "
                "{query}, they are: ")
"""RULER's question and answer prefix, as RULER writes them ('assgined' included)."""
MC_QUESTION = "Question: Which of these variables is assigned the value {query} in the text above?\n{options}\nAnswer:"
GEN_TOKENS = 30
"""RULER's ``tokens_to_generate`` for variable tracking."""
LETTERS = string.ascii_uppercase
NAME_RE = re.compile(r"^pace_vt(?P<mc>_mc)?_(?P<length>[0-9]+)(?P<k>k?)$")
UTILS_MODULE = "pace_vt_utils"
"""The module the generation task's config names for its ``process_results`` (written beside it)."""
MAX_LENGTH = 1 << 22


@dataclass(frozen=True)
class VarTrack:
    """One synthetic variable-tracking task: ``length`` tokens of context, multiple choice (``choice``) or RULER's
    generation, ``samples`` items from ``seed``, chains of ``hops`` assignments after the first; ``chains``
    chains (default: RULER's 1 for generation, one per option for multiple choice, which asks about 4)."""

    length: int
    choice: bool = False
    samples: int = 50
    seed: int = 0
    hops: int = 4
    chains: int | None = None

    def __post_init__(self) -> None:
        for field, value, low in (("length", self.length, 64), ("samples", self.samples, 1), ("hops", self.hops, 1),
                                  ("chains", self.n_chains, 2 if self.choice else 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_LENGTH:
                raise PaceError(f"synthetic task {field}={value!r} is not allowed; allowed: an integer from {low}")
        if self.choice and self.n_chains > len(LETTERS):
            raise PaceError(f"synthetic task chains={self.n_chains} is not allowed; allowed: 2..{len(LETTERS)} "
                            "(one option letter per chain)")

    @property
    def n_chains(self) -> int:
        """The chains of an item."""
        return self.chains if self.chains is not None else (4 if self.choice else 1)

    @property
    def name(self) -> str:
        """The lm-eval task name: ``pace_vt_<length>`` or ``pace_vt_mc_<length>``."""
        return f"pace_vt{'_mc' if self.choice else ''}_{self.length}"

    @property
    def settings(self) -> dict[str, Any]:
        """What defines its items besides the tokenizer (a result's key holds it with the items' sha256)."""
        return {"generator": "pace_vt", "version": VT_VERSION, "length": self.length, "choice": self.choice,
                "samples": self.samples, "seed": self.seed, "hops": self.hops, "chains": self.n_chains}


def parse_name(name: str, *, samples: int = 50, seed: int = 0) -> VarTrack | None:
    """The synthetic task a name asks for (``pace_vt_4096``, ``pace_vt_mc_32k``: ``k`` is 1,024 tokens), or None
    when the name is not one."""
    m = NAME_RE.match(name.strip())
    if m is None:
        return None
    length = int(m["length"]) * (1024 if m["k"] else 1)
    return VarTrack(length, choice=bool(m["mc"]), samples=samples, seed=seed)


def _chains(rng: random.Random, chains: int, hops: int) -> tuple[list[list[str]], list[str], list[list[str]]]:
    """Each chain's variables, its value and its assignment lines (RULER's form, its trailing spaces included)."""
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    values: list[str] = []
    while len(values) < chains:
        value = str(rng.randint(10000, 99999))
        if value not in values:
            values.append(value)
    variables = [names[i * (hops + 1):(i + 1) * (hops + 1)] for i in range(chains)]
    lines = [[f"VAR {v[0]} = {value}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(hops)]
             for v, value in zip(variables, values)]
    return variables, values, lines


def _context(rng: random.Random, noises: int, lines: list[list[str]]) -> str:
    """The noise lines with each chain's lines inserted at sorted random positions (RULER's insertion)."""
    sentences = [NOISE] * noises
    for chain in lines:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, position in enumerate(positions):
            sentences.insert(position + j, chain[j])
    return " ".join(sentences).replace(". \n", ".\n")


def make_item(task: VarTrack, index: int, noises: int) -> dict[str, Any]:
    """Item ``index`` of ``task`` with ``noises`` noise lines: ``input`` (the prompt), ``query`` (the value asked
    about), ``outputs`` (the first chain's variables: RULER's answer), and for multiple choice ``choices`` (the
    option letters) and ``answer`` (the index of the right one) with ``options`` (the variables offered) and
    ``hop``. The same ``(task.seed, index, noises)`` always give the same item."""
    rng = random.Random(f"pace-vt:{task.seed}:{index}")
    variables, values, lines = _chains(rng, task.n_chains, task.hops)
    text = INSTRUCTION.format(context=_context(rng, noises, lines))
    item: dict[str, Any] = {"index": index, "query": values[0], "outputs": variables[0]}
    if not task.choice:
        return {**item, "input": text + GEN_QUESTION.format(query=values[0], num_v=task.hops + 1)}
    hop = rng.randint(1, task.hops)
    order = list(range(task.n_chains))
    rng.shuffle(order)
    options = [variables[c][hop] for c in order]
    listed = "\n".join(f"{LETTERS[i]}. VAR {v}" for i, v in enumerate(options))
    return {**item, "input": text + MC_QUESTION.format(query=values[0], options=listed), "hop": hop,
            "options": options, "choices": list(LETTERS[:task.n_chains]), "answer": order.index(0)}


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def answer_room(task: VarTrack, tokenizer: Any) -> int:
    """Tokens an item leaves after its prompt: RULER's 30 to generate, or the longest option letter (as lm-eval
    scores it, after a space)."""
    if not task.choice:
        return GEN_TOKENS
    return max(len(tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for c in LETTERS[:task.n_chains])


def generate(task: VarTrack, tokenizer: Any) -> list[dict[str, Any]]:
    """The items of ``task`` for ``tokenizer``, each the longest (most noise lines) whose prompt and answer room
    (:func:`answer_room`) fit ``task.length`` tokens; ``tokens`` is its prompt's token count. PaceError when an
    item does not fit even with the fewest noise lines (``hops + 1``)."""
    room = answer_room(task, tokenizer)
    least = task.hops + 1

    def size(index: int, noises: int) -> int:
        return _tokens(tokenizer, make_item(task, index, noises)["input"]) + room

    shortest = size(0, least)
    per_noise = max(size(0, least + 8) - shortest, 8) / 8
    noises = least + max(int((task.length - shortest) / per_noise), 0)
    items = []
    for index in range(task.samples):
        while noises > least and size(index, noises) > task.length:
            noises -= 1
        if size(index, noises) > task.length:
            raise PaceError(f"synthetic task {task.name}: {task.length:,} tokens are too few; item {index} takes "
                            f"{size(index, noises):,} tokens of this tokenizer with the fewest noise lines ({least}) "
                            f"beside its {task.n_chains} chain(s) of {task.hops + 1} assignments: choose a longer "
                            "length")
        while size(index, noises + 1) <= task.length:
            noises += 1
        item = make_item(task, index, noises)
        items.append({**item, "tokens": _tokens(tokenizer, item["input"]), "noises": noises, "length": task.length})
    return items


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """RULER's ``string_match_all`` of one generated answer: the share of the chain's variables it names (case
    folded)."""
    answer = results[0].lower()
    return {"string_match_all": sum(v.lower() in answer for v in doc["outputs"]) / len(doc["outputs"])}


@dataclass(frozen=True)
class TaskFiles:
    """A synthetic task written into a folder: its name, config, items and their sha256, and token counts."""

    task: VarTrack
    folder: Path
    config: Path
    data: Path
    sha256: str
    tokens: tuple[int, int]
    """The fewest and the most prompt tokens of its items."""


def _yaml(task: VarTrack, data: Path) -> str:
    """The lm-eval task config (YAML; strings written as JSON, which YAML reads)."""
    q = json.dumps
    head = [f"task: {task.name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
            f"    test: {q(str(data))}", "test_split: test", f"doc_to_text: {q('{{input}}')}"]
    if task.choice:
        body = ["output_type: multiple_choice", f"doc_to_choice: {q('{{choices}}')}",
                f"doc_to_target: {q('{{answer}}')}", "metric_list:", "  - metric: acc", "    aggregation: mean",
                "    higher_is_better: true"]
    else:
        body = ["output_type: generate_until", f"doc_to_target: {q('{{outputs}}')}",
                f"process_results: !function {UTILS_MODULE}.process_results", "generation_kwargs:",
                "  do_sample: false", "  temperature: 0.0", f"  max_gen_toks: {GEN_TOKENS}", "  until: []",
                "metric_list:", "  - metric: string_match_all", "    aggregation: mean", "    higher_is_better: true"]
    meta = ["num_fewshot: 0", "metadata:", f"  version: {VT_VERSION}.0",
            *(f"  {k}: {q(v)}" for k, v in task.settings.items() if k != "version")]
    return "\n".join(head + body + meta) + "\n"


def write_task(task: VarTrack, tokenizer: Any, folder: str | Path) -> TaskFiles:
    """Generate ``task`` for ``tokenizer`` and write its items, config and (generation) utils module into
    ``folder`` (made if missing; files of an earlier write replaced)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items = generate(task, tokenizer)
    text = "".join(json.dumps(item, sort_keys=True) + "\n" for item in items)
    data = folder / f"{task.name}.jsonl"
    data.write_text(text, encoding="utf-8")
    config = folder / f"{task.name}.yaml"
    config.write_text(_yaml(task, data.resolve()), encoding="utf-8")
    if not task.choice:
        (folder / f"{UTILS_MODULE}.py").write_text(
            '"""The generation task\'s metric: pace_core.analysis.vartrack.process_results '
            '(RULER\'s string_match_all)."""\n'
            "from pace_core.analysis.vartrack import process_results  # noqa: F401\n", encoding="utf-8")
    counts = [item["tokens"] for item in items]
    return TaskFiles(task, folder, config, data, hashlib.sha256(text.encode("utf-8")).hexdigest(),
                     (min(counts), max(counts)))
