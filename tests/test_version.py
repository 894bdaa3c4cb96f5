import json
import subprocess
import sys
from pathlib import Path

from pace_core import version as V

REPO = Path(__file__).resolve().parents[1]


def test_the_numerics_hash_is_recorded_for_this_method_version():
    """The bump rule: a change of the numerics modules' code (not of their comments, docstrings or
    formatting) must be recorded, with METHOD_VERSION bumped when it changes results."""
    recorded = json.loads(V.RECORD_PATH.read_text())
    now = V.record()
    assert recorded["method_version"] == V.METHOD_VERSION, (
        f"METHOD_VERSION is {V.METHOD_VERSION} but the numerics hash was recorded for {recorded['method_version']}: "
        f"regenerate data/results with the new version (README, 'Where results live'), then record the hash "
        f"with `{V.RECORD_COMMAND}`")
    assert recorded["numerics_hash"] == now["numerics_hash"], (
        "the code of the numerics modules changed (pace_core.version.NUMERICS_MODULES). If results change "
        "(any number a command stores: state errors, KL, calibrations, generations), bump "
        "pace_core.version.METHOD_VERSION and regenerate data/results/pace-tiny-qwen35 with the commands in "
        "README's 'Where results live' (`python -m pace_core all --device cuda --ppl-tokens 0 --ppl-batch 64`, "
        "then `python -m pace_core claims --max-tokens 2048`); if no result changes, only record the new hash. "
        f"Either way record it with `{V.RECORD_COMMAND}`")


def _tree(root: Path, quant: str, drift: str = "def drift(x):\n    return x\n") -> Path:
    (root / "pace_core" / "analysis").mkdir(parents=True, exist_ok=True)
    (root / "pace_core" / "quant.py").write_text(quant)
    (root / "pace_core" / "analysis" / "drift.py").write_text(drift)
    (root / "pace_core" / "config.py").write_text("X = 1\n")  # not a numerics module
    return root


def test_the_hash_follows_code_and_ignores_comments_docstrings_and_formatting(tmp_path):
    base = ('"""Quantiser."""\n\nSTEP = 2 ** -8\n"""The step."""\n\n\n'
            'def scale(x):\n    """Scale."""\n    return x * STEP\n')
    same = ('"""Another module docstring."""\n# a comment\nSTEP = 2**-8  # the step\n\n'
            'def scale(x):\n    """Another docstring,\n    two lines."""\n    # why\n    return (x * STEP)\n')
    other = base.replace("x * STEP", "x / STEP")
    h = V.numerics_hash(_tree(tmp_path / "a", base))
    assert V.numerics_hash(_tree(tmp_path / "b", same)) == h
    assert V.numerics_hash(_tree(tmp_path / "c", other)) != h
    assert V.numerics_hash(_tree(tmp_path / "d", base, "def drift(x):\n    return -x\n")) != h
    changed = _tree(tmp_path / "e", base)
    (changed / "pace_core" / "config.py").write_text("X = 2\n")
    assert V.numerics_hash(changed) == h
    assert [p.relative_to(tmp_path / "a").as_posix() for p in V.numerics_files(tmp_path / "a")] == [
        "pace_core/analysis/drift.py", "pace_core/quant.py"]


def test_the_record_command_prints_the_record():
    out = subprocess.run([sys.executable, "-m", "pace_core.version"], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    assert json.loads(out) == V.record()
    assert "python -m pace_core.version" in V.RECORD_COMMAND


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_copy_with_a_stale_history_names_the_commit_it_was_copied_from(tmp_path, monkeypatch):
    """A GPU machine's copy of the tree may carry another, older ``.git``: with PACE_COMMIT / PACE_TREE the
    provenance names the commit the files were copied from, and ``dirty`` compares the files themselves with
    that commit's tree (an added untracked file counts, an ignored one does not)."""
    root = tmp_path / "copy"
    root.mkdir()
    _git(root, "init", "-q")
    (root / ".gitignore").write_text("ignored/\n")
    (root / "a.py").write_text("A = 1\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "stale")
    stale = _git(root, "rev-parse", "HEAD")
    (root / "a.py").write_text("A = 2\n")  # the files of a later commit, elsewhere
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "later")
    later, tree = _git(root, "rev-parse", "HEAD"), _git(root, "rev-parse", "HEAD^{tree}")
    _git(root, "reset", "-q", "--soft", stale)  # the copy's history stops at the stale commit
    monkeypatch.setattr(V, "REPO_ROOT", root)

    def commit() -> dict:
        V.code_commit.cache_clear()
        return V.code_commit()

    assert commit() == {"commit": stale, "dirty": True}
    monkeypatch.setenv(V.COMMIT_ENV, later)
    monkeypatch.setenv(V.TREE_ENV, tree)
    assert commit() == {"commit": later, "dirty": False}
    (root / "ignored").mkdir()
    (root / "ignored" / "out.json").write_text("{}")
    assert commit() == {"commit": later, "dirty": False}
    (root / "b.py").write_text("B = 1\n")
    assert commit() == {"commit": later, "dirty": True}
    V.code_commit.cache_clear()
