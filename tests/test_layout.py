"""The package's layering, read from its source with ``ast``.

- No import cycles among kernelcache's modules.
- The core (keys, entries, stores, the Cache, statistics, settings) imports no
  integration (NVRTC, nvcc, cuda.core, Triton, the DSLs, the CLI), not even
  through a module in between.
- The keys layer (keys, fingerprint, toolchain) never reaches the settings.

Every import counts: at module level, inside functions and under
``TYPE_CHECKING``. A type-only cycle still ties the modules together, and one
refactor turns it into a run-time one. An edge goes to the module imported
(``from a import b`` to ``a.b`` when that is a module, else to ``a``); the
parent packages that Python initialises on the way are not counted.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import kernelcache

PACKAGE_DIR = Path(kernelcache.__file__).parent

Graph = Mapping[str, set[str]]

# Layers: an entry is a module name, or "name.*" for a package's submodules.
CORE = (
    "kernelcache.keys",
    "kernelcache.directives",
    "kernelcache.sloppiness",
    "kernelcache.fingerprint",
    "kernelcache.toolchain",
    "kernelcache.buildid",
    "kernelcache.entry",
    "kernelcache.entry_format",
    "kernelcache.cache",
    "kernelcache.singleflight",
    "kernelcache.tiers",
    "kernelcache.settings",
    "kernelcache.stats",
    "kernelcache.stats.*",
    "kernelcache.stores",
    "kernelcache.stores.*",
    "kernelcache._fs",
    "kernelcache.fstype",
    "kernelcache.units",
    "kernelcache.errors",
    "kernelcache._dirs",
    "kernelcache._trust",
    "kernelcache._memos",
    "kernelcache.bundle",
    "kernelcache.maintenance",
    "kernelcache.explain",
    "kernelcache.explain.*",
)
INTEGRATIONS = (
    "kernelcache.nvrtc",
    "kernelcache.nvrtc.*",
    "kernelcache.nvcc",
    "kernelcache.nvcc.*",
    "kernelcache.cuda_core",
    "kernelcache.triton",
    "kernelcache.triton.*",
    "kernelcache.tilelang",
    "kernelcache.tilelang.*",
    "kernelcache.ninetoothed",
    "kernelcache.ninetoothed.*",
    "kernelcache.inductor",
    "kernelcache.inductor.*",
    "kernelcache._inductor_autoload",
    "kernelcache.jax",
    "kernelcache.jax.*",
    "kernelcache._jax_autoload",
    "kernelcache.bytecache",
    "kernelcache.integration",
    "kernelcache.versions",
    "kernelcache.autotune",
    "kernelcache.memoize",
    "kernelcache.cli",
    "kernelcache.cli.*",
    "kernelcache.patching",
    "kernelcache.demo",
    "kernelcache.doctor",
    "kernelcache.servers",
    "kernelcache.servers.*",
    "kernelcache.vllm",
)
# Above both: the lazy public table, ``python -m kernelcache``, the default Cache
# the integrations share, install hints, and the contract suite for other tiers.
SURFACE = (
    "kernelcache",
    "kernelcache.__main__",
    "kernelcache._defaults",
    "kernelcache._extras",
    "kernelcache.testing",
    "kernelcache.testing.*",
)
KEYS_LAYER = (
    "kernelcache.keys",
    "kernelcache.fingerprint",
    "kernelcache.toolchain",
    "kernelcache.buildid",
    "kernelcache.directives",
    "kernelcache.sloppiness",
)
SETTINGS = "kernelcache.settings"


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``) for every .py under root."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _known(name: str, modules: Iterable[str]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, module: str, is_package: bool, modules: Iterable[str]) -> set[str]:
    """The modules among ``modules`` that ``path`` imports, anywhere in the file."""
    names = set(modules)
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up from this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in names else source
                for alias in node.names
            ]
        else:
            continue
        out.update(known for t in targets if (known := _known(t, names)) is not None)
    out.discard(module)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    files = module_files(root, package)
    return {
        module: imports_of(path, module, is_package, files)
        for module, (path, is_package) in files.items()
    }


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def path_to(graph: Graph, start: str, goal: Iterable[str]) -> list[str] | None:
    """The shortest import chain from ``start`` to any module in ``goal`` (breadth first)."""
    goals = set(goal)
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph.get(node, ())):
            if succ in came_from:
                continue
            came_from[succ] = node
            if succ in goals:
                chain = [succ]
                while (prev := came_from[chain[-1]]) is not None:
                    chain.append(prev)
                return chain[::-1]
            queue.append(succ)
    return None


def in_layer(module: str, layer: Iterable[str]) -> bool:
    return any(
        module.startswith(entry[:-1]) if entry.endswith(".*") else module == entry
        for entry in layer
    )


GRAPH = import_graph(PACKAGE_DIR, "kernelcache")


def test_the_scanner_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A cycle closed only inside a function and under TYPE_CHECKING is still found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text(
        "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from pkg.a import thing\n"
    )
    (pkg / "sub" / "__init__.py").write_text("from . import d\nfrom .. import a\n")
    (pkg / "sub" / "d.py").write_text("from ..b import f\nimport os\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.sub": {"pkg.sub.d", "pkg.a"},
        "pkg.sub.d": {"pkg.b"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert path_to(graph, "pkg.sub.d", {"pkg.a"}) == ["pkg.sub.d", "pkg.b", "pkg.c", "pkg.a"]
    assert path_to(graph, "pkg.a", {"pkg.sub"}) is None


def test_no_import_cycles() -> None:
    found = cycles(GRAPH)
    assert found == [], "import cycles (each line one strongly connected set):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_every_module_is_in_exactly_one_layer() -> None:
    """A new module is placed on purpose; a layer entry that names nothing is a typo."""
    layers = {"core": CORE, "integrations": INTEGRATIONS, "surface": SURFACE}
    misplaced = {
        module: [name for name, layer in layers.items() if in_layer(module, layer)]
        for module in GRAPH
    }
    assert {m: names for m, names in misplaced.items() if len(names) != 1} == {}
    for layer in layers.values():
        for entry in layer:
            assert any(in_layer(module, [entry]) for module in GRAPH), f"{entry} matches nothing"


def test_the_core_imports_no_integration() -> None:
    integrations = {m for m in GRAPH if in_layer(m, INTEGRATIONS)}
    chains = {
        module: chain
        for module in sorted(GRAPH)
        if in_layer(module, CORE) and (chain := path_to(GRAPH, module, integrations))
    }
    assert chains == {}, "the core reaches an integration:\n" + "\n".join(
        " -> ".join(chain) for chain in chains.values()
    )


def test_the_keys_layer_does_not_reach_the_settings() -> None:
    chains = {module: path_to(GRAPH, module, {SETTINGS}) for module in KEYS_LAYER}
    assert all(module in GRAPH for module in KEYS_LAYER)
    assert {m: chain for m, chain in chains.items() if chain} == {}
