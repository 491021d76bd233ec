"""The compiled step replayed from CUDA graphs (GPU only)."""

import pytest
import torch

import dsa_dcp
from dsa_dcp.lowering import accumulated_inputs, written_inputs
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

gpu = pytest.mark.gpu
STEPS = 16
KV_STORE = torch.ops.dsa_dcp.kv_store.default
SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default


def _store_and_attend(q_nope, q_pe, cache, topk, slots, rows):
    KV_STORE(cache[:, :], slots, rows)  # through a view: still a write into the input
    out, _ = SPARSE_MLA(q_nope, q_pe, cache, topk, 0.5)
    return out


def _step_inputs(seed, device, S=96, B=4, H=4, DC=16, DR=8, K=6):
    g = torch.Generator().manual_seed(seed)
    args = (torch.randn(B, H, DC, generator=g), torch.randn(B, H, DR, generator=g), None,
            torch.randint(-1, S, (B, K), generator=g), torch.randperm(S, generator=g)[:B],
            torch.randn(B, DC + DR, generator=g))
    return [a.to(device) if a is not None else None for a in args], (S, DC + DR)


def test_written_inputs_are_found():
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    (q_nope, q_pe, _, topk, slots, rows), (s, d) = _step_inputs(0, "cpu")
    torch._dynamo.reset()
    torch.compile(_store_and_attend, backend=keep, fullgraph=True)(q_nope, q_pe, torch.zeros(s, d), topk, slots, rows)
    (gm,) = graphs
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 6
    assert [placeholders[i] for i in written_inputs(gm)] == ["l_cache_"]  # the cache, and nothing else


def _store_and_count(cache, counter, rows, positions):
    """transformers' static cache: rows written at the counter's positions, then the counter advanced."""
    cache.index_copy_(1, positions + counter, rows)
    counter.add_(rows.shape[1])
    cache[:, :1] = rows[:, :1]  # a slice overwrite: repeating it changes nothing
    return cache.sum(1)


def test_accumulated_inputs_are_the_counters():
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    cache, counter = torch.zeros(2, 8, 3), torch.tensor(0)
    torch.compile(_store_and_count, backend=keep, fullgraph=True)(cache, counter, torch.randn(2, 2, 3), torch.arange(2))
    (gm,) = graphs
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert sorted(placeholders[i] for i in written_inputs(gm)) == ["l_cache_", "l_counter_"]
    assert [placeholders[i] for i in accumulated_inputs(gm)] == ["l_counter_"]
    assert int(counter) == 2


@gpu
def test_a_step_that_advances_a_counter_runs_once_per_call():
    """Capture on the second call, replays after: the counter and the cache after every call are
    the eager ones (a warm-up run or a capture that ran the step would advance the counter twice),
    and counting the graph's kernels leaves the counter as it was."""
    torch._dynamo.reset()
    step = torch.compile(_store_and_count, backend="dsa_dcp", fullgraph=True, dynamic=False)
    cache, counter = torch.zeros(2, 16, 3, device="cuda"), torch.tensor(0, device="cuda")
    ref_cache, ref_counter = cache.clone(), counter.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        rows = torch.randn(2, 2, 3, generator=g).cuda()
        out = step(cache, counter, rows, torch.arange(2, device="cuda"))
        ref = _store_and_count(ref_cache, ref_counter, rows, torch.arange(2, device="cuda"))
        assert int(counter) == int(ref_counter)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        torch.testing.assert_close(out, ref)  # Inductor's sum reassociates
    lowered = dsa_dcp.backend_report().lowered
    assert len(lowered.graphs) == 1 and lowered.uncaptured_calls == 1  # the first call only
    (kernels,) = lowered.kernels_per_step().values()
    assert kernels >= 2 and int(counter) == int(ref_counter) == 10


@gpu
def test_replay_writes_a_cache_passed_as_an_argument():
    """A KV cache given as a step argument (not a buffer) is written where it is, replay after replay."""
    torch._dynamo.reset()
    step = torch.compile(_store_and_attend, backend="dsa_dcp", fullgraph=True, dynamic=False)
    (_, _, _, _, _, _), (s, d) = _step_inputs(0, "cuda")
    cache, ref_cache = torch.zeros(s, d, device="cuda"), torch.zeros(s, d, device="cuda")
    for seed in range(4):  # capture, then replays with new slots and rows
        (q_nope, q_pe, _, topk, slots, rows), _ = _step_inputs(seed, "cuda")
        out = step(q_nope, q_pe, cache, topk, slots, rows)
        ref = _store_and_attend(q_nope, q_pe, ref_cache, topk, slots, rows)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    other, other_ref = torch.zeros(s, d, device="cuda"), torch.zeros(s, d, device="cuda")
    step(q_nope, q_pe, other, topk, slots, rows)  # another cache: its own graph, its own writes
    _store_and_attend(q_nope, q_pe, other_ref, topk, slots, rows)
    torch.testing.assert_close(other, other_ref, rtol=0, atol=0)
    lowered = dsa_dcp.backend_report().lowered
    assert len(lowered.graphs) == 1 and lowered.uncaptured_calls == 2  # each cache's first call runs uncaptured
    step(q_nope, q_pe, other, topk, slots, rows)  # its second call: captured
    _store_and_attend(q_nope, q_pe, other_ref, topk, slots, rows)
    torch.testing.assert_close(other, other_ref, rtol=0, atol=0)
    assert len(lowered.graphs) == 2


def _pair(batch_sizes, layers=4):
    """The same model compiled twice, without and with CUDA graphs: the same kernels (Inductor's code
    for bf16 is not eager's, so greedy tokens are compared against the compiled step, not eager)."""
    cfg = get_config("glm5.2-tiny", n_layers=layers)
    batch = standard_test_batch(cfg, max_new_tokens=STEPS, seed=5)
    make = lambda: DSAModel(cfg, batch.num_slots, dtype=torch.bfloat16, device="cuda", seed=2)  # noqa: E731
    plain = torch.compile(make(), backend="dsa_dcp", options={"cuda_graphs": False}, fullgraph=True, dynamic=False)
    step = torch.compile(make(), backend="dsa_dcp", options={"batch_sizes": batch_sizes}, fullgraph=True,
                         dynamic=False)
    return batch, plain, step


@gpu
@pytest.mark.parametrize("batch_sizes, rows, captured", [((4, 16), 16, True), ((4, 8), 16, False)])
def test_graph_replay_matches_eager(batch_sizes, rows, captured):
    torch._dynamo.reset()
    batch, plain, step = _pair(batch_sizes)
    with torch.no_grad():
        ref = generate(plain, batch, STEPS, pad_to=rows, device="cuda")
        out = generate(step, batch, STEPS, pad_to=rows, device="cuda")
    assert out.tokens == ref.tokens
    assert len(out.step_logits) == len(ref.step_logits) >= STEPS
    for a, b in zip(out.step_logits, ref.step_logits):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    lowered = dsa_dcp.backend_report().lowered
    assert (len(lowered.graphs) == 1) is captured
    assert (lowered.uncaptured_calls == 1) is captured  # captured: only the shape's first call ran uncaptured
    if captured:
        (kernels,) = lowered.kernels_per_step().values()
        assert kernels > 4  # at least one kernel per layer: the graph holds the whole step


@gpu
def test_replay_sees_inputs_changed_in_place():
    torch._dynamo.reset()
    cfg = get_config("glm5.2-tiny", n_layers=4)
    batch = standard_test_batch(cfg, max_new_tokens=4, seed=9)
    eager = DSAModel(cfg, batch.num_slots, device="cuda", seed=4)
    graphed = DSAModel(cfg, batch.num_slots, device="cuda", seed=4)
    step = torch.compile(graphed, backend="dsa_dcp", fullgraph=True, dynamic=False)
    t = 8
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, cfg.vocab_size, (t,), generator=g).cuda()
    req_ids = torch.arange(t).remainder(len(batch.requests)).cuda()
    positions = torch.arange(t).remainder(3).cuda()
    page_table = batch.page_table.cuda()
    slots = torch.tensor([batch.slot(int(r), int(p)) for r, p in zip(req_ids, positions)]).cuda()
    with torch.no_grad():
        for _ in range(3):  # capture, then replay with new values written into the same tensors
            out = step(input_ids, positions, req_ids, slots, page_table)
            ref = eager(input_ids, positions, req_ids, slots, page_table)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            input_ids.random_(0, cfg.vocab_size)
            positions.copy_((positions + 1) % 3)  # every request has room for positions 0..2
            slots.copy_(torch.tensor([batch.slot(int(r), int(p)) for r, p in zip(req_ids, positions)]))
    assert len(dsa_dcp.backend_report().lowered.graphs) == 1

