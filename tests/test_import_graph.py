"""The import graph of ``k3_fastpath`` and ``verify``, read from the sources (every import statement, the ones
inside functions included: a lazy import that closes a loop is still a cycle a reader has to untangle;
``bundle verify``'s "module:function" rescorer targets too):
no cycle between modules, and no module of ``k3_fastpath`` importing a layer above its own
(``_lib`` < the model description < ``reference`` < ``kernels`` < ``runtime`` < ``integrations``)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("k3_fastpath", "verify")
# k3_fastpath's layers, bottom up; a module may import its own layer and those below
LAYERS = {"_lib": 0, "config": 1, "rank_shapes": 1, "presets": 1, "manifest": 1, "mxfp4": 1, "synthetic": 1,
          "tokenizer": 1, "weights": 1,
          "reference": 2, "kernels": 3, "runtime": 4, "measure": 5, "integrations": 5,
          "sentinel": 5}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _from_module(mod: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement in ``mod`` (at ``path``) imports from."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(mod: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    """The modules of ``mods`` an import statement in ``mod`` names (``from pkg import sub`` names pkg.sub)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        parent = _from_module(mod, path, node)
        names = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in mods else parent for a in node.names]
    else:
        return []
    out = []
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n and n != mod and not mod.startswith(n + "."):  # a package's own __init__ is not an edge
            out.append(n)
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; ``bundle verify``'s lazy rescorer targets count as its imports."""
    from verify.bundle.verify import BUILTIN_RESCORERS

    mods = _modules()
    edges = {m: {t for node in ast.walk(ast.parse(p.read_text())) for t in _targets(m, p, node, mods)}
             for m, p in mods.items()}
    edges["verify.bundle.verify"] |= {target.partition(":")[0] for _, target in BUILTIN_RESCORERS}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "k3_fastpath" and len(parts) > 1 else None


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def _upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts
                  if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))


def test_no_upward_import_in_k3_fastpath():
    assert _upward(_graph()) == []


def test_every_top_level_module_of_k3_fastpath_has_a_layer():
    tops = {m.split(".")[1] for m in _modules() if m.startswith("k3_fastpath.")}
    assert tops <= set(LAYERS), sorted(tops - set(LAYERS))


def test_the_detector_finds_a_cycle_and_an_upward_import():
    """The checks above can fail: a planted two-module loop and an import from _lib into runtime."""
    g = _graph()
    g["k3_fastpath.runtime.tp_comm"].add("k3_fastpath.runtime.tp")
    assert any({"k3_fastpath.runtime.tp", "k3_fastpath.runtime.tp_comm"} <= set(c) for c in _cycles(g))
    g["k3_fastpath._lib.counters"].add("k3_fastpath.runtime.executor")
    assert _upward(g) == ["k3_fastpath._lib.counters imports k3_fastpath.runtime.executor"]


def _unresolved_names(mods: dict[str, Path]) -> list[str]:
    """Every ``from <k3_fastpath | verify module> import NAME`` (inside functions too) whose module has no
    NAME, neither an attribute nor a submodule: a lazy import that fails only when its branch runs."""
    import importlib

    bad = []
    for mod, path in sorted(mods.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            parent = _from_module(mod, path, node)
            if parent not in mods:
                continue
            m = importlib.import_module(parent)
            bad += [f"{path.relative_to(REPO)}:{node.lineno}: {parent} has no {a.name}" for a in node.names
                    if a.name != "*" and not hasattr(m, a.name) and f"{parent}.{a.name}" not in mods]
    return bad


def test_every_imported_name_exists():
    """The H200 standard run at 3dc5bcb lost its perf sweep to a function-local import of a helper that had
    been deleted (a GPU-only branch no CPU test executes); this finds such an import without running it."""
    assert _unresolved_names(_modules()) == []


def test_the_name_check_finds_a_missing_name(tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "k3_fastpath_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    return 1\n")
    (pkg / "b.py").write_text("def g():\n    from k3_fastpath_probe.a import f, gone\n    return f, gone\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    mods = {"k3_fastpath_probe": pkg / "__init__.py", "k3_fastpath_probe.a": pkg / "a.py",
            "k3_fastpath_probe.b": pkg / "b.py"}
    assert _unresolved_names(mods) == ["k3_fastpath_probe/b.py:2: k3_fastpath_probe.a has no gone"]
