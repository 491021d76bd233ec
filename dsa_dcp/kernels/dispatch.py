"""Which ``sparse_mla`` backend, and which tiles, to use for a shape: from a measured table.

``dsa-dcp bench kernels --tune --write-table PATH`` times every Triton tile candidate, the Hopper
kernel's split counts (where it runs) and each FlashInfer backend per shape on the machine it
runs on and writes the winners as JSON::

    {"device": "NVIDIA H200", "versions": {...}, "command": "...",
     "entries": [{"H": 64, "B": 1, "K": 2048, "kv": "bf16", "backend": "triton",
                  "graph_backend": "hopper",
                  "tiles": {"block_h": 64, "block_k": 32, "num_warps": 8, "num_stages": 2,
                            "num_splits": 16},
                  "hopper_tiles": {"num_splits": 8}, "us": {...}}, ...]}

``backend`` is the choice for an uncaptured call (``triton``, ``hopper``, ``fa2`` or ``fa3``,
by the op's eager time); ``graph_backend`` the choice inside a CUDA-graph capture (``triton`` or
``hopper``, by the time in a graph: FlashInfer plans on the host and cannot be captured).
``tiles`` are the Triton kernel's launch parameters, ``hopper_tiles`` the Hopper kernel's. An
entry without ``graph_backend`` (older tables) is captured on its ``backend`` when that is
``triton`` or ``hopper``, else on Triton.

The table shipped with the package (``sparse_mla_table.json``) was measured on one H200;
``DSA_DCP_SPARSE_MLA_TABLE`` points at another file. A table is used on the device it was
measured on (same ``torch.cuda.get_device_name()``) and on any device of the same architecture
its optional ``"arch"`` names (``{"capability": [9, 0], "sms": 132}``: compute capability and SM
count, so an H100 SXM takes the H200's table: the same SM, tensor cores and shared memory, only
slower memory); elsewhere, and for head counts or KV dtypes it does not list, :func:`choose`
returns ``None`` and the callers fall back to their heuristics.
A shape between measured ones takes the entry of the nearest measured batch and top-k at or
above it (the largest measured, past the end).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

TABLE_PATH = Path(__file__).with_name("sparse_mla_table.json")
ENV = "DSA_DCP_SPARSE_MLA_TABLE"
BACKENDS = ("triton", "hopper", "fa2", "fa3")
GRAPH_BACKENDS = ("triton", "hopper")  # what can run inside a CUDA-graph capture
TILE_KEYS = ("block_h", "block_k", "num_warps", "num_stages", "num_splits", "key_major", "dc_split")
HOPPER_TILE_KEYS = ("num_splits", "prefetch", "early_s", "block_k")
_NO_TILES = MappingProxyType({})


@dataclass(frozen=True)
class Choice:
    backend: str  # one of BACKENDS: the choice for an uncaptured call
    tiles: MappingProxyType  # Triton launch parameters (TILE_KEYS), read-only (choices are shared)
    graph_backend: str = "triton"  # one of GRAPH_BACKENDS: the choice inside a CUDA-graph capture
    hopper_tiles: MappingProxyType = field(default_factory=lambda: _NO_TILES)  # the Hopper kernel's launch parameters (HOPPER_TILE_KEYS)


def runnable_backend(choice: Choice | None, capturing: bool, flashinfer_ok, hopper_ok) -> str:
    """The backend a call runs: the table's choice for an uncaptured call, its captured choice
    inside a capture (and when FlashInfer, chosen uncaptured, is not usable here); the Triton
    kernel when there is no choice or the Hopper kernel cannot run here. ``flashinfer_ok`` and
    ``hopper_ok`` are callables, asked only when that backend is the choice."""
    if choice is None:
        return "triton"
    backend = choice.graph_backend if capturing else choice.backend
    if backend in ("fa2", "fa3") and not flashinfer_ok():
        backend = choice.graph_backend
    if backend == "hopper" and not hopper_ok():
        backend = "triton"
    return backend


def kv_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8"}.get(dtype, str(dtype))  # fmt: skip


def device_arch(index: int) -> dict:
    """The ``"arch"`` of a table measured on CUDA device ``index``: compute capability and SM count."""
    props = torch.cuda.get_device_properties(index)
    return {"capability": [props.major, props.minor], "sms": props.multi_processor_count}


def validate_table(table: dict, where: str) -> dict:
    """Refuse a malformed table with a message naming the file and the entry."""
    if not isinstance(table, dict) or not isinstance(table.get("entries"), list) or "device" not in table:
        raise ValueError(f"{where}: a sparse_mla table needs 'device' and a list of 'entries'")
    arch = table.get("arch")
    if arch is not None and not (
        isinstance(arch, dict) and set(arch) == {"capability", "sms"} and isinstance(arch["sms"], int)
        and isinstance(arch["capability"], list) and len(arch["capability"]) == 2
        and all(isinstance(c, int) for c in arch["capability"])
    ):  # fmt: skip
        raise ValueError(f"{where}: 'arch' must be {{\"capability\": [major, minor], \"sms\": count}}, got {arch!r}")
    for i, e in enumerate(table["entries"]):
        missing = [k for k in ("H", "B", "K", "kv", "backend", "tiles") if k not in e]
        if missing:
            raise ValueError(f"{where}: entry {i} lacks {missing}")
        if e["backend"] not in BACKENDS:
            raise ValueError(f"{where}: entry {i} has backend {e['backend']!r}, not one of {BACKENDS}")
        bad = [k for k in e["tiles"] if k not in TILE_KEYS]
        if bad:
            raise ValueError(f"{where}: entry {i} has unknown tile keys {bad}")
        if e.get("graph_backend", "triton") not in GRAPH_BACKENDS:
            raise ValueError(f"{where}: entry {i} has graph_backend {e['graph_backend']!r}, not one of {GRAPH_BACKENDS}")
        bad = [k for k in e.get("hopper_tiles", {}) if k not in HOPPER_TILE_KEYS]
        if bad:
            raise ValueError(f"{where}: entry {i} has unknown hopper tile keys {bad}")
    return table


@functools.cache
def load_table(path: str | None = None) -> dict | None:
    """The table at ``path`` (default: ``$DSA_DCP_SPARSE_MLA_TABLE``, else the shipped one)."""
    p = Path(path or os.environ.get(ENV) or TABLE_PATH)
    if not p.exists():
        if path or os.environ.get(ENV):
            raise FileNotFoundError(f"sparse_mla table {p} does not exist")
        return None
    return validate_table(json.loads(p.read_text()), str(p))


@functools.cache
def _device_id(index: int) -> tuple[str, dict]:
    return torch.cuda.get_device_name(index), device_arch(index)


def _nearest_at_or_above(values: list[int], x: int) -> int:
    above = [v for v in values if v >= x]
    return min(above) if above else max(values)


def measured_for(table: dict, device_name: str, arch: dict | None = None) -> bool:
    """Whether ``table`` applies to the device named ``device_name`` of architecture ``arch``
    (:func:`device_arch`): measured on it, or on another of the architecture the table names."""
    return table["device"] == device_name or (arch is not None and table.get("arch") == arch)


def lookup(table: dict, device_name: str, H: int, B: int, K: int, kv: str, arch: dict | None = None) -> Choice | None:
    """The table's choice for a shape on the device named ``device_name`` of architecture ``arch``
    (``kv`` as :func:`kv_name` spells it); ``None`` where the table does not apply (:func:`measured_for`)."""
    if not measured_for(table, device_name, arch):
        return None
    rows = [e for e in table["entries"] if e["H"] == H and e["kv"] == kv]
    if not rows:
        return None
    b = _nearest_at_or_above(sorted({e["B"] for e in rows}), B)
    rows = [e for e in rows if e["B"] == b]
    k = _nearest_at_or_above(sorted({e["K"] for e in rows}), K)
    entry = next(e for e in rows if e["K"] == k)
    backend = entry["backend"]
    graph_backend = entry.get("graph_backend", backend if backend in GRAPH_BACKENDS else "triton")
    return Choice(backend, MappingProxyType(dict(entry["tiles"])), graph_backend,
                  MappingProxyType(dict(entry.get("hopper_tiles", {}))))


def choose(H: int, B: int, K: int, kv_dtype: torch.dtype, device: torch.device) -> Choice | None:
    """The measured choice for this shape on this device, or ``None`` when there is none."""
    if device.type != "cuda":
        return None
    table = load_table()
    if table is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name, arch = _device_id(index)
    return memo_lookup(table, name, H, B, K, kv_dtype, arch)


MEMO_SIZE = 4096  # shapes remembered per loaded table before the memo starts over
_memo: dict = {"table": None, "choices": {}}


def memo_lookup(table: dict, device_name: str, H: int, B: int, K: int, kv_dtype: torch.dtype,
                arch: dict | None = None) -> Choice | None:
    """:func:`lookup`, once per shape and loaded table (a lookup scans the whole table: about 5 us
    of Python a call, on every eager ``sparse_mla`` call without this)."""
    if _memo["table"] is not table or len(_memo["choices"]) >= MEMO_SIZE:
        _memo["table"], _memo["choices"] = table, {}
    key = (device_name, arch and (tuple(arch["capability"]), arch["sms"]), H, B, K, kv_dtype)
    choices = _memo["choices"]
    if key not in choices:
        choices[key] = lookup(table, device_name, H, B, K, kv_name(kv_dtype), arch)
    return choices[key]
