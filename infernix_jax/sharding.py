"""Several devices through JAX's own sharding (XLA SPMD; NCCL between GPUs): a mesh, one table of
rules from logical axis names to mesh axes, and the logical axes of every weight, KV pool and state
pool array. Model code names logical axes only (`constrain`); nothing else here knows a family.

Mesh axes: "expert" (expert parallel, M) x "tensor" (tensor parallel, N), M x N devices.
  - tensor parallel: attention heads and the MLP's hidden units split over "tensor" (Megatron
    style: column-parallel q/k/v and gate/up, row-parallel o and down, one all-reduce each), the
    vocabulary too (LM head, embeddings, sampling's logits); KV heads split when there are at least
    as many as devices, else replicated (each device keeps the KV heads its query heads read).
  - expert parallel: routed experts split over "expert"; everything else is replicated over it.
A dimension is split only where the mesh axis divides it; otherwise it stays whole (replicated):
GSPMD's results do not depend on the shardings, only its communication does."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TENSOR, EXPERT = "tensor", "expert"

# logical axis -> mesh axis (None: replicated)
RULES = {
    "batch": None, "seq": None, "embed": None,
    "heads": TENSOR, "kv_heads": TENSOR, "ffn": TENSOR, "vocab": TENSOR,
    "experts": EXPERT,
}

# the logical axes of each weight: its role (models/roles.py); weights without axes (norms, routers,
# Gated DeltaNet's projections) are replicated
# KV pool arrays: [nKV, P, bs, hd'] pools, [nKV, P, bs] scales / row bases, [nKV, P, E] escapes
KV_AXES = ("kv_heads", None, None, None)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How many devices split what: tensor (heads, FFN, vocabulary) x expert (routed experts)."""
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        if self.tensor < 1 or self.expert < 1:
            raise ValueError(f"--tensor-parallel and --expert-parallel must be >= 1 (got {self.tensor}, {self.expert})")

    @property
    def devices(self) -> int:
        return self.tensor * self.expert

    def __bool__(self) -> bool:
        return self.devices > 1

    @property
    def sizes(self) -> dict:
        """The mesh's axis sizes."""
        return {EXPERT: self.expert, TENSOR: self.tensor}

    def kv_split(self, num_kv_heads: int) -> int:
        """Into how many pieces the KV pool is split (its heads over "tensor" where they divide)."""
        return self.tensor if num_kv_heads % self.tensor == 0 else 1

    def describe(self) -> str:
        return f"{self.devices} devices (tensor parallel {self.tensor} x expert parallel {self.expert})"


def make_mesh(par: Parallel, devices=None) -> Mesh:
    """A ("expert", "tensor") mesh over the first par.devices devices (all processes' devices in a
    multi-host run); a clear error when there are fewer."""
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < par.devices:
        raise ValueError(f"--tensor-parallel {par.tensor} x --expert-parallel {par.expert} needs {par.devices} "
                         f"devices; {len(devs)} visible ({devs[0].platform})")
    return Mesh(np.asarray(devs[:par.devices]).reshape(par.expert, par.tensor), (EXPERT, TENSOR))


def spec(axes: tuple, shape: tuple, sizes: dict, units: dict | None = None) -> P:
    """Logical axes of an array of `shape` -> its PartitionSpec on a mesh of axis sizes `sizes`: each
    dimension on its rule's mesh axis where that axis divides it (and is not used twice). units:
    logical axis -> how many whole units a dimension of that axis holds (a weight's rows hold
    heads x head_dim values: split only between heads, so by the head count)."""
    out, used = [], set()
    for name, n in zip(axes, shape):
        m = RULES.get(name) if name else None
        u = (units or {}).get(name, n)
        if m is None or m not in sizes or m in used or sizes[m] == 1 or n % sizes[m] or u % sizes[m]:
            out.append(None)
        else:
            out.append(m)
            used.add(m)
    return P(*out, *([None] * (len(shape) - len(out))))


def _sizes(mesh) -> dict:
    return dict(mesh.shape)


def _traced_sizes() -> dict:
    """The axis sizes of the mesh of several devices a step is traced on (`use`); {} without one."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh is None or mesh.empty else _sizes(mesh)
    return sizes if math.prod(sizes.values()) > 1 else {}


def active() -> bool:
    """Whether a step is being traced on a mesh of several devices (`use`)."""
    return bool(_traced_sizes())


def constrain(x, *axes):
    """x's sharding as its logical axes say, inside a step traced under a mesh (`use`); unchanged
    without one. The model code's only word on placement."""
    sizes = _traced_sizes()
    return jax.lax.with_sharding_constraint(x, spec(axes, x.shape, sizes)) if sizes else x


def on_heads(fn):
    """fn(q [N, nH, hd], k_pool, v_pool [nKV, ...], *replicated, **pool arrays and statics), a
    kernel that XLA cannot split (a Pallas call: GSPMD would gather its whole operands onto every
    device), run per device on its own heads under a mesh whose "tensor" axis divides both head
    counts: query heads and the pools' KV heads (and their scales / escapes) split alike, so each
    device's GQA groups stay whole. Otherwise fn itself."""
    def call(q, k_pool, v_pool, *rest, **kw):
        tp = _traced_sizes().get(TENSOR, 1)
        if tp == 1 or q.shape[1] % tp or k_pool.shape[0] % tp:
            return fn(q, k_pool, v_pool, *rest, **kw)
        arrays = {k: v for k, v in kw.items() if hasattr(v, "shape")}
        static = {k: v for k, v in kw.items() if not hasattr(v, "shape")}
        heads, kv = P(None, TENSOR), P(TENSOR)
        local = lambda q, kp, vp, rest, arrays: fn(q, kp, vp, *rest, **arrays, **static)  # noqa: E731
        return jax.shard_map(local, in_specs=(heads, kv, kv, P(), {k: kv for k in arrays}), out_specs=heads,
                             check_vma=False)(q, k_pool, v_pool, rest, arrays)
    return call


def replicated(tree):
    """Every array of tree whole on every device (a step's sampled tokens, which the host reads)."""
    return jax.tree.map(lambda x: constrain(x, *(None,) * x.ndim), tree)


@contextlib.contextmanager
def use(mesh: Mesh | None):
    """Trace and run steps on `mesh` (None: one device, nothing changes)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def weight_axes(name: str, ndim: int) -> tuple:
    """The logical axes of weight `name` with ndim dimensions (replicated if unlisted)."""
    from .models.roles import FUSED, PARAM_AXES        # (here: the models package imports this module)
    if name in FUSED:
        raise ValueError(f"{name} is a fused matrix (models/fuse.py): load the model with fuse=False for "
                         f"tensor parallelism")
    axes = PARAM_AXES.get(name, ())
    return axes if len(axes) == ndim else (None,) * ndim


def units_of(cfg) -> dict:
    """The whole units along a config's flattened weight axes (see spec)."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def _leaf_specs(name: str, leaf, sizes: dict, units: dict):
    """PartitionSpecs of one weight: an array, or a quantized / packed one (QTensor, Packed12), whose
    every array is split along the weight's axes where it has the weight's row / column layout
    (codes, per-row or per-group scales) and the split divides it; others (one scale) replicated."""
    from .quant.formats import QTensor
    from .quant.packed import Packed12
    if isinstance(leaf, (QTensor, Packed12)):
        shape = tuple(leaf.shape)
        axes = weight_axes(name, len(shape))
        def one(a):
            if a is None or not hasattr(a, "shape"):
                return a
            if a.ndim != len(shape):        # a tensor scale, a flat escape list: whole
                return P(*([None] * a.ndim))
            return spec(axes, a.shape, sizes, units)
        return jax.tree.map(one, leaf, is_leaf=lambda a: a is None)
    return spec(weight_axes(name, leaf.ndim), leaf.shape, sizes, units)


def param_specs(params: dict, mesh, cfg) -> dict:
    """The params pytree of a model of config cfg with a PartitionSpec for every array (layers'
    weights by their names); mesh: a Mesh or its axis sizes {axis: size} (planning for devices this
    machine may not have)."""
    sizes = mesh if isinstance(mesh, dict) else _sizes(mesh)
    units = units_of(cfg)

    def walk(tree, name=""):
        if isinstance(tree, dict):
            return {k: walk(v, k) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(walk(v, name) for v in tree)
        return _leaf_specs(name, tree, sizes, units) if hasattr(tree, "shape") else tree
    return walk(params)


def place(a, sharding: NamedSharding):
    """Array a (host or one device's) in its shards. On several hosts each process makes only its
    own shards from its copy (device_put would first check, gathering, that all copies agree)."""
    if jax.process_count() == 1 or (isinstance(a, jax.Array) and not a.is_fully_addressable):
        return jax.device_put(a, sharding)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx], dtype=host.dtype)


def _put(tree, specs, mesh: Mesh):
    return jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)) if isinstance(s, P) else a,
                        tree, specs, is_leaf=lambda x: x is None)


def placer(mesh: Mesh, cfg):
    """place(name, host array) -> the array in its shards on mesh (the loader's, tensor by tensor)."""
    sizes, units = _sizes(mesh), units_of(cfg)
    return lambda name, a: place(a, NamedSharding(mesh, _leaf_specs(name, a, sizes, units)))


def shard_params(params: dict, mesh: Mesh, cfg) -> dict:
    """params placed on the mesh as param_specs says; quantized weights learn how they are split
    (QTensor.split), for split_product."""
    specs = param_specs(params, mesh, cfg)
    return _annotate(_put(params, specs, mesh), specs)


def _annotate(params, specs):
    from .quant.formats import QTensor

    def one(leaf, s):
        if not isinstance(leaf, QTensor) or len(leaf.shape) != 2:
            return leaf
        want = tuple(s.data)                                # (spec writes every dimension)
        alike = all(tuple(p) == _array_split(a, want) for a, p in zip(leaf.arrays, s.arrays) if a.ndim == 2)
        return leaf.replace(split=want if alike and any(want) else ())
    return jax.tree.map(one, params, specs, is_leaf=lambda x: isinstance(x, QTensor))


def _array_split(a, split: tuple) -> tuple:
    """How a 2-D array of a weight split as `split` is split: alike, except a dimension of one (a
    scale per output row, for a weight split along its inputs), which stays whole."""
    return tuple(ax if a.shape[i] > 1 else None for i, ax in enumerate(split))


def local_shape(w) -> tuple:
    """The [N, K] of one device's shard of a quantized weight split as w.split (on the mesh a step
    is traced on; w.shape where it is whole)."""
    sizes = _traced_sizes()
    if not w.split or not sizes:
        return tuple(w.shape)
    return tuple(d // sizes[ax] if ax else d for d, ax in zip(w.shape, w.split))


def split_product(fn, x, w):
    """fn(x [M, K], w) -> [M, N] for a quantized [N, K] weight split over one mesh axis (w.split),
    run per device on its shard (a Pallas kernel, which XLA cannot split): split by output rows
    (column-parallel), each device makes its N / n outputs from the whole x; split along K (row-
    parallel), each multiplies its K / n inputs and the partial products are summed (psum)."""
    rows_ax, cols_ax = w.split
    ax = rows_ax or cols_ax
    local = local_shape(w)
    wspec = jax.tree.map(lambda a: P(*_array_split(a, w.split)) if a.ndim == 2 else P(), w)

    def body(x, w):
        y = fn(x, w.replace(shape=local, split=()))
        return y if rows_ax else jax.lax.psum(y, ax)
    x_spec, out_spec = (P(), P(None, ax)) if rows_ax else (P(None, ax), P())
    return jax.shard_map(body, in_specs=(x_spec, wspec), out_specs=out_spec, check_vma=False)(x, w)


def kv_specs(kv, mesh: Mesh):
    """A PagedKV's PartitionSpecs: pools, scales and escapes split by KV head (see KV_AXES), the
    recurrent state pools (hybrids) and the lost-block flags replicated."""
    sizes = _sizes(mesh)
    head = lambda a: spec(KV_AXES[:a.ndim], a.shape, sizes)  # noqa: E731
    whole = lambda a: P(*([None] * a.ndim))  # noqa: E731
    return kv.replace(
        k=tuple(map(head, kv.k)), v=tuple(map(head, kv.v)), k_scale=tuple(map(head, kv.k_scale)),
        v_scale=tuple(map(head, kv.v_scale)), k_esc=tuple(map(head, kv.k_esc)), v_esc=tuple(map(head, kv.v_esc)),
        conv=tuple(map(whole, kv.conv)), ssm=tuple(map(whole, kv.ssm)),
        lost=None if kv.lost is None else whole(kv.lost))


def make_sharded(make, specs_of, mesh: Mesh | None):
    """make() (arrays from nothing: a zeroed pool) built directly in its shards on mesh, as
    specs_of(its shapes) says: no device ever holds the whole of it (None: one device)."""
    if mesh is None:
        return make()
    specs = specs_of(jax.eval_shape(make), mesh)
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(make, out_shardings=out)()


def split_factor(name: str, shape: tuple, sizes: dict | None, units: dict | None = None) -> int:
    """Into how many pieces the rules split weight `name` of `shape` (1: replicated)."""
    if not sizes:
        return 1
    return math.prod(sizes[a] for a in spec(weight_axes(name, len(shape)), shape, sizes, units) if a is not None)


def bytes_per_device(tree, specs, mesh) -> int:
    """The bytes one device holds of tree placed as specs (mesh: a Mesh or its axis sizes)."""
    sizes = mesh if isinstance(mesh, dict) else _sizes(mesh)
    total = 0
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        n = a.size * a.dtype.itemsize
        for ax in s:
            if ax is not None:
                n //= sizes[ax]
        total += n
    return total


__all__ = ["EXPERT", "KV_AXES", "Parallel", "RULES", "TENSOR", "active", "bytes_per_device", "constrain",
           "kv_specs", "make_mesh", "make_sharded", "on_heads", "place", "placer", "local_shape", "replicated", "split_product", "param_specs", "shard_params", "spec", "split_factor", "units_of", "use", "weight_axes"]
