"""Shared helpers for the Triton kernels: input checks, launchability, the SM count grids are sized
by, and one device function."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)
TRITON_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (``triton.cdiv`` is a JIT function: slow to call from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was defined under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def interpreter_ready() -> bool:
    """Whether Triton's own library functions (tl.sum, ...) were defined under the interpreter.

    They are defined when triton is first imported, so ``TRITON_INTERPRET=1`` set any later
    leaves them compiled-only and interpreted kernels that call them fail.
    """
    import triton.language as tl

    return is_interpreted(tl.sum)


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """Refuse to launch a kernel that cannot run here, with a message that says why."""
    if is_interpreted(kernel):
        if not interpreter_ready():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was first imported; set it before anything "
                "imports triton (e.g. at the top of conftest.py)"
            )
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                "Triton kernels need CUDA tensors; to run them on CPU set TRITON_INTERPRET=1 "
                "before dsa_dcp.kernels is first imported (or call the *_reference function)"
            )


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``, asked of the driver once per GPU (launchers
    size their grids with it on every call); 0 for any other device, which has no waves to fill
    (the interpreter runs programs one after another)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devices}")


def check_index(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")


def check_float(op: str, name: str, t: torch.Tensor, ndim: int, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype must be one of {list(dtypes)}, got {t.dtype}")
    if not t.is_floating_point():
        raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def check_int(op: str, name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{op}: {name} must be a Python int >= {lo}, got {v!r}")


def check_remap_args(dcp_size, rank, interleave, op: str) -> None:
    """The ``(N, r, I)`` of a sharded or remapped indexer op (``topk_remap`` checks its own)."""
    check_int(op, "dcp_size", dcp_size, 1)
    check_int(op, "interleave", interleave, 1)
    check_int(op, "rank", rank, 0)
    if rank >= dcp_size:
        raise ValueError(f"{op}: rank must be in [0, {dcp_size}), got {rank}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (views of a larger buffer stay views)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


@triton.jit
def max_keep_nan(a, b):
    """``max`` that keeps NaN, for reductions of scores and LSEs (``tl.max``/``tl.maximum`` return
    the other operand): a NaN makes the max NaN, so a NaN still wins over a ``+inf`` beside it.
    Used as ``tl.reduce(x, axis, max_keep_nan)``: the reduction ``tl.max`` does, with only the
    NaN behaviour of its max changed."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
