"""``sparse_mla`` on CUDA through FlashInfer's MLA paged-attention wrapper.

FlashInfer has no sparse MLA decode for Hopper, but its paged MLA kernel with ``page_size = 1``
is sparse attention when the page list of a row is its top-k: ``kv_indices`` are the valid slots
(compacted to the front of each row by ``topk_remap`` with one rank, so no host-side filtering),
``kv_indptr`` the running sum of the rows' valid counts (``kv_len``). Its LSE is base 2 and its
result for a row with no slot is unspecified, so both are normalized here: natural log, and
``out = 0``, ``lse = -inf`` on the rows whose count of valid slots is 0 (found from the top-k,
never from the values FlashInfer returns). Every other row is passed through as FlashInfer
computed it, NaN included: a NaN in a named KV row or the query gives NaN there, as the
``sparse_mla`` contract requires, and is never turned into an empty row. (An infinite score may
come back with a NaN LSE where the contract says ``+inf``; the output is NaN either way, and so is
any merge of it.)

``plan()`` copies the index pointers to the host, so this path synchronizes once per call;
inside a CUDA-graph capture the ``sparse_mla`` op uses the Triton kernel instead.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from dsa_dcp.kernels.topk_remap import topk_remap_triton

WORKSPACE_BYTES = 128 * 1024 * 1024
LN2 = 0.6931471805599453  # FlashInfer's LSE is base 2


def available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def supports(q_nope: Tensor, q_pe: Tensor, kv: Tensor) -> bool:
    """Shapes and dtypes FlashInfer's MLA kernels are built for."""
    return (
        q_nope.shape[-1] == 512
        and q_pe.shape[-1] == 64
        and q_nope.dtype in (torch.bfloat16, torch.float16)
        and kv.dtype == q_nope.dtype
    )


@functools.cache
def _wrapper(device: torch.device, backend: str):
    import flashinfer

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)


def sparse_mla_flashinfer(
    q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """The ``sparse_mla`` contract (see ``dsa_dcp.ops``) on FlashInfer."""
    b, h, dc = q_nope.shape
    k = topk.shape[1]
    if b == 0:
        return q_nope.new_zeros(q_nope.shape), q_nope.new_full((b, h), float("-inf"), dtype=torch.float32)
    compact, count = topk_remap_triton(topk, 1, 0, 1)  # valid slots first, in order; counts per row
    device = q_nope.device
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=device)
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(count, 0)
    # Pack every row's valid slots back to back (CSR); the invalid tail goes to one spare entry.
    col = torch.arange(k, device=device)
    dest = torch.where(col < count[:, None], kv_indptr[:-1, None] + col, b * k)
    kv_indices = torch.zeros(b * k + 1, dtype=torch.int32, device=device)
    kv_indices[dest.reshape(-1)] = compact.reshape(-1).to(torch.int32)
    wrapper = _wrapper(device, backend)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, count, h, dc, q_pe.shape[-1], 1, False, sm_scale,
                 q_nope.dtype, kv.dtype)
    ckv = kv[:, :dc].unsqueeze(1)
    kpe = kv[:, dc:].unsqueeze(1)
    out, lse = wrapper.run(q_nope.contiguous(), q_pe.contiguous(), ckv, kpe, return_lse=True)
    # empty rows by their count only: a NaN or inf LSE on a row with slots is a result, kept
    empty = (count == 0).unsqueeze(-1)
    lse = torch.where(empty, float("-inf"), lse.float() * LN2)
    out = torch.where(empty.unsqueeze(-1), 0, out)
    return out, lse
