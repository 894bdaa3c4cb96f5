"""The project's import graph, read from the source with ``ast``: every ``import`` and ``from ... import``
statement of pace_core, kernels, app_state, pages and app.py, at module level, inside functions and under
``TYPE_CHECKING`` alike (an import inside a function is still an import). Prints the largest import cycle
(strongly connected component), the function-level imports, and the largest modules.

    python scripts/import_graph.py            # the summary
    python scripts/import_graph.py --cycles   # every cycle's modules
    python scripts/import_graph.py --edges    # every edge (importer -> imported, line, function-level)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pace_core", "kernels", "app_state", "pages")
"""The folders read; kernels/bench is a set of scripts, not part of the runtime, and is left out."""


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of PACKAGES and app.py."""
    files = {"app": ROOT / "app.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if "bench" in rel.parts and package == "kernels":
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module of ours that ``name`` (a module or a module's attribute) is, or None when not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(files: dict[str, Path]) -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import between our modules."""
    modules = set(files)
    out = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                imported = _resolve(target, modules)
                if imported is not None and imported != module:
                    out.append((module, imported, node.lineno, id(node) in inner))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found, key=len, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", action="store_true", help="list every cycle's modules")
    parser.add_argument("--edges", action="store_true", help="list every edge")
    args = parser.parse_args()
    files = module_files()
    found = edges(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for importer, imported, _, _ in found:
        graph[importer].add(imported)
    components = cycles(graph)
    inner = [e for e in found if e[3]]
    print(f"modules: {len(files)}; imports between them: {len(found)}")
    print(f"largest import cycle: {len(components[0]) if components else 0} modules ({len(components)} cycles)")
    for package in ("pace_core", "kernels", "app_state", "pages"):
        within = {e[:3:2] for e in inner if e[0].split(".")[0] == package and e[1].split(".")[0] == package}
        total = {e[:3:2] for e in inner if e[0].split(".")[0] == package}
        print(f"function-level import statements in {package}: {len(total)} ({len(within)} of {package}'s own)")
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in files.items()), reverse=True)
    print("largest modules: " + ", ".join(f"{m} {n}" for n, m in sizes[:3]))
    if args.cycles:
        for component in components:
            print(f"cycle of {len(component)}: {' '.join(component)}")
    if args.edges:
        for importer, imported, line, in_function in sorted(found):
            print(f"{importer}:{line} -> {imported}{' (in a function)' if in_function else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
