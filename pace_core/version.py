"""The method version: which version of PACE's numerics made a stored result.

``METHOD_VERSION`` enters every stored result's key and provenance (:mod:`pace_core.results`), so after a
change of the numerics the CLI computes new results instead of serving the old ones, and the app labels
results of another version as stale. The git commit of the code (:func:`code_commit`) enters the
provenance only, never a key: a commit that changes no numerics keeps its results.

The bump rule is enforced by ``tests/test_version.py``: it hashes the abstract syntax trees of the
numerics modules (:data:`NUMERICS_MODULES`; docstrings removed, so comments, docstrings and formatting do
not count) and compares the hash with the one recorded in ``tests/numerics_hash.json`` for this
``METHOD_VERSION``. When the hash changes, either results change (bump ``METHOD_VERSION``, regenerate
``data/results``, record the new hash) or they do not (record the new hash). ``python -m
pace_core.version`` prints the record of the code as it is now, in the file's format.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

METHOD_VERSION = 2
"""Bumped whenever a change of the numerics modules changes a result (see the module docstring)."""

REPO_ROOT = Path(__file__).resolve().parent.parent

NUMERICS_MODULES = (
    "pace_core/quant.py",
    "pace_core/recurrence.py",
    "pace_core/schedule.py",
    "pace_core/buffer.py",
    "pace_core/checkpoint.py",
    "pace_core/heads.py",
    "pace_core/backend.py",
    "pace_core/state_store.py",
    "pace_core/methods/*.py",
    "pace_core/methods/*/*.py",
    "pace_core/analysis/*.py",
    "pace_core/model/teacher.py",
    "pace_core/model/capture.py",
    "pace_core/model/patch.py",
    "kernels/*.py",
)
"""The modules whose code makes the numbers of a stored result (paths or globs under the repository)."""

RECORD_PATH = REPO_ROOT / "tests" / "numerics_hash.json"
"""Where the test keeps the hash recorded for ``METHOD_VERSION``."""

RECORD_COMMAND = "python -m pace_core.version > tests/numerics_hash.json"
"""Records the hash of the code as it is now (after deciding whether METHOD_VERSION must be bumped)."""


def numerics_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files of :data:`NUMERICS_MODULES` under ``root``, sorted by their path."""
    files = {p for pattern in NUMERICS_MODULES for p in root.glob(pattern) if p.is_file()}
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` without bare string statements (docstrings of modules, classes and functions, and the
    strings documenting constants): they do nothing when the code runs."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                 and isinstance(s.value.value, str))]
    return tree


def _canonical(node: object) -> str:
    """A text of an AST node that leaves out positions and empty fields (absent or ``[]``), so the text of
    the same code is the same under the Python versions that add empty fields (e.g. ``type_params``)."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    return repr(node)


def numerics_hash(root: Path = REPO_ROOT) -> str:
    """sha256 over each numerics module's path and its syntax tree without docstrings (comments,
    docstrings and formatting do not change it)."""
    h = hashlib.sha256()
    for path in numerics_files(root):
        tree = _strip_docstrings(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        h.update(f"{path.relative_to(root).as_posix()}\n{_canonical(tree)}\n".encode())
    return h.hexdigest()


def record(root: Path = REPO_ROOT) -> dict[str, object]:
    """The record of the code as it is now: ``{"method_version", "numerics_hash"}``."""
    return {"method_version": METHOD_VERSION, "numerics_hash": numerics_hash(root)}


COMMIT_ENV, TREE_ENV = "PACE_COMMIT", "PACE_TREE"
"""For a copy of the tree without its own history (a GPU machine's copy, whose ``.git`` may be another's): the
commit it was copied from and that commit's tree hash (``git rev-parse HEAD HEAD^{tree}`` where it was copied)."""


@functools.cache
def code_commit() -> dict[str, object] | None:
    """``{"commit": sha, "dirty": bool}`` of the code (dirty: its files differ from the commit's), or None without
    git or outside a checkout. With :data:`COMMIT_ENV` set, the commit is that one, and the files are compared
    with :data:`TREE_ENV`'s tree by hashing them (the files git would commit: tracked and untracked, not
    ignored), so a copy whose ``.git`` is stale still names its own commit. Read once per process."""
    def git(*args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=60, env=env).stdout.strip()

    try:
        given = os.environ.get(COMMIT_ENV)
        if given:
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
                git("add", "--all", ".", env=env)
                tree = git("write-tree", env=env)
            return {"commit": given, "dirty": tree != os.environ.get(TREE_ENV)}
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


if __name__ == "__main__":
    print(json.dumps(record(), indent=1))
