"""The package's shape: imports go one way (scripts -> server -> infernix_jax -> pallas_kernels) and
no module reaches, directly or round a circle, back into itself. Imports inside functions count: a
lazy import only hides a circle from the interpreter, not from the reader."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("scripts", "server", "infernix_jax", "pallas_kernels")     # each may import only those after it


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYERS:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (a name imported from a package is
    the submodule when there is one, else the package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(package[:len(package) - node.level + 1] + [node.module] * bool(node.module)) \
                if node.level else node.module
            targets = [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_circle_finder_finds_circles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _circles(g) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_imports_go_one_way():
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    graph = _graph()
    assert len(graph) > 100, "the walk found the package's modules"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if rank[d.split(".")[0]] < rank[m.split(".")[0]])
    assert upward == []
