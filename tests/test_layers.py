"""The import layers of docs/ARCHITECTURE.md as the code holds them: no import cycle among the modules of pace_core,
kernels, app_state, pages and app.py (imports inside functions and under TYPE_CHECKING counted), and the pages
import only app_state, pace_core.figures and pace_core.errors. pyproject's import-linter contract (``make test``:
lint-imports) checks the layers of pace_core itself."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE_IMPORTS = ("app_state", "pace_core.figures", "pace_core.errors")
spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = import_graph
spec.loader.exec_module(import_graph)


def _graph() -> tuple[dict[str, Path], list[tuple[str, str, int, bool]]]:
    files = import_graph.module_files()
    return files, import_graph.edges(files)


def test_the_graph_reads_function_level_imports(tmp_path, monkeypatch):
    (tmp_path / "pace_core").mkdir()
    (tmp_path / "pace_core" / "__init__.py").write_text("")
    (tmp_path / "pace_core" / "a.py").write_text("def f():\n    from pace_core import b\n")
    (tmp_path / "pace_core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from pace_core.a import f\n")
    (tmp_path / "app.py").write_text("")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    files, found = _graph()
    graph = {m: {b for a, b, _, _ in found if a == m} for m in files}
    assert ("pace_core.a", "pace_core.b", 2, True) in found
    assert import_graph.cycles(graph) == [["pace_core.a", "pace_core.b"]]


def test_no_import_cycle():
    files, found = _graph()
    graph = {m: {b for a, b, _, _ in found if a == m} for m in files}
    assert import_graph.cycles(graph) == []



def test_pages_import_only_app_state_figures_and_errors():
    _, found = _graph()
    wrong = [f"{a}:{line} -> {b}" for a, b, line, _ in found if a.startswith("pages.") or a == "app"
             if not any(b == p or b.startswith(p + ".") for p in PAGE_IMPORTS) and b != "pace_core"]
    assert wrong == []


def test_the_architecture_draws_the_contract():
    """docs/ARCHITECTURE.md's layer diagram lists pyproject's layers of pace_core in the contract's order."""
    import tomllib

    contract = next(c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    diagram = doc[doc.index("─ pace_core ─"):].split("```")[0]
    drawn = [line.split("  ")[0].strip().split(" ◀")[0].strip() for line in diagram.splitlines()[1:] if line.strip()]
    assert drawn == contract["layers"]
