"""Imports point one way: a module imports only from its own layer or lower ones, and no module cycle exists.

The check parses every module of the package with ``ast`` (imports inside
functions included, so a lazy import cannot hide a cycle) and compares each
import with the declared layer order below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfspec

PACKAGE = Path(selfspec.__file__).parent

# Lowest first.  A module may import modules of its own layer or of any earlier one.
LAYERS = [
    "errors",
    "io",  # atomic writes, versioned files
    "datasets",
    "core",  # skip sets, KV cache, kernels, sampling
    "arch",  # HF internals
    "model",  # engine + loading
    "decoding",  # protocols, round loop, trees, acceptance, stats
    "cost",
    "policies",
    "drafters",
    "methods",
    "api",
    "search",
    "train",
    "bench",
    "reproduce",  # selfspec reproduce: the papers' key results, through the bench
    "server",  # selfspec serve: HTTP front-end over the API
    "cli",
    "__init__",  # the public facade re-exports from everywhere
]

# Known upward imports, each with the reason it is still there.  The test also fails
# when one of these disappears, so that the list stays true.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every selfspec module (or package) that ``path`` imports, lazily or not."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "selfspec")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "selfspec":
                continue
            for alias in node.names:  # `from . import kernels` imports a submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    found.discard(name)
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYERS, f"{module}: its top-level name {top!r} is in no declared layer; add it to LAYERS"
    return LAYERS.index(top)


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_in_a_layer():
    for module in _graph():
        _layer(module)


def test_imports_point_down():
    upward = {
        (mod, dep)
        for mod, deps in _graph().items()
        for dep in deps
        if mod != "selfspec" and _layer(dep) > _layer(mod)
    }
    assert upward - KNOWN_UPWARD == set(), "upward imports (a lower layer importing a higher one)"
    assert KNOWN_UPWARD - upward == set(), "KNOWN_UPWARD lists imports that are gone: remove them"


def test_no_import_cycles():
    graph = _graph()
    # packages import their __init__ implicitly; only edges between modules count.  The known upward
    # imports are left out here (they are listed, with their TODO, above; they do close a cycle).
    graph = {
        m: {d for d in deps if d != "selfspec" and (m, d) not in KNOWN_UPWARD}
        for m, deps in graph.items()
        if m != "selfspec"
    }
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The parser must catch an import inside a function, and resolve `..` correctly."""
    src = PACKAGE / "cli" / "main.py"
    assert "selfspec.model.models" in _imports(src)  # only imported inside the command functions
    assert "selfspec.core.kernels" in _imports(PACKAGE / "arch" / "adapters.py")  # `from ..core import kernels`
