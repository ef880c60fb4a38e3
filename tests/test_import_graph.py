"""The package's structure, drawn from its own imports: no import circle anywhere in `iterserve`,
and the engine and the runner import nothing CPU- or CUDA-specific (that is the platform's job).

Read from the source with `ast` (every `import` / `from ... import` at any depth of a module,
function bodies and `if TYPE_CHECKING:` blocks included, so a circle cannot hide in a function-level
or type-only import), not by importing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import iterserve

ROOT = Path(iterserve.__file__).resolve().parent
DEVICE_SPECIFIC = ("iterserve.platform.cpu", "iterserve.platform.cuda", "iterserve.platform.cpu_kernels",
                   "iterserve.platform.cpu_linear", "iterserve.attention.cpu_backend",
                   "iterserve.attention.triton_backend", "iterserve.cpu_info")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the iterserve modules it imports (a `from pkg import name` counts as pkg.name when
    that is a module, else as pkg)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_is_read_correctly():
    graph = import_graph()
    assert "iterserve.platform.selector" in graph["iterserve.engine"]
    assert "iterserve.attention.metadata" in graph["iterserve.runner"]
    assert "iterserve.server.cli_serve" in graph["iterserve.cli"]  # `from iterserve.server import cli_serve`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_attention_metadata_imports_nothing_from_iterserve():
    assert import_graph()["iterserve.attention.metadata"] == set()


def test_engine_and_runner_import_nothing_device_specific():
    graph = import_graph()
    for mod in ("iterserve.engine", "iterserve.runner"):
        bad = sorted(d for d in graph[mod] if d.startswith(DEVICE_SPECIFIC))
        assert not bad, f"{mod} imports {bad}"


def test_no_import_module():
    """No import by name (importlib.import_module), which the graph above could not see."""
    for path in ROOT.rglob("*.py"):
        assert "import_module" not in path.read_text(), path
