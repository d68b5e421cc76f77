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


# ---- one caller of the device -------------------------------------------------------------------
DEVICE_MODULES = ("infernix_jax.cache.device", "infernix_jax.engine.steps")
RUNNER = "infernix_jax.engine.runner"


def _device_functions() -> dict[str, set[str]]:
    """Per module of DEVICE_MODULES, its functions that run on the device: the jitted ones and
    those taking the KV pool (`kv`) first."""
    import importlib
    import inspect
    out = {}
    for name in DEVICE_MODULES:
        mod = importlib.import_module(name)
        out[name] = {n for n, f in vars(mod).items() if hasattr(f, "lower") or (
            inspect.isfunction(f) and f.__module__ == name and list(inspect.signature(f).parameters)[:1] == ["kv"])}
    return out


def _device_callers(name: str, source: str, path_is_init: bool, fns: dict[str, set[str]]) -> list[str]:
    """The device functions (fns) module `name` uses: imported by name, or through the module."""
    package = name.split(".") if path_is_init else name.split(".")[:-1]
    aliases, used = {}, []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in fns})
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(package[:len(package) - node.level + 1] + [node.module] * bool(node.module)) \
                if node.level else node.module
            for a in node.names:
                if stem in fns and a.name in fns[stem]:
                    used.append(f"{stem}.{a.name}")
                elif f"{stem}.{a.name}" in fns:
                    aliases[a.asname or a.name] = f"{stem}.{a.name}"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr in fns[aliases[node.value.id]]:
            used.append(f"{aliases[node.value.id]}.{node.attr}")
    return used


def test_the_device_caller_finder_finds_callers():
    fns = _device_functions()
    assert {"read_blocks", "write_rows", "copy_blocks", "take_snapshot", "restore_snapshot"} <= \
        fns["infernix_jax.cache.device"] and {"mixed_step", "decode_steps"} <= fns["infernix_jax.engine.steps"]
    assert "exact_pieces" not in fns["infernix_jax.cache.device"]
    src = "from ..cache import device\nfrom .steps import mixed_step, bucket\ndevice.copy_blocks(kv, [])\ndevice.CHUNK"
    assert _device_callers("infernix_jax.engine.x", src, False, fns) == [
        "infernix_jax.engine.steps.mixed_step", "infernix_jax.cache.device.copy_blocks"]


def test_only_the_runner_calls_the_device():
    """Jitted steps, block moves and state snapshots run through engine/runner.py alone (which
    replays them on the other hosts of a multi-host run)."""
    fns, mods = _device_functions(), _modules()
    callers = {m: used for m, p in mods.items() if m.split(".")[0] in ("infernix_jax", "server")
               and m not in (RUNNER, *DEVICE_MODULES)
               and (used := _device_callers(m, p.read_text(), p.name == "__init__.py", fns))}
    assert callers == {}


# ---- every weight declared once -------------------------------------------------------------------
def test_every_declared_weight_has_one_role():
    """models/roles.py says what each weight is (axes, quantized, fused); every weight any preset
    declares (with biases, MTP layers and an untied head too) has a role there, and the tables the
    engine reads are derived from it."""
    import dataclasses
    from infernix_jax.config import PRESETS
    from infernix_jax.models.params import declare_params
    from infernix_jax.models.roles import BIAS, FUSED, PARAM_AXES, QUANTIZABLE, ROLES
    names, families = set(), set()

    def walk(tree):
        for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            if isinstance(v, (dict, list)):
                walk(v)
            else:
                names.add(k)
    for cfg in PRESETS.values():
        families.add(cfg.family)
        for extra in ({}, {"qkv_bias": True, "o_bias": True, "qk_norm": True, "mtp_layers": 1,
                           "tie_word_embeddings": False}):
            walk(declare_params(dataclasses.replace(cfg, **extra)))
    assert {"llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"} <= families
    assert names - ROLES.keys() == set()
    assert FUSED == {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"), "s_gate_up": ("s_gate", "s_up")}
    assert BIAS == {"wqkv": ("bqkv", ("bq", "bk", "bv"))}
    assert {"wq", "wqkv", "lin_qkv", "w_down"} <= QUANTIZABLE and not {"embed", "router", "attn_norm"} & QUANTIZABLE
    assert PARAM_AXES["wk"] == ("kv_heads", "embed") and "lin_qkv" not in PARAM_AXES
