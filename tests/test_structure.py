"""The architecture as tests: no import cycle, the layering between packages, no capability probing by
attribute name, module size, and the documented public names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ondevice", "converters")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that ``path`` imports, at module level or inside a function (a lazy import is
    still a dependency)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    g = _graph()
    g["ondevice.runtime"] = g["ondevice.runtime"] | {"ondevice.loader"}  # loader imports runtime: a cycle
    assert any({"ondevice.loader", "ondevice.runtime"} <= set(c) for c in _cycles(g))


def test_every_internal_from_import_names_something_that_exists():
    """``from ondevice.x import name`` inside a function is only checked when it runs: check them all here."""
    missing = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(PACKAGES):
                try:
                    mod = importlib.import_module(node.module)
                except ImportError as e:
                    if e.name and e.name.split(".")[0] in PACKAGES:
                        missing.append(f"{m}:{node.lineno}: {node.module}")
                    continue  # an optional heavy dependency (mlx, coremltools) missing here
                missing += [f"{m}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(mod, a.name) and f"{node.module}.{a.name}" not in _modules()]
    assert missing == []


def test_only_the_cli_imports_converters():
    offenders = {m: sorted(d for d in deps if d.startswith("converters"))
                 for m, deps in _graph().items() if m.startswith("ondevice") and not m.startswith("ondevice.cli")}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_engine_core_imports_no_product_surface():
    """The engine (flat modules of ondevice/, backends, formats) never imports the server, the CLI, the
    benchmarks or the distributed runtime; they sit above it."""
    above = ("ondevice.server", "ondevice.cli", "ondevice.bench")
    core = [m for m in _graph() if (m.count(".") == 1 and m.startswith("ondevice.") and m != "ondevice.__main__") or
            m.startswith(("ondevice.backends", "ondevice.formats", "ondevice.drafters"))]
    g = _graph()
    bad = {m: sorted(d for d in g[m] if d.startswith(above)) for m in core}
    assert {m: d for m, d in bad.items() if d} == {}


PROBED = ("drafter", "policy", "target", "backend", "inner")


def test_no_capability_probing_of_drafters_backends_policies():
    """Capabilities are declared on the base classes (``Drafter``, ``Policy``) with defaults; nothing asks
    ``hasattr(drafter, ...)`` or ``getattr(policy, ..., default)``."""
    found = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):  # a fixed member name
                arg = ast.unparse(node.args[0]) if node.args else ""
                if any(p in arg.lower() for p in PROBED):
                    found.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _name_compares(source: str, names: set[str]) -> list[str]:
    """Comparisons of a drafter kind's name: a constant in ``names`` against something that speaks of a draft,
    a drafter or a kind."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        consts = {e.value for s in sides for e in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])
                  if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        others = " ".join(ast.unparse(s).lower() for s in sides if not isinstance(s, ast.Constant))
        if consts & names and any(w in others for w in ("draft", "kind")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_drafter_name_compared_outside_the_registry():
    """Behaviour follows a drafter's declared ``Traits``: only ``ondevice.drafters.registry`` compares a kind's name."""
    from ondevice.drafters import registry

    names = set(registry.names())
    found = [f"{m}:{hit}" for m, path in _modules().items() if m != "ondevice.drafters.registry"
             for hit in _name_compares(path.read_text(), names)]
    assert found == []


def test_the_drafter_name_check_finds_planted_comparisons():
    planted = 'if self.drafter == "ngram":\n    pass\nif kind in ("model", "heads"):\n    pass\nok = choice != "none"\n'
    assert [h.split(":")[0] for h in _name_compares(planted, {"ngram", "model", "heads", "none"})] == ["1", "3"]


def test_runtime_functions_are_at_most_50_lines():
    """``Runtime`` drives a ``Slot``; each of its functions stays short (admit / iterate / finish)."""
    tree = ast.parse((ROOT / "ondevice" / "runtime.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    long = {f.name: f.end_lineno - f.lineno + 1 for f in cls.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > 50}
    assert long == {}


def test_training_sits_above_the_engine():
    """Recording and fitting heads (``ondevice.heads`` training modules) may use the loader; nothing the loader
    reaches (the engine, the drafters, the heads the drafters read) imports them."""
    training = {"ondevice.heads.train", "ondevice.heads.data", "ondevice.heads.fit", "ondevice.heads.batch",
                "ondevice.heads.selfprompts"}
    g = _graph()
    reach, todo = set(), ["ondevice.loader"]
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo += list(g[m])
    assert reach & training == set()


def test_no_module_over_400_lines():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert big == {}


def test_documented_public_names_import():
    import ondevice

    for name in ("load", "Runtime", "SamplingParams", "GenerateRequest", "Stats", "Chunk", "Result", "OndeviceError"):
        assert getattr(ondevice, name) is not None, name
    assert set(ondevice.__all__) >= {"load", "Runtime", "SamplingParams", "GenerateRequest", "Stats", "OndeviceError"}
    assert importlib.import_module("ondevice.chat").ChatSession
    from ondevice.cli.main import app

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"models", "pull", "generate", "chat", "convert", "check-pair", "serve", "bench", "info"} <= commands
