"""The compiled step replayed from CUDA graphs (GPU only)."""

import pytest
import torch

import dsa_dcp
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

gpu = pytest.mark.gpu
STEPS = 32


def _pair(batch_sizes, layers=8):
    cfg = get_config("glm5.2-tiny", n_layers=layers)
    batch = standard_test_batch(cfg, max_new_tokens=STEPS, seed=5)
    make = lambda: DSAModel(cfg, batch.num_slots, dtype=torch.bfloat16, device="cuda", seed=2)  # noqa: E731
    eager, graphed = make(), make()
    step = torch.compile(graphed, backend="dsa_dcp", options={"batch_sizes": batch_sizes}, fullgraph=True,
                         dynamic=False)
    return batch, eager, step


@gpu
@pytest.mark.parametrize("batch_sizes, rows, captured", [((4, 16), 16, True), ((4, 8), 16, False)])
def test_graph_replay_matches_eager(batch_sizes, rows, captured):
    torch._dynamo.reset()
    batch, eager, step = _pair(batch_sizes)
    with torch.no_grad():
        ref = generate(eager, batch, STEPS, pad_to=rows, device="cuda")
        out = generate(step, batch, STEPS, pad_to=rows, device="cuda")
    assert out.tokens == ref.tokens
    assert len(out.step_logits) == len(ref.step_logits) >= STEPS
    for a, b in zip(out.step_logits, ref.step_logits):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    lowered = dsa_dcp.backend_report().lowered
    assert (len(lowered.graphs) == 1) is captured
    assert (lowered.uncaptured_calls == 0) is captured
    if captured:
        (kernels,) = lowered.kernels_per_step().values()
        assert kernels > 8  # at least one kernel per layer: the graph holds the whole step


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

