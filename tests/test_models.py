"""Reference DSA models: attention and indexer against fp64 brute force, configs, the runner."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dsa_dcp.kv_cache import KVLayout, kv_layout
from dsa_dcp.models import DSAModel, generate, get_config, make_requests, standard_test_batch

FAMILIES = [("deepseek-v3.2-tiny", 4), ("glm5.2-tiny", 8)]
STEPS = 4
PAD_TO = 16  # the tiny standard batch has at most 13 rows a step


@pytest.fixture(scope="module", params=FAMILIES, ids=[f[0] for f in FAMILIES])
def family(request):
    name, n_layers = request.param
    cfg = get_config(name, n_layers=n_layers)
    batch = standard_test_batch(cfg, max_new_tokens=STEPS)
    model = DSAModel(cfg, batch.num_slots, seed=1)
    return cfg, batch, model


@pytest.fixture(scope="module")
def recording(family):
    """One padded generate run with every layer's attention input/output and top-k recorded."""
    cfg, batch, model = family
    steps = []

    def grab(layer_id):
        def hook(mod, args, out):
            steps[-1]["layers"][layer_id] = {"x": args[0].double(), "o": out[0].double(), "topk": out[1].clone()}
        return hook

    handles = [layer.attn.register_forward_hook(grab(i)) for i, layer in enumerate(model.layers)]

    def step_fn(input_ids, positions, req_ids, slots, page_table):
        steps.append({"positions": positions.clone(), "req_ids": req_ids.clone(), "slots": slots.clone(), "layers": {}})
        return model(input_ids, positions, req_ids, slots, page_table)

    try:
        with torch.no_grad():
            result = generate(step_fn, batch, STEPS, pad_to=PAD_TO)
    finally:
        for h in handles:
            h.remove()
    return steps, result


def _token_table(steps, layer):
    """(req, pos) -> (slot, x of that token at ``layer``), over the whole run."""
    table = {}
    for st in steps:
        for t in range(st["slots"].shape[0]):
            if st["slots"][t] >= 0:
                key = (int(st["req_ids"][t]), int(st["positions"][t]))
                table[key] = (int(st["slots"][t]), st["layers"][layer]["x"][t])
    return table


# ---------------------------------------------------------------------- independent fp64 math


def _rope(x, pos, theta):
    """Rotate pairs (x[i], x[i + d/2]) by pos * theta**(-2i/d), as complex numbers."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(inv), pos * inv)
    return torch.cat([z.real, z.imag], dim=-1)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _p(t):
    return t.detach().double()


def _mla_reference(attn, cfg, x_q, pos_q, keys):
    """Unabsorbed MLA for one row in fp64: per-head k_nope/v from the latent, dense softmax over
    exactly ``keys`` = [(x_token, position)]. Returns o[hidden]."""
    h, nope, dr, dc = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_a = _rms(x_q @ _p(attn.input_weights()[0]).T, _p(attn.q_a_norm.weight), cfg.norm_eps)
    q = (q_a @ _p(attn.wq_b).T).view(h, nope + dr)
    q_nope, q_pe = q[:, :nope], _rope(q[:, nope:], pos_q, cfg.rope_theta)
    if not keys:
        return torch.zeros(cfg.hidden_size, dtype=torch.float64)
    xs = torch.stack([k for k, _ in keys])
    ps = torch.tensor([p for _, p in keys], dtype=torch.float64)
    kv_a = xs @ _p(attn.input_weights()[1]).T
    c = _rms(kv_a[:, :dc], _p(attn.kv_a_norm.weight), cfg.norm_eps)  # [J, Dc]
    k_pe = _rope(kv_a[:, dc:], ps[:, None], cfg.rope_theta)  # [J, Dr]
    k_nope = torch.einsum("hnc,jc->hjn", _p(attn.w_uk), c)
    v = torch.einsum("hcv,jc->hjv", _p(attn.w_uv), c)
    s = (torch.einsum("hn,hjn->hj", q_nope, k_nope) + q_pe @ k_pe.T) * cfg.sm_scale
    o = torch.einsum("hj,hjv->hv", torch.softmax(s, dim=-1), v)
    return _p(attn.w_o) @ o.flatten()


def _index_scores(indexer, attn, cfg, x_q, pos_q, cand):
    """Lightning-indexer score of one row against ``cand`` = [(x_token, position)], fp64."""
    hi, di, r = cfg.index_n_heads, cfg.index_head_dim, cfg.index_rope_dim
    q_a = _rms(x_q @ _p(attn.input_weights()[0]).T, _p(attn.q_a_norm.weight), cfg.norm_eps)
    q = (q_a @ _p(indexer.wq).T).view(hi, di)
    q = torch.cat([_rope(q[:, :r], pos_q, cfg.rope_theta), q[:, r:]], dim=-1)
    xs = torch.stack([k for k, _ in cand])
    ps = torch.tensor([p for _, p in cand], dtype=torch.float64)
    k = torch.nn.functional.layer_norm(xs @ _p(attn.input_weights()[2]).T, (di,), _p(indexer.k_norm.weight),
                                       _p(indexer.k_norm.bias), cfg.norm_eps)
    k = torch.cat([_rope(k[:, :r], ps[:, None], cfg.rope_theta), k[:, r:]], dim=-1)
    w = (x_q @ _p(attn.input_weights()[3]).T) * hi**-0.5 * di**-0.5
    return (torch.relu(q @ k.T) * w[:, None]).sum(0)  # [J]


# ---------------------------------------------------------------------- (a) attention


def test_attention_matches_dense_fp64_over_topk(family, recording):
    cfg, batch, model = family
    steps, _ = recording
    for layer_id, layer in enumerate(model.layers):
        tokens = _token_table(steps, layer_id)
        by_slot = {slot: (x, pos) for (_, pos), (slot, x) in tokens.items()}
        for st in steps:
            rec = st["layers"][layer_id]
            for t in range(rec["x"].shape[0]):
                pos = int(st["positions"][t])
                if pos < 0:  # padding row: selects nothing, outputs exactly zero
                    assert (rec["topk"][t] == -1).all() and (rec["o"][t] == 0).all()
                    continue
                keys = [by_slot[int(s)] for s in rec["topk"][t] if s >= 0]
                ref = _mla_reference(layer.attn, cfg, rec["x"][t], float(pos), keys)
                torch.testing.assert_close(rec["o"][t], ref, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"layer {layer_id} pos {pos}: {m}")


# ---------------------------------------------------------------------- (b) indexer


def test_indexer_topk_is_brute_force_topk(family, recording):
    cfg, batch, model = family
    steps, _ = recording
    k_width = cfg.topk_capacity(batch.page_table.shape[1])
    checked_short = checked_full = 0
    for layer_id, layer in enumerate(model.layers):
        source = cfg.topk_source(layer_id)
        if layer.attn.indexer is None:  # IndexShare: the previous indexer layer's top-k, unchanged
            for st in steps:
                assert torch.equal(st["layers"][layer_id]["topk"], st["layers"][source]["topk"])
            continue
        tokens = _token_table(steps, layer_id)
        for st in steps:
            rec = st["layers"][layer_id]
            assert rec["topk"].dtype == torch.int32 and rec["topk"].shape[1] == k_width
            for t in range(rec["x"].shape[0]):
                pos, req = int(st["positions"][t]), int(st["req_ids"][t])
                if pos < 0:
                    continue
                cand = [(p, tokens[(req, p)]) for p in range(pos + 1)]
                n = min(k_width, len(cand))
                row = rec["topk"][t].tolist()
                # -1 exactly in the tail, exactly when the row has fewer than K candidates
                assert row[n:] == [-1] * (k_width - n) and min(row[:n]) >= 0, (layer_id, pos, row)
                scores = _index_scores(layer.attn.indexer, layer.attn, cfg, rec["x"][t], float(pos),
                                       [(x, float(p)) for p, (_, x) in cand])
                slot_score = {slot: float(s) for (_, (slot, _)), s in zip(cand, scores)}
                assert len(set(row[:n])) == n and set(row[:n]) <= set(slot_score)
                brute = sorted(slot_score, key=slot_score.get, reverse=True)[:n]
                if set(brute) != set(row[:n]):  # only a tie at the K-th score may differ
                    got = sorted((slot_score[s] for s in row[:n]), reverse=True)
                    want = [slot_score[s] for s in brute]
                    assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (layer_id, pos)
                checked_short += n < k_width
                checked_full += n == k_width
    assert checked_short and checked_full  # both regimes were exercised


# ---------------------------------------------------------------------- (c) configs


def test_glm52_index_share_layout():
    cfg = get_config("glm5.2")
    assert cfg.n_layers == 78
    assert cfg.indexer_layers == (0, 1, 2) + tuple(range(6, 78, 4))
    assert len(cfg.indexer_layers) == 21 and cfg.indexer_layers[-1] == 74
    assert get_config("glm5.3") == cfg
    assert cfg.topk_source(5) == 2 and cfg.topk_source(6) == 6 and cfg.topk_source(77) == 74
    assert get_config("glm5.2", n_layers=8).indexer_layers == (0, 1, 2, 6)
    assert get_config("glm5").indexer_layers == tuple(range(78))
    assert get_config("deepseek-v3.2").indexer_layers == tuple(range(61))
    assert get_config("deepseek-v3.2").sm_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert get_config("glm5.2").sm_scale == pytest.approx(256**-0.5)

    tiny = get_config("glm5.2-tiny")
    assert (tiny.n_layers, tiny.indexer_layers) == (78, cfg.indexer_layers)
    model = DSAModel(tiny, num_slots=16)
    owners = {int(n.split(".")[1]) for n, _ in model.named_parameters() if ".indexer." in n}
    assert owners == set(cfg.indexer_layers)
    assert all((layer.attn.indexer is None) != tiny.has_indexer(i) for i, layer in enumerate(model.layers))
    assert sorted(model.index_caches()) == list(cfg.indexer_layers)
    assert len(model.kv_caches()) == 78 and model.kv_caches()[0].shape == (16, tiny.kv_dim)
    assert DSAModel(tiny, 16, kv_rows=8).kv_caches()[5].shape == (8, tiny.kv_dim)


def test_kv_caches_carry_their_dcp_layout():
    cfg = get_config("glm5.2-tiny", n_layers=3)
    model = DSAModel(cfg, num_slots=13, dcp_size=2)
    assert [tuple(c.shape) for c in model.kv_caches()] == [(7, cfg.kv_dim)] * 3  # ceil(13 / 2)
    assert {tuple(c.shape) for c in model.index_caches().values()} == {(13, cfg.index_head_dim)}  # replicated
    assert kv_layout(model.kv_caches()[0]) == KVLayout(num_slots=13, dcp_size=2, interleave=1)
    model.to(torch.float64)  # a cast makes new tensors: the layout must follow them
    assert model.kv_caches()[1].dtype == torch.float64 and model.rope_inv_freq.dtype == torch.float32
    assert kv_layout(model.kv_caches()[1]) == KVLayout(num_slots=13, dcp_size=2, interleave=1)
    model.allocate_caches(dcp_size=4, interleave=2)
    assert kv_layout(model.kv_caches()[2]).rows == model.kv_rows == 4  # ceil(13 / 8) * 2
    assert kv_layout(DSAModel(cfg, 13, kv_rows=5).kv_caches()[0]) is None

    with pytest.raises(KeyError, match="valid names"):
        get_config("glm6")
    with pytest.raises(TypeError, match="unknown DSAConfig field"):
        get_config("glm5", n_layer=3)


def test_weights_are_a_function_of_the_seed():
    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    a, b, c = DSAModel(cfg, 8, seed=3), DSAModel(cfg, 8, seed=3), DSAModel(cfg, 8, seed=4)
    pa, pb, pc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["embed"], pc["embed"])
    assert not any("cache" in k for k in pa)  # caches are non-persistent buffers


# ---------------------------------------------------------------------- (d), (e) runner


def _assert_same_generation(r1, r2, atol):
    assert r1.tokens == r2.tokens
    assert r1.step_rows == r2.step_rows
    for a, b in zip(r1.step_logits, r2.step_logits, strict=True):
        # bitwise equality is not promised: BLAS blocks rows differently for another row count
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("budget", [PAD_TO, 5])
def test_padding_rows_change_nothing(family, budget):
    cfg, batch, model = family
    with torch.no_grad():
        plain = generate(model, batch, STEPS, rows_per_step=budget)
        padded = generate(model, batch, STEPS, rows_per_step=budget, pad_to=budget + 3)
    _assert_same_generation(plain, padded, atol=1e-5)
    assert max(len(rows) for rows in plain.step_rows) <= budget
    mixed = [rows for rows in plain.step_rows if len(Counter(r for r, _ in rows)) > 1
             and max(Counter(r for r, _ in rows).values()) > 1]
    assert mixed, "schedule never mixed an extend chunk with other requests' rows"


def test_chunked_prefill_matches_one_chunk(family):
    cfg, batch, model = family
    whole = batch.with_schedule(start_steps=[0] * 4, prefill_chunk=None)
    chunked = batch.with_schedule(prefill_chunk=3)
    with torch.no_grad():
        r_whole = generate(model, whole, STEPS)
        r_chunked = generate(model, chunked, STEPS)
    assert max(len(rows) for rows in r_chunked.step_rows) < max(len(rows) for rows in r_whole.step_rows)
    for r, req in enumerate(batch.requests):
        last = len(req.prompt) - 1
        torch.testing.assert_close(r_chunked.logits_at(r, last), r_whole.logits_at(r, last), rtol=0, atol=1e-5)
    assert r_chunked.tokens == r_whole.tokens


def test_make_requests_scatters_pages():
    cfg = get_config("glm5-tiny", n_layers=1)
    batch = make_requests(cfg, [5, 9, 30], max_new_tokens=3, seed=7)
    pages = batch.page_table[batch.page_table >= 0].tolist()
    assert len(pages) == len(set(pages)) and max(pages) < batch.num_slots // cfg.page_size
    slots = [batch.slot(2, p) for p in range(33)]
    assert slots != list(range(slots[0], slots[0] + 33))  # not contiguous
    assert make_requests(cfg, [5, 9, 30], max_new_tokens=3, seed=7).page_table.equal(batch.page_table)


# ---------------------------------------------------------------------- tracing


def test_forward_traces_fullgraph_with_one_node_per_op(family):
    cfg, batch, model = family
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    with torch.no_grad():
        eager = generate(model, batch, 2, pad_to=PAD_TO)
        traced = generate(compiled, batch, 2, pad_to=PAD_TO)
    _assert_same_generation(eager, traced, atol=1e-5)
    assert len(graphs) == 1  # one static shape: no recompiles as requests grow
    targets = Counter(n.target for n in graphs[0].graph.nodes if n.op == "call_function")
    assert targets[torch.ops.dsa_dcp.sparse_mla.default] == cfg.n_layers
    assert targets[torch.ops.dsa_dcp.kv_store.default] == cfg.n_layers + len(cfg.indexer_layers)
    torch._dynamo.reset()
