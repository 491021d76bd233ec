"""sparse_mla through FlashInfer's MLA wrapper (GPU with FlashInfer installed)."""

import importlib.util
import math

import pytest
import torch

from dsa_dcp.kernels import sparse_mla_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="FlashInfer is not installed"),
]


def _inputs(seed, b, h, k, s, invalid=0.3):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(b, h, 512, generator=g).bfloat16().cuda()
    q_pe = torch.randn(b, h, 64, generator=g).bfloat16().cuda()
    kv = torch.randn(s, 576, generator=g).bfloat16().cuda()
    topk = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(b)]).int()
    topk[torch.rand(b, k, generator=g) < invalid] = -1
    if b > 1:
        topk[0] = -1  # a row with no valid slot
    if b > 2:
        topk[2, 3:] = -1  # fewer valid slots than K
    return q_nope, q_pe, kv, topk.cuda()


@pytest.mark.parametrize("b, h, k", [(1, 64, 512), (4, 128, 2048), (8, 64, 1000), (3, 16, 7)])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_flashinfer_matches_reference(b, h, k, backend):
    from dsa_dcp.kernels.flashinfer_mla import sparse_mla_flashinfer

    q_nope, q_pe, kv, topk = _inputs(b * h + k, b, h, k, s=4096)
    scale = 192**-0.5
    out, lse = sparse_mla_flashinfer(q_nope, q_pe, kv, topk, scale, backend=backend)
    ref_out, ref_lse = sparse_mla_reference(q_nope.double(), q_pe.double(), kv.double(), topk, scale,
                                            compute_dtype=torch.float64)
    assert not out.isnan().any() and not lse.isnan().any()
    if b > 1:
        assert torch.all(lse[0] == -math.inf) and torch.all(out[0] == 0)
    rel = (out.double() - ref_out).norm() / ref_out.norm()
    assert rel < 2e-2
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
def test_op_follows_the_measured_table(monkeypatch, tmp_path, backend):
    """The op calls FlashInfer exactly when the dispatch table says so for the shape."""
    import json

    from dsa_dcp.kernels import dispatch, flashinfer_mla

    entry = {"H": 64, "B": 4, "K": 256, "kv": "bf16", "backend": backend,
             "tiles": {"block_h": 16, "block_k": 32, "num_warps": 4, "num_stages": 2, "num_splits": 2}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "entries": [entry]}))
    monkeypatch.setenv(dispatch.ENV, str(path))
    dispatch.load_table.cache_clear()
    calls = []
    real = flashinfer_mla.sparse_mla_flashinfer
    monkeypatch.setattr(flashinfer_mla, "sparse_mla_flashinfer", lambda *a, **k: calls.append(k) or real(*a, **k))
    try:
        q_nope, q_pe, kv, topk = _inputs(0, 4, 64, 256, s=2048)
        out, lse = torch.ops.dsa_dcp.sparse_mla(q_nope, q_pe, kv, topk, 0.1)
    finally:
        dispatch.load_table.cache_clear()
    assert calls == ([] if backend == "triton" else [{"backend": backend}])
    ref_out, ref_lse = sparse_mla_reference(q_nope.double(), q_pe.double(), kv.double(), topk, 0.1,
                                            compute_dtype=torch.float64)
    assert (out.double() - ref_out).norm() / ref_out.norm() < 2e-2
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-3, atol=1e-3)
