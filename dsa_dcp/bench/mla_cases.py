"""The ``sparse_mla`` shapes the benches time, and the check every variant passes before it is timed.

:class:`MlaCase` holds one shape's inputs over a 1M-slot KV cache cut into disjoint slices, so that
captured calls rotating over the slices gather rows that are not in L2 (about 100 MB or more of
distinct rows a replay, twice the H200's L2), and builds each backend's call: the Triton kernel,
the Hopper kernel, FlashInfer as the op runs it and FlashInfer's wrapper alone. :func:`check_mla`
holds a result against the torch reference on the same inputs (relative output error under 2e-2,
LSE within 1e-2; FlashInfer's base-2 LSE converted first). Used by ``dsa-dcp bench kernels`` and
its ``--tune``.
"""

from __future__ import annotations

import itertools
import math

import torch

from dsa_dcp.bench.measure import L2_BYTES

SLOTS = 1 << 20
DC, DR = 512, 64


class MlaCase:
    """Inputs of one sparse MLA shape: queries, a 1M-slot cache in ``views`` disjoint slices and a
    top-k into one slice (the same indices address a different slice in each view)."""

    def __init__(self, cache: torch.Tensor, h: int, b: int, k: int, kv: str, scale_fp8: float):
        self.h, self.b, self.k, self.kv = h, b, k, kv
        per_call = b * k * (DC + DR) * cache.element_size()
        self.views = max(1, min(128, math.ceil(2 * L2_BYTES / per_call)))
        span = cache.shape[0] // self.views
        self.caches = [cache[i * span:(i + 1) * span] for i in range(self.views)]
        self.q_nope = torch.randn(b, h, DC, device="cuda", dtype=torch.bfloat16)
        self.q_pe = torch.randn(b, h, DR, device="cuda", dtype=torch.bfloat16)
        self.topk = torch.stack([torch.randperm(span, device="cuda")[:k] for _ in range(b)]).int()
        self.sm_scale = 192**-0.5
        self.kv_scale = scale_fp8 if kv == "fp8" else None
        self.bytes = b * k * (DC + DR) * cache.element_size() + 2 * b * h * (DC + DR) * 2
        self.flops = 2 * b * h * k * (DC + DR + DC)  # scores over 576 columns, values over 512

    def reference(self):
        from dsa_dcp.kernels import sparse_mla_reference

        return sparse_mla_reference(self.q_nope, self.q_pe, self.caches[0], self.topk, self.sm_scale, self.kv_scale)

    def triton(self, view: int = 0, **tiles):
        from dsa_dcp.kernels import sparse_mla_triton

        return lambda: sparse_mla_triton(
            self.q_nope, self.q_pe, self.caches[view], self.topk, self.sm_scale, self.kv_scale, **tiles
        )

    def hopper(self, view: int = 0, **kw):
        from dsa_dcp.kernels.sparse_mla_hopper import sparse_mla_hopper

        return lambda: sparse_mla_hopper(
            self.q_nope, self.q_pe, self.caches[view], self.topk, self.sm_scale, self.kv_scale, **kw
        )

    def flashinfer_op(self, backend: str):
        """The whole ``sparse_mla`` call through FlashInfer, as the op runs it uncaptured."""
        from dsa_dcp.kernels import flashinfer_mla

        return lambda: flashinfer_mla.sparse_mla_flashinfer(
            self.q_nope, self.q_pe, self.caches[0], self.topk, self.sm_scale, backend=backend
        )

    def flashinfer_runs(self, backend: str, graph: bool):
        """``wrapper.run`` per view after one ``plan()`` (graph: a CUDA-graph wrapper)."""
        import flashinfer

        b, h, k = self.b, self.h, self.k
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        kv_indptr, indices = indptr * k, self.topk.reshape(-1).contiguous()
        lens = torch.full((b,), k, dtype=torch.int32, device="cuda")
        if graph:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                ws, True, indptr.clone(), kv_indptr.clone(), indices.clone(), lens.clone(), backend=backend
            )
        else:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
        wrapper.plan(indptr, kv_indptr, indices, lens, h, DC, DR, 1, False, self.sm_scale, torch.bfloat16,
                     torch.bfloat16)
        out = torch.empty(b, h, DC, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, device="cuda", dtype=torch.float32)

        def run(cache):
            ckv, kpe = cache[:, :DC].unsqueeze(1), cache[:, DC:].unsqueeze(1)
            return lambda: wrapper.run(self.q_nope, self.q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)

        return [run(c) for c in self.caches]


def check_mla(name: str, got, ref, lse_base2: bool = False) -> None:
    out, lse = got
    if lse_base2:
        lse = lse * 0.6931471805599453
    rel = ((out.float() - ref[0].float()).norm() / ref[0].float().norm()).item()
    assert rel < 2e-2, (name, rel)
    torch.testing.assert_close(lse.float(), ref[1], rtol=1e-2, atol=1e-2)


def make_caches():
    cache = torch.randn(SLOTS, DC + DR, device="cuda", dtype=torch.bfloat16)
    scale = float(cache.abs().amax()) / 448.0
    return {"bf16": (cache, None), "fp8": ((cache.float() / scale).to(torch.float8_e4m3fn), scale)}


def mla_cases(heads, batches, ks, kvs):
    """``(case, reference result)`` for every shape, over one pair of BF16/FP8 caches."""
    caches = make_caches()
    for kv, h, b, k in itertools.product(kvs, heads, batches, ks):
        cache, scale = caches[kv]
        case = MlaCase(cache, h, b, k, kv, scale)
        yield case, case.reference()
