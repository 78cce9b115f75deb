"""The package's layers: a module imports only from its own layer or the layers below it, and no
package or module imports form a circle. Reads the sources with ast (imports inside functions and
under TYPE_CHECKING included, and the packages an import runs first: `import a.b.c` runs a/__init__ and
a/b/__init__), so it needs neither llama.cpp nor torch; one test imports the pure model in a child whose
llama_cpp cannot be imported."""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parents[1] / "edgemoe"

# lowest first; a module may import its own layer and those below it (docs/architecture.md)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("edgemoe", "edgemoe.errors", "edgemoe.progress"),  # version, lazy public names, errors, progress bars
    ("edgemoe.gguf", "edgemoe.torchref"),  # file formats and the torch reference model
    # pure numpy decisions over routing records; speculation's draft sources and acceptance rules
    ("edgemoe.policies", "edgemoe.predictors", "edgemoe.speculation"),
    ("edgemoe.runtime",),  # the one native binding and the Engine over it
    ("edgemoe.analysis",),  # traces, statistics, perplexity, verify, reports
    ("edgemoe.calibration",),  # calibration stages and artifacts
    # the planner (budget arithmetic, the one reserve, the request and its rules, plan()): pure, below perf
    ("edgemoe.plan",),
    # performance by job (the pure model, this machine's measurements, the engine benchmark)
    ("edgemoe.perf", "edgemoe.perf.model", "edgemoe.perf.measure"),
    ("edgemoe.placement",),  # model + plan -> a running engine with its expert cache (open_engine, install)
    ("edgemoe.perf.bench",),  # the engine benchmark: rows planned and opened as open_engine does, measured
    ("edgemoe.cli", "edgemoe.serve", "edgemoe.__main__"),  # command line; HTTP server (cli imports serve)
)


def unit_of(module: str) -> str:
    """The layer-table entry a module belongs to (the longest matching prefix)."""
    best = ""
    for layer in LAYERS:
        for unit in layer:
            if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
    if not best:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best


def layer_of(module: str) -> int:
    unit = unit_of(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def module_name(path: Path, pkg_dir: Path = PKG_DIR) -> str:
    parts = list(path.relative_to(pkg_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(pkg_dir: Path = PKG_DIR) -> dict[str, Path]:
    return {module_name(p, pkg_dir): p for p in sorted(pkg_dir.rglob("*.py"))}


def parents_run(target: str, importer: str, known: Iterable[str]) -> set[str]:
    """The packages importing `target` runs first (a.b for a.b.c), less those the importer's own import already
    ran (its own ancestors: importing a.b.c from a.b.d finds a.b loaded)."""
    known = set(known)
    parts = target.split(".")
    ancestors = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known and p not in ancestors}


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The edgemoe modules `name` imports anywhere in its source (absolute and relative), with the packages each
    import runs first (parents_run)."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t.startswith("edgemoe") and t != name:
                out.add(t)
                out |= parents_run(t, name, known) - {name}
    return out


def import_graph(pkg_dir: Path = PKG_DIR) -> dict[str, set[str]]:
    mods = all_modules(pkg_dir)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the directed graph, as a node list whose last node imports the first, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
            for a, deps in sorted(graph.items()) for b in sorted(deps) if layer_of(b) > layer_of(a)]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between the layer table's packages (a package's own modules importing each other drop out)."""
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        ua = unit_of(a)
        out.setdefault(ua, set()).update(unit_of(b) for b in deps if unit_of(b) != ua)
    return out


GRAPH = import_graph()


def test_every_module_has_a_layer() -> None:
    for name in GRAPH:
        layer_of(name)


def test_lower_layers_never_import_higher_ones() -> None:
    assert layer_violations(GRAPH) == []


def test_no_import_circle_between_packages() -> None:
    assert find_cycle(unit_graph(GRAPH)) is None


def test_no_import_circle_between_modules() -> None:
    assert find_cycle(GRAPH) is None


@pytest.mark.parametrize("src, bad", [
    ("policies/gating.py", "from ..runtime.engine import Engine\n"),  # up two layers
    ("runtime/native/loader.py", "def f() -> None:\n    from ...cli import main\n"),  # inside a function
])
def test_an_upward_import_is_caught(tmp_path: Path, src: str, bad: str) -> None:
    copy = tmp_path / "edgemoe"
    for path in all_modules().values():
        dst = copy / path.relative_to(PKG_DIR)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(path.read_text())
    (copy / src).write_text((copy / src).read_text() + bad)
    assert layer_violations(import_graph(copy))


def test_only_the_cli_imports_the_cli() -> None:
    """serve, perf and the tools call the library (edgemoe.placement), never the command line's modules."""
    mods = all_modules()
    users = {n: deps for n, deps in GRAPH.items() if not n.startswith("edgemoe.cli")}
    for tool in sorted((PKG_DIR.parent / "tools").rglob("*.py")):
        users[f"tools/{tool.name}"] = imports_of(f"tools.{tool.stem}", tool, mods)
    bad = sorted(f"{n} imports {d}" for n, deps in users.items() for d in deps if d.startswith("edgemoe.cli")
                 and n != "edgemoe.__main__")
    assert bad == []


# what the performance model never imports itself: it runs without the native library and without an Engine
PURE_MODEL_NEVER_IMPORTS = ("edgemoe.runtime", "edgemoe.perf.measure", "edgemoe.perf.bench")


def impure_model_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{n} imports {d}" for n, deps in graph.items() if unit_of(n) == "edgemoe.perf.model"
                  for d in deps if any(d == p or d.startswith(p + ".") for p in PURE_MODEL_NEVER_IMPORTS))


def test_the_performance_model_is_pure() -> None:
    """edgemoe.perf.model imports neither the runtime (the native library, the Engine) nor perf.measure (the
    microbenchmarks) nor perf.bench (the engine benchmark); those may import the model."""
    assert any(unit_of(n) == "edgemoe.perf.model" for n in GRAPH)
    assert impure_model_imports(GRAPH) == []


def test_an_impure_import_in_the_model_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "edgemoe"
    for path in all_modules().values():
        dst = copy / path.relative_to(PKG_DIR)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(path.read_text())
    (copy / "perf/model/report.py").write_text((copy / "perf/model/report.py").read_text()
                                               + "from ..measure import microbench\n")
    assert impure_model_imports(import_graph(copy)) == [  # the package's __init__ runs first
        "edgemoe.perf.model.report imports edgemoe.perf.measure",
        "edgemoe.perf.model.report imports edgemoe.perf.measure.microbench"]


def test_an_implicit_parent_import_is_caught(tmp_path: Path) -> None:
    """`from edgemoe.placement.open import x` in the pure model runs edgemoe/placement/__init__ first: caught
    even when the parent package imports what it imports lazily."""
    mods = set(all_modules())
    assert parents_run("edgemoe.placement.open", "edgemoe.perf.model.simulate", mods) == {
        "edgemoe.placement"}
    assert parents_run("edgemoe.plan.budget", "edgemoe.plan.planner", mods) == set()  # its own package
    copy = tmp_path / "edgemoe"
    for path in all_modules().values():
        dst = copy / path.relative_to(PKG_DIR)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(path.read_text())
    (copy / "placement/__init__.py").write_text('"""An eager package."""\nfrom .open import open_engine\n')
    (copy / "placement/stub.py").write_text('"""Nothing."""\n')
    (copy / "perf/model/report.py").write_text((copy / "perf/model/report.py").read_text()
                                               + "from ...placement import stub\n")
    graph = import_graph(copy)
    assert "edgemoe.placement" in graph["edgemoe.perf.model.report"]
    assert "edgemoe.perf.model.report (layer 7) imports edgemoe.placement (layer 8)" in layer_violations(graph)


PURE_CHILD = """
import importlib, pkgutil, sys
sys.modules["llama_cpp"] = None  # any import of it raises ImportError
import edgemoe.perf.model, edgemoe.plan
names = [m.name for pkg in (edgemoe.perf.model, edgemoe.plan)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.startswith(("edgemoe.runtime.", "edgemoe.placement")))
print(len(names), loaded)
"""


def test_the_pure_model_imports_without_llama_cpp() -> None:
    """Every module of edgemoe.perf.model and edgemoe.plan imports in a child where llama_cpp cannot be imported,
    and loads neither the native binding nor the engine (only the runtime's pure config modules)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PURE_CHILD], capture_output=True, text=True, timeout=300,
                         cwd=PKG_DIR.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = out.stdout.split(" ", 1)
    assert int(count) > 20
    assert not any(m.startswith(("edgemoe.runtime.native", "edgemoe.runtime.engine", "edgemoe.placement"))
                   for m in eval(loaded)), loaded


def test_a_circle_is_caught() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
