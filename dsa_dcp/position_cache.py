"""Position-indexed caches (``[B, T, ...]``, ``[B, H, T, D]``) split over a DCP group.

A model written elsewhere keeps its KV per request: ``cache[b, ..., p, ...]`` is position ``p``
of request ``b`` along one position dim. Under DCP the position dim is split by the slot
ownership rule (``dsa_dcp.slots``): position ``p`` lives on rank ``(p // I) % N`` at local
position ``local_row(p)``. The global length ``T`` must be a multiple of ``N * I``, so every rank
holds exactly ``T / N`` positions and the flat slot ``b * T + p`` of the cache seen as a pool
follows the same rule (what ``ops_positions`` relies on).

The model's code indexes the cache with global positions and builds dense ``[.., T]`` scores
over it, so dynamo must trace it against the global shape. A rank's cache is therefore a
``PositionShardedCache``: a tensor subclass that reports the global shape but owns only the
rank's ``T / N`` positions (``.local``). It is meant to be read and written only by a program
the DCP passes rewrote (every use becomes an op on ``.local``); any op that reaches it outside
such a program (eager code, a pass that did not rewrite a use) raises instead of computing on
positions the rank does not hold.

``allocate_position_cache(shape, dim, dcp_size=N)`` gives a rank its share of a cache of global
``shape``; ``shard_position_caches(module, names, dcp_size=N)`` replaces a plain model's cache
buffers by such caches.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map


@dataclasses.dataclass(frozen=True)
class PositionLayout:
    """How a cache's position dim maps global positions to the rank's local ones."""

    length: int  # global positions T
    dim: int  # the position dim
    dcp_size: int
    interleave: int

    @property
    def local_length(self) -> int:
        return self.length // self.dcp_size


class PositionShardedCache(torch.Tensor):
    """A rank's share of a position-indexed cache: the global shape, the rank's positions only.

    ``.local`` holds positions ``p`` with ``(p // I) % N == rank`` at ``local_row(p)`` along
    ``dcp_layout.dim``. Dynamo traces the model against the global shape; the DCP passes turn every
    use into an op on ``.local`` (``local_positions(cache)`` in the rewritten graph).
    """

    local: torch.Tensor
    dcp_layout: PositionLayout

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: PositionLayout):
        shape = list(local.shape)
        shape[layout.dim] = layout.length
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)

    def __init__(self, local: torch.Tensor, layout: PositionLayout):
        self.local = local
        self.dcp_layout = layout  # (``layout`` is taken: torch.strided)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # noqa: D105
        return (f"PositionShardedCache(global {list(self.shape)}, local {list(self.local.shape)}, "
                f"dim={self.dcp_layout.dim}, dcp_size={self.dcp_layout.dcp_size}, interleave={self.dcp_layout.interleave})")

    def __tensor_flatten__(self):
        return ["local"], self.dcp_layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return PositionShardedCache(inner["local"], layout)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shards = [a for a in list(args) + list(kwargs.values()) if isinstance(a, PositionShardedCache)]
        if all(s.dcp_layout.dcp_size == 1 for s in shards) or func in _POSITIONLESS:
            # a group of one holds every position: the op runs on the local tensor, as written (so
            # does an op that touches every position alike)
            out = func(*tree_map(local_positions, args), **tree_map(local_positions, kwargs))
            return args[0] if func._schema.is_mutable and isinstance(args[0], PositionShardedCache) else out
        if not all(_dynamo_fake(s.local) for s in shards):
            raise RuntimeError(
                f"{func} reached a DCP position cache ({shards[0]!r}) outside a program the dsa_dcp passes "
                f"rewrote: the rank holds 1/{shards[0].dcp_layout.dcp_size} of its positions, so the model's code "
                f"cannot run on it as written (eagerly, or compiled by another backend). Run the model through "
                f"torch.compile(backend='dsa_dcp', options={{'dcp_size': {shards[0].dcp_layout.dcp_size}, ...}}, "
                f"fullgraph=True). A transformers model's generate() calls the model itself, so a compiled "
                f"wrapper's generate (compiled = torch.compile(model, ...); compiled.generate(...)) runs it "
                f"uncompiled: compile the model in place, model.compile(backend='dsa_dcp', options=...), and call "
                f"model.generate(...). If this is an operation on the cache outside the model's step "
                f"(transformers' generate crops or reorders its caches for assisted decoding and beam search), a "
                f"DCP cache does not support it, except beam search's reorder_cache on a DCPStaticCache")

        # While dynamo traces (fake tensors): the model's ops see a global-shaped stand-in, so
        # shapes propagate as on one device; the passes rewrite every such use before it runs.
        def stand_in(a):
            if isinstance(a, PositionShardedCache):
                return torch.empty(a.shape, dtype=a.dtype, device=a.device)
            return a

        out = func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
        if func._schema.is_mutable:  # in place: the cache itself
            return args[0]
        return out


# ops whose effect does not depend on which positions a rank holds: run on the local part (a cache's
# reset: transformers' ``StaticLayer.reset`` zeroes its keys and values)
_POSITIONLESS = {torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar}


def _dynamo_fake(local: torch.Tensor) -> bool:
    """``local`` is a fake tensor of dynamo's tracing, where only shapes flow. AOT autograd's tracing
    (another backend, or Inductor given the cache itself) wraps it in a functional tensor: there
    the stand-in would compile into the program, so it is refused like an eager call."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return torch._subclasses.fake_tensor.is_fake(local) and not isinstance(local, FunctionalTensor)


def local_positions(cache: torch.Tensor) -> torch.Tensor:
    """The positions this rank holds (``cache.local``); a plain tensor is its own local part.

    The DCP passes call this in the rewritten graph, so every read and write goes to local storage.
    """
    return cache.local if isinstance(cache, PositionShardedCache) else cache


def position_layout(cache: object) -> PositionLayout | None:
    """The layout of a ``PositionShardedCache`` (``None`` for anything else)."""
    return cache.dcp_layout if isinstance(cache, PositionShardedCache) else None


def round_up_length(length: int, dcp_size: int, interleave: int = 1) -> int:
    """The smallest multiple of ``dcp_size * interleave`` that is >= ``length``."""
    block = dcp_size * interleave
    return -(-length // block) * block


def check_length(length: int, dcp_size: int, interleave: int = 1) -> None:
    """Raise ``ValueError`` unless ``length`` splits into whole interleave blocks on every rank."""
    if dcp_size < 1 or interleave < 1 or length < 1 or length % (dcp_size * interleave):
        raise ValueError(
            f"a position cache of {length} positions cannot be split over dcp_size={dcp_size} with "
            f"interleave={interleave}: the length must be a multiple of dcp_size * interleave = "
            f"{dcp_size * interleave} (e.g. {round_up_length(max(length, 1), dcp_size, interleave)})")


def allocate_position_cache(shape, dim: int, *, dcp_size: int = 1, interleave: int = 1,
                            dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache of global ``shape`` whose position dim ``dim`` is split for this rank.

    A ``PositionShardedCache`` whose ``.local`` has ``shape[dim] / dcp_size`` positions (the global
    length must be a multiple of ``dcp_size * interleave``). With ``dcp_size == 1`` it holds every
    position and runs any op as a plain tensor would (eagerly, or compiled by any backend); it stays
    a position cache so that ``backend="dsa_dcp"`` finds it and attends over the top-k alone.
    """
    layout = _layout(shape, dim, dcp_size, interleave)
    local_shape = list(shape)
    local_shape[layout.dim] = layout.local_length
    return PositionShardedCache(torch.zeros(local_shape, dtype=dtype, device=device), layout)


def as_position_cache(cache: torch.Tensor, dim: int, *, dcp_size: int = 1, interleave: int = 1) -> torch.Tensor:
    """``cache`` (a whole cache, as a model allocated it) as this rank's position cache: with
    ``dcp_size == 1`` the same memory, wrapped; otherwise a zeroed share (``allocate_position_cache``)
    of the same shape, dtype and device, and the caller drops the whole one."""
    if dcp_size == 1:
        return PositionShardedCache(cache, _layout(cache.shape, dim, 1, interleave))
    return allocate_position_cache(cache.shape, dim, dcp_size=dcp_size, interleave=interleave, dtype=cache.dtype,
                                   device=cache.device)


def _layout(shape, dim: int, dcp_size: int, interleave: int) -> PositionLayout:
    shape = list(shape)
    dim = dim % len(shape)
    if dim == 0:
        raise ValueError("the position dim of a cache cannot be dim 0 (the batch dim)")
    check_length(shape[dim], dcp_size, interleave)
    return PositionLayout(length=shape[dim], dim=dim, dcp_size=dcp_size, interleave=interleave)


def shard_position_caches(module: nn.Module, names: tuple[str, ...] = ("kv_cache", "pe_cache"), *, dim: int = 1,
                          dcp_size: int, interleave: int = 1) -> list[str]:
    """Replace every buffer of ``module`` named one of ``names`` by this rank's share of it.

    For a plain model whose caches are buffers (DeepSeek's published code: ``kv_cache[B, T, Dc]``,
    ``pe_cache[B, T, Dr]``): each becomes ``allocate_position_cache`` of the same global shape,
    dtype and device, split along ``dim``; the global buffer is freed as it is replaced. Call it
    after moving or casting the model. Returns the qualified names replaced (an error if none).
    """
    replaced = []
    for mod_name, mod in module.named_modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if name not in names or buf is None:
                continue
            persistent = name not in mod._non_persistent_buffers_set
            local = allocate_position_cache(buf.shape, dim, dcp_size=dcp_size, interleave=interleave,
                                            dtype=buf.dtype, device=buf.device)
            mod.register_buffer(name, local, persistent=persistent)
            replaced.append(f"{mod_name}.{name}" if mod_name else name)
    if not replaced:
        raise ValueError(f"no buffer named {list(names)} in {type(module).__name__}")
    return replaced
