"""The code's layout as a specification: layers, module sizes, and docs that resolve.

The layer of every top-level package and module of ``megatron_mlp`` is read from the table in
``docs/internals.md``, so the page and the import graph cannot drift apart: a module imports only
from its own layer or lower ones (lazy imports inside functions included), and no import chain
loops back on itself.
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_mlp"
INTERNALS = REPO / "docs" / "internals.md"
# A Megatron-LM-shaped checkout used by the multi-node tests: Megatron-LM's layout, not ours.
STANDIN = PACKAGE / "testing" / "megatron_lm_standin"
MAX_MODULE_LINES = 500
MAX_README_CHARS = 12_000
MAX_README_CELL_CHARS = 300
MAX_BENCHMARK_PAGE_CHARS = 15_000


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if STANDIN in path.parents:
            continue
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ``megatron_mlp`` module that ``name`` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # `from megatron_mlp import _C` names the extension, which has no .py source.
            if target in modules or target == "megatron_mlp._C":
                found.add(target)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports_of(name, path, modules) for name, path in modules.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megatron_mlp"


def _documented_layers() -> dict[str, int]:
    """{top-level package or module: layer} from the layer table of docs/internals.md."""
    layers = {}
    for line in INTERNALS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)/?`", cells[1]):
                assert name not in layers, f"docs/internals.md lists {name!r} twice"
                layers[name] = int(cells[0])
    return layers


def test_internals_table_gives_every_top_level_package_and_module_a_layer():
    layers = _documented_layers()
    tops = {_top(m) for m in _modules()} - {"megatron_mlp"} | {"_C"}
    assert tops - set(layers) == set(), "add these to the layer table of docs/internals.md"
    assert set(layers) - tops == set(), "docs/internals.md lists what megatron_mlp/ does not have"


def test_no_module_imports_from_a_higher_layer():
    layers = _documented_layers()
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            if _top(target) == "megatron_mlp":
                continue          # the package's own __init__: version string only
            if layers[_top(target)] > layers[_top(module)]:
                upward.append(f"{module} (layer {layers[_top(module)]}) imports {target} "
                              f"(layer {layers[_top(target)]})")
    assert upward == []


def test_import_graph_has_no_loops():
    graph = _graph()
    loops, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                loops.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert loops == []


def test_no_module_is_over_500_lines():
    """The package and the scripts (gpu_check's checks included)."""
    paths = [*_modules().values(), *(REPO / "scripts").rglob("*.py")]
    long = {str(path.relative_to(REPO)): n for path in paths
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_readme_is_short_with_short_table_cells():
    text = (REPO / "README.md").read_text()
    assert len(text) <= MAX_README_CHARS
    long_cells = [cell.strip()[:60] for line in text.splitlines() if line.startswith("|")
                  for cell in line.strip().strip("|").split("|") if len(cell.strip()) > MAX_README_CELL_CHARS]
    assert long_cells == []


def test_each_current_benchmark_page_is_short():
    pages = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
    assert pages, "docs/benchmarks/ has no pages"
    assert {p.name: len(p.read_text()) for p in pages
            if len(p.read_text()) > MAX_BENCHMARK_PAGE_CHARS} == {}


def _doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "patches").rglob("*.md")), *sorted((REPO / "scripts").rglob("*.md"))]


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in _doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _documented_names() -> set[str]:
    names = set()
    for page in _doc_pages():
        if "archive" in page.parts:
            continue      # dated records describe the code of their day
        text = page.read_text()
        names |= set(re.findall(r"\bmegatron_mlp(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))
        for module, imported in re.findall(r"from (megatron_mlp[\w.]*) import ([\w, ()]+)", text):
            names |= {f"{module}.{name}" for name in re.findall(r"\w+", imported)}
    return names


@pytest.mark.parametrize("dotted", sorted(_documented_names()))
def test_every_name_the_docs_mention_imports(dotted):
    assert _resolves(dotted), f"the docs mention {dotted}, which does not import"
