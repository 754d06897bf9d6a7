"""The seams of docs/DESIGN.md are import-linter contracts in pyproject.toml; this test runs them. It also checks,
with grimp (import-linter's graph builder), that no modules of rlrepro import each other in a circle, counting
imports inside functions (grimp reads every import statement of a module, wherever it is), and that no module
of rlrepro is longer than 600 lines."""
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def import_cycles(graph) -> list[list[str]]:
    """One import circle (``[m1, m2, ..., m1]``) per strongly connected set of the graph's modules that has one."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in modules:  # Tarjan's algorithm, iterative (no recursion limit)
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1 or node in edges[node]:
                        components.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    cycles = []
    for comp in components:
        members = set(comp)
        start = comp[0]
        # shortest way back to `start` through the component (breadth first): a concrete circle to print
        prev = {start: None}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for m in frontier:
                for c in edges[m]:
                    if c == start:
                        found = m
                        break
                    if c in members and c not in prev:
                        prev[c] = m
                        nxt.append(c)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        m = found
        while m is not None and m != start:
            path.append(m)
            m = prev[m]
        path = [start] + path[:0:-1] + [start] if len(path) > 1 else [start, start]
        cycles.append(path)
    return cycles


def _describe(graph, cycle: list[str]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        for d in sorted(graph.get_import_details(importer=a, imported=b), key=lambda d: d["line_number"]):
            lines.append(f"    {a}:{d['line_number']}: {d['line_contents']}")
    return "\n".join(lines)


def test_no_import_cycles_among_rlrepro_modules():
    graph = grimp.build_graph("rlrepro", cache_dir=None)
    cycles = import_cycles(graph)
    assert not cycles, "import circles in rlrepro (break them: move the shared part into a third module):\n" + \
        "\n".join(_describe(graph, c) for c in cycles)


def test_the_cycle_check_sees_circles_through_function_level_imports(tmp_path, monkeypatch):
    """The check must fail on a circle closed by a lazy import, and name it."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "d.py").write_text("from . import a\n")  # reaches the circle, is not on it
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", cache_dir=None)
    cycles = import_cycles(graph)
    assert cycles == [["cyclepkg.a", "cyclepkg.b", "cyclepkg.c", "cyclepkg.a"]]
    assert "cyclepkg.c:2:" in _describe(graph, cycles[0])
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    assert import_cycles(grimp.build_graph("cyclepkg", cache_dir=None)) == []


def _module_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def test_no_module_is_longer_than_600_lines():
    files = sorted((ROOT / "rlrepro").rglob("*.py"))
    assert len(files) > 20
    long = {str(p.relative_to(ROOT)): n for p in files if (n := _module_lines(p)) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"


@pytest.mark.parametrize("n,expect_ok", [(MAX_MODULE_LINES, True), (MAX_MODULE_LINES + 1, False)])
def test_line_count_is_exact(tmp_path, n, expect_ok):
    p = tmp_path / "m.py"
    p.write_text("x = 1\n" * n)
    assert (_module_lines(p) <= MAX_MODULE_LINES) is expect_ok
