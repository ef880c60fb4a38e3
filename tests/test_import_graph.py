"""The package's structure, drawn from its own imports: no import circle anywhere in `iterserve`, no
two packages that import each other, and the serving path (engine, runner, scheduler, model, LoRA,
speculative decoding, server...) reaches nothing CPU- or CUDA-specific, directly or through another
package, except through the platform's one door (`platform/selector.py`): that is the platform's job.

Read from the source with `ast` (every `import` / `from ... import` at any depth of a module,
function bodies and `if TYPE_CHECKING:` blocks included, so a circle cannot hide in a function-level
or type-only import), not by importing.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import iterserve

ROOT = Path(iterserve.__file__).resolve().parent
DEVICE_SPECIFIC = ("iterserve.platform.cpu", "iterserve.platform.cuda", "iterserve.platform.cpu_kernels",
                   "iterserve.platform.cpu_linear", "iterserve.attention.cpu_backend",
                   "iterserve.attention.triton_backend", "iterserve.cpu_info")
DOOR = "iterserve.platform.selector"  # the one way in to the device-specific modules: get_platform()
# the serving path: none of these may reach DEVICE_SPECIFIC but through DOOR (the tools, bench/ and sim/,
# may: they describe the machine they measure)
SERVING = ("iterserve.engine", "iterserve.runner", "iterserve.llm", "iterserve.engine_args", "iterserve.config",
           "iterserve.request", "iterserve.sampling", "iterserve.rejection_sampler", "iterserve.pooling",
           "iterserve.core", "iterserve.model", "iterserve.lora", "iterserve.spec_decode", "iterserve.structured",
           "iterserve.server", "iterserve.serve_ray")
# who may import the C++ kernels' loader: the platform, and the attention backends it selects
KERNEL_LOADER = "iterserve.platform.cpu_kernels"
KERNEL_LOADER_USERS = ("iterserve.platform.", "iterserve.attention.cpu_backend", "iterserve.attention.triton_backend")


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


def reachable(graph: dict[str, set[str]], start: str, door: str) -> dict[str, str | None]:
    """Every module `start` imports, directly or through others, without passing through `door`:
    module -> the module importing it on a shortest path from `start` (None for `start`)."""
    parent: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for dep in sorted(graph.get(node, ())):
            if dep not in parent and dep != door:
                parent[dep] = node
                todo.append(dep)
    return parent


def device_leaks(graph: dict[str, set[str]], start: str, door: str = DOOR) -> list[list[str]]:
    """The import chains from `start` to a device-specific module that do not go through `door`."""
    parent = reachable(graph, start, door)
    chains = []
    for mod in sorted(m for m in parent if m.startswith(DEVICE_SPECIFIC)):
        chain = [mod]
        while (up := parent[chain[-1]]) is not None:
            chain.append(up)
        chains.append(chain[::-1])
    return chains


def unit(module: str) -> str:
    """The package a module belongs to (iterserve.core.scheduler -> iterserve.core); a top-level module
    is a unit of its own (iterserve.runner)."""
    return ".".join(module.split(".")[:2])


def mutual_units(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Pairs of units that import each other -> an import of each direction ("a imports b")."""
    edges: dict[tuple[str, str], str] = {}
    for mod in sorted(graph):
        for dep in sorted(graph[mod]):
            if unit(mod) != unit(dep):
                edges.setdefault((unit(mod), unit(dep)), f"{mod} imports {dep}")
    return {(a, b): [why, edges[(b, a)]] for (a, b), why in sorted(edges.items()) if a < b and (b, a) in edges}


def test_the_graph_is_read_correctly():
    graph = import_graph()
    assert "iterserve.platform.selector" in graph["iterserve.engine"]
    assert "iterserve.attention.metadata" in graph["iterserve.runner"]
    assert "iterserve.server.cli_serve" in graph["iterserve.cli"]  # `from iterserve.server import cli_serve`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_checks_catch_what_they_look_for():
    """On made-up graphs: a module reaching the kernels through a second package is caught (with
    its chain), the same reached through the door is not; two packages importing each other are
    caught even where no module circle exists."""
    leak = {"iterserve.engine": {"iterserve.lora.layers", DOOR}, "iterserve.lora.layers": {KERNEL_LOADER},
            DOOR: {"iterserve.platform.cpu"}, "iterserve.platform.cpu": {KERNEL_LOADER}, KERNEL_LOADER: set()}
    assert device_leaks(leak, "iterserve.engine") == [["iterserve.engine", "iterserve.lora.layers", KERNEL_LOADER]]
    leak["iterserve.engine"] = {DOOR}
    assert device_leaks(leak, "iterserve.engine") == []
    pair = {"iterserve.a.x": {"iterserve.b.y"}, "iterserve.b.y": {"iterserve.a.z"}, "iterserve.a.z": set(),
            "iterserve.c": {"iterserve.a.x"}}
    assert find_cycle(pair) is None
    assert mutual_units(pair) == {("iterserve.a", "iterserve.b"): ["iterserve.a.x imports iterserve.b.y",
                                                                   "iterserve.b.y imports iterserve.a.z"]}
    assert unit("iterserve.runner") == "iterserve.runner" and unit("iterserve.model.families.llama") == "iterserve.model"


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


def test_serving_path_reaches_nothing_device_specific_but_through_the_platform():
    """Transitively: an engine that imported lora/ which imported the C++ kernels would pass the
    direct check above; this one cuts the graph at the platform's door and follows every import."""
    graph = import_graph()
    serving = [m for m in graph if m.startswith(tuple(p + "." for p in SERVING)) or m in SERVING]
    assert "iterserve.engine" in serving and "iterserve.lora.layers" in serving
    leaks = [" -> ".join(chain) for mod in sorted(serving) for chain in device_leaks(graph, mod)]
    assert not leaks, "reached without the platform:\n" + "\n".join(leaks)


def test_only_the_platform_loads_the_cpu_kernels():
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if KERNEL_LOADER in deps)
    assert users, "no module imports the kernels' loader: is KERNEL_LOADER still its name?"
    assert [m for m in users if not m.startswith(KERNEL_LOADER_USERS)] == []


def test_no_two_packages_import_each_other():
    """Package by package (a top-level module counts as one): an import in one direction only, so
    each package can be read, and tested, on top of the ones it imports."""
    pairs = mutual_units(import_graph())
    assert not pairs, "packages importing each other:\n" + "\n".join(
        f"{a} <-> {b}: {why[0]}; {why[1]}" for (a, b), why in pairs.items())


def test_no_import_module():
    """No import by name (importlib.import_module), which the graph above could not see."""
    for path in ROOT.rglob("*.py"):
        assert "import_module" not in path.read_text(), path


def test_a_command_line_imports_only_its_own_commands_module():
    """`iterserve serve ...` builds the serve parser alone (cli.COMMANDS): the measuring tools' modules
    and their libraries (httpx, tqdm, the report templates) stay out of the server's memory, while
    `--help` still lists every command. In a fresh interpreter: this one has imported them already."""
    import subprocess
    import sys

    code = ("import sys; from iterserve.cli import build_parser; build_parser('serve'); "
            "print(sorted(m for m in sys.modules if m.startswith(('iterserve.bench', 'iterserve.sim', 'httpx', "
            "'tqdm')))); print(sorted(build_parser()._subparsers._group_actions[0].choices))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == str(sorted(["generate", "serve", "bench", "compare", "probe", "tune", "profile", "simulate",
                                 "plan"]))
