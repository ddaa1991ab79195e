"""The house has three floors and imports only run downwards (docs/architecture.md, "Layout and
floors"):

    floor 3  tools    profiles/, bench/, toolkit/ (what the tools share), dualpace_cli/
    floor 2  daemons  gpu_service/, cpu_service/, router/   (never import one another)
                      dynamo_worker/ (a node as a Dynamo worker; a shell like them)
    floor 1  core     dualpace/

Read from the sources with ast (nothing is imported), counting every import: at module
level, inside functions and under TYPE_CHECKING alike, since each is an edge a reader must
follow. A re-export is an edge too. Besides the floors: no import cycles (between modules,
and between top-level packages), no protobuf module outside the wire, the servicers, the
client handles and the entry points, and no torch in the router or the policy."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "dualpace": 1,
    "gpu_service": 2, "cpu_service": 2, "router": 2, "dynamo_worker": 2,
    "toolkit": 3, "profiles": 3, "bench": 3, "dualpace_cli": 3,
}
DAEMONS = ("gpu_service", "cpu_service", "router", "dynamo_worker")
# `python -m dualpace` has to sit in the core's folder, but it only starts the CLI: it belongs
# to the tools floor (nothing imports it, so it cannot close a loop).
FLOOR_OF_MODULE = {"dualpace.__main__": 3}
# The project's protobuf modules (dualpace.wire.v1.*_pb2, *_pb2_grpc) stay behind the wire:
PROTOBUF_PACKAGE = "dualpace.wire.v1"
PROTOBUF_ALLOWED = (
    "dualpace.wire.*",                    # conversion protobuf <-> core types
    "dualpace.serve.engine_servicer",     # servicers
    "gpu_service.assist_servicer",
    "router.service",
    "router.engines",                     # client handles. Engine: the router's (typed, async),
    "toolkit.engine_client",              # the tools' and tests' (sync),
    "dualpace.serve.kv_transport",        # an engine's ImportKv stream to another;
    "dualpace.serve.kv_shm_transport",    # the same stream carrying only control on one host;
    "cpu_service.assist_client",          # Assist;
    "dualpace_cli.client",                # Router: `dualpace client`, `dualpace-router placement`,
    "router.placement_cli",
    "dynamo_worker.router_client",        # the Dynamo worker's (typed, async),
    "dynamo_worker.engine_client",        # and its engines' KV events,
    "bench.load.generator",               # the load generator (and its conversation driver),
    "bench.load.conversations",           # and the soak, whose client sends
    "bench.soak_client",                  # malformed requests on purpose
    "bench.soak",
    "bench.soak_chaos",                   # and its chaos: a stalled raw Assist stream, an oversized raw prompt
    "dualpace.serve.engine_daemon",       # daemon entry points (the two engines share one)
    "gpu_service.__main__",
    "cpu_service.__main__",
    "router.__main__",
)

# The router, the pure policy and the Dynamo worker never load torch (they hold no weights).
TORCH_FREE = ("router.*", "dualpace.policy.*", "dynamo_worker.*")
# ...except one edge: the router's entry point reads the model's tokenizer and shape through
# dualpace.model.loader, whose HF and GGUF config readers share modules with the weight
# loaders (torch). Splitting those is left for after the CPU-kernel work in dualpace/model/.
TORCH_EDGES_NOT_FOLLOWED = {("router.__main__", "dualpace.model.loader")}


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _in_tree(name: str) -> str | None:
    """The module of the tree that `import name` loads last (a.b.c -> a.b when c is a name)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str) -> set[str]:
    """Every dotted name `module` imports (absolute; relative imports resolved)."""
    path = modules()[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@cache
def edges() -> dict[str, set[str]]:
    graph = {}
    for module in modules():
        targets = {_in_tree(name) for name in imported_names(module)}
        graph[module] = {target for target in targets if target and target != module}
    return graph


def floor(module: str) -> int:
    return FLOOR_OF_MODULE.get(module, FLOORS[module.split(".")[0]])


def _matches(module: str, patterns) -> bool:
    return any(module == p or (p.endswith(".*") and (module + ".").startswith(p[:-1])) for p in patterns)


def test_imports_run_only_downwards():
    upward = sorted(f"{m} (floor {floor(m)}) -> {t} (floor {floor(t)})"
                    for m, targets in edges().items() for t in targets if floor(t) > floor(m))
    assert upward == []


def test_daemons_never_import_one_another():
    across = sorted(f"{m} -> {t}" for m, targets in edges().items() for t in targets
                    if m.split(".")[0] in DAEMONS and t.split(".")[0] in DAEMONS
                    and m.split(".")[0] != t.split(".")[0])
    assert across == []


def _is_protobuf(name: str) -> bool:
    """An import that reaches the generated modules: the package itself (`from dualpace.wire import
    v1` then `v1.engine_pb2`) or anything under it."""
    return name == PROTOBUF_PACKAGE or name.startswith(PROTOBUF_PACKAGE + ".")


def test_protobuf_modules_stay_behind_the_wire():
    leaks = sorted(f"{m} imports {name}" for m in modules() if not _matches(m, PROTOBUF_ALLOWED)
                   for name in imported_names(m) if _is_protobuf(name))
    assert leaks == []


def test_router_and_policy_never_import_torch():
    """Directly or through anything of the tree they import, package __init__ files included
    (importing a.b.c runs a/__init__ and a/b/__init__ first)."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(t for t in edges()[module] if (module, t) not in TORCH_EDGES_NOT_FOLLOWED)
                todo.extend(".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 1))
        return seen

    offenders = sorted(f"{start}: {m} imports torch" for start in modules() if _matches(start, TORCH_FREE)
                       for m in reach(start)
                       if any(name == "torch" or name.startswith("torch.") for name in imported_names(m)))
    assert offenders == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components with more than one member (the cycles)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return sorted(found)


def test_no_import_cycle_between_modules():
    assert _strongly_connected(edges()) == []


def test_no_import_cycle_between_top_level_packages():
    def package(module: str) -> str:
        return module if module in FLOOR_OF_MODULE else module.split(".")[0]

    packages = {}
    for module, targets in edges().items():
        packages.setdefault(package(module), set()).update(package(t) for t in targets)
    for package, targets in packages.items():
        targets.discard(package)
    assert _strongly_connected(packages) == []


def test_the_checks_see_what_they_should():
    """The graph is read from the tree, not empty: known edges of each kind are there."""
    graph = edges()
    assert "dualpace.engine.core" in graph["dualpace.engine.loop"]
    assert "dualpace.policy.admission" in graph["router.router_core"]
    assert _matches("router.relay", TORCH_FREE) and not _matches("routerx", TORCH_FREE)
    assert "dualpace.wire.v1.engine_pb2" in imported_names("dualpace.wire.kv_events")
    assert _is_protobuf("dualpace.wire.v1") and _is_protobuf("dualpace.wire.v1.engine_pb2")
    assert not _is_protobuf("dualpace.wire.kv_events") and not _is_protobuf("dualpace.wire.v10")
    assert not _matches("dualpace.serve.kv_events_stream", PROTOBUF_ALLOWED)  # it yields core events
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_LINES = 400


def test_no_hand_written_python_file_over_400_lines():
    """Generated protobuf modules (*_pb2.py, *_pb2_grpc.py) excepted; tests count too."""
    paths = [path for package in (*FLOORS, "tests") for path in (ROOT / package).rglob("*.py")
             if "_pb2" not in path.name]
    too_long = sorted(f"{path.relative_to(ROOT)}: {num_lines}" for path in paths
                      if (num_lines := len(path.read_text().splitlines())) > MAX_LINES)
    assert too_long == []
