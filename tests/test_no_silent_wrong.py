"""A DCP program gives the single-rank answer or refuses clearly: the misuses that once gave wrong
results without an error (graphs that only write a cache, the op packets, caches compiled without
options, ranks with different options, a step retried on one rank, dynamic shapes, Python-int
positions). Multi-rank cases run on gloo CPU ranks; single-rank references on the same inputs."""

import warnings

import pytest
import torch

import dsa_dcp
from dsa_dcp.backend import DCPCompileWarning
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.slots import local_row, owner
from dsa_dcp.validate import DCPValidationError

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)

S, B, H, DC, DR, K, LAYERS = 40, 5, 4, 8, 4, 6, 3
OPS = torch.ops.dsa_dcp


def _root_cause(err: BaseException) -> BaseException:
    while err is not None and not isinstance(err, (DCPValidationError, dsa_dcp.OptionsError)):
        err = getattr(err, "inner_exception", None) or err.__cause__
    return err


def _inputs(seed: int, rows: int = B):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S, generator=g)[:rows]
    slots[-1] = -1  # a padding row
    topk = torch.randint(0, S, (rows, K), generator=g)
    topk[0, K // 2:] = -1
    return (torch.randn(rows, H, DC, generator=g), torch.randn(rows, H, DR, generator=g), topk, slots,
            torch.randn(rows, DC + DR, generator=g))


# --------------------------------------------------------------------------- a graph that only writes


def prefill(cache, slots, rows):
    """Stores the step's KV and attends over nothing of the cache (a prompt attends over itself)."""
    OPS.kv_store.default(cache, slots, rows)
    return rows.sum()


def prefill_by_index_put(cache, slots, rows):
    cache[slots.clamp(min=0)] = rows  # the model author's spelling (no padding rows here)
    return rows.sum()


def decode(q_nope, q_pe, cache, topk):
    out, _ = OPS.sparse_mla.default(q_nope, q_pe, cache, topk, 0.3)
    return out


def _write_then_read_rank(rank, world, writer):
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world)
    opts = {"dcp_size": world, "merge": "ag", "lowering": "fx"}
    write = torch.compile(globals()[writer], backend="dsa_dcp", options=opts, fullgraph=True)
    read = torch.compile(decode, backend="dsa_dcp", options=opts, fullgraph=True)
    q_nope, q_pe, topk, slots, rows = _inputs(1)
    if writer == "prefill_by_index_put":
        slots, rows = slots[:-1], rows[:-1]
    write(cache, slots, rows)
    written = dsa_dcp.backend_report().summary["kv_writes"]
    return cache.clone(), read(q_nope, q_pe, cache, topk), written


def _single_rank(writer):
    cache = torch.zeros(S, DC + DR)
    q_nope, q_pe, topk, slots, rows = _inputs(1)
    if writer == "prefill_by_index_put":
        slots, rows = slots[:-1], rows[:-1]
    keep = slots >= 0
    cache[slots[keep]] = rows[keep]
    return cache, decode(q_nope, q_pe, cache, topk)


@pytest.mark.parametrize("writer", ["prefill", "prefill_by_index_put"])
def test_a_graph_that_only_writes_a_dcp_cache_is_localized(writer):
    ref_cache, ref_out = _single_rank(writer)
    world = 2
    ranks = run_on_ranks(_write_then_read_rank, world, writer)
    slots = torch.arange(S)
    for r, (cache, out, written) in enumerate(ranks):
        assert written == 1
        mine = owner(slots, world) == r
        assert torch.equal(cache[local_row(slots[mine], world)], ref_cache[mine]), f"rank {r} stored other rows"
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- every spelling of the ops


def step_with_packets(q_nope, q_pe, cache, topk, slots, rows):
    OPS.kv_store(cache, slots=slots, rows=rows)  # the packet, arguments by name
    out, _ = OPS.sparse_mla(q_nope, q_pe, kv=cache, topk=topk, sm_scale=0.3)
    return out


def _packets_rank(rank, world):
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world)
    step = torch.compile(step_with_packets, backend="dsa_dcp",
                         options={"dcp_size": world, "merge": "ag", "lowering": "fx"}, fullgraph=True)
    q_nope, q_pe, topk, slots, rows = _inputs(2)
    out = step(q_nope, q_pe, cache, topk, slots, rows)
    return out, dsa_dcp.backend_report().summary


def test_the_op_packets_and_keyword_arguments_are_rewritten():
    q_nope, q_pe, topk, slots, rows = _inputs(2)
    ref = step_with_packets(q_nope, q_pe, torch.zeros(S, DC + DR), topk, slots, rows)
    for out, summary in run_on_ranks(_packets_rank, 2):
        assert summary["sparse_attention_nodes"] == 1 and summary["kv_writes"] == 1 and summary["remaps"] == 1
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_cache_allocated_for_a_group_is_refused_without_options():
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=2)
    torch._dynamo.reset()
    step = torch.compile(step_with_packets, backend="dsa_dcp", fullgraph=True)
    with pytest.raises(Exception) as err:
        step(*_inputs(3)[:2], cache, *_inputs(3)[2:])
    cause = _root_cause(err.value)
    assert isinstance(cause, DCPValidationError), repr(err.value)
    (problem,) = cause.problems
    assert "was allocated for dcp_size=2" in problem and "but compiled for dcp_size=1" in problem
    assert "pass options={'dcp_size': 2, ...}" in problem


def _position_cache_step(kind: str):
    """A model whose position caches were allocated for 2 ranks, compiled without DCP options: the
    plain model after ``shard_position_caches``, or a transformers model generating with
    ``DCPStaticCache(dcp_size=2)``."""
    if kind == "plain":
        from dsa_dcp.models.plain import Transformer, init_weights, tiny_args
        from dsa_dcp.position_cache import shard_position_caches

        model = init_weights(Transformer(tiny_args(max_seq_len=8)), seed=0).eval()
        shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=2)
        step = torch.compile(model, backend="dsa_dcp", fullgraph=True)
        return lambda: step(torch.randint(0, 64, (2, 3)), 0)
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts, tiny_model

    model = tiny_model("deepseek_v32")
    model.compile(backend="dsa_dcp", fullgraph=True)
    ids, mask = left_padded_prompts((3, 4), model.config.vocab_size)
    cache = DCPStaticCache(model.config, max_cache_len=8, batch_size=2, dcp_size=2)
    return lambda: model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("kind", ["plain", "transformers"])
def test_a_position_cache_allocated_for_a_group_is_refused_without_options(kind):
    """Regression: the lowering's internal ``AssertionError: position cache ... is used whole``."""
    if kind == "transformers":
        pytest.importorskip("transformers")
    torch._dynamo.reset()
    run = _position_cache_step(kind)
    with pytest.raises(Exception) as err, torch.no_grad():
        run()
    cause = _root_cause(err.value)
    assert isinstance(cause, DCPValidationError), repr(err.value)
    assert cause.problems and all("was allocated for dcp_size=2, interleave=1 (this rank holds 4 of its 8 positions) "
                                  "but compiled for dcp_size=1; pass options={'dcp_size': 2, 'interleave': 1, ...}" in p
                                  for p in cause.problems), cause.problems
    assert cause.problems[0].startswith("position cache "), cause.problems


def test_a_dcp_compilation_that_rewrites_nothing_says_so():
    torch._dynamo.reset()
    with fake_group(2):
        f = torch.compile(lambda x: x * 2, backend="dsa_dcp", options={"dcp_size": 2, "lowering": "fx"}, fullgraph=True)
        with pytest.warns(DCPCompileWarning, match="has no sparse attention node and touches no KV cache"):
            f(torch.ones(3))


# --------------------------------------------------------------------------- ranks that disagree

MISMATCHES = [  # (option, rank 0's value, rank 1's value)
    ("interleave", 1, 2),
    ("merge", "a2a", "ag"),
    ("debug_checks", False, True),
    ("allow_multi_host", False, True),
]


def _mismatch_rank(rank, world):
    from one_trace import OneTrace

    from dsa_dcp.models import DSAModel, get_config

    cfg = get_config("glm5.2-tiny", n_layers=2)
    values = {name: by_rank[rank] for name, *by_rank in MISMATCHES}
    # the interleave is the layout the model's caches were allocated for: a model of its own; the
    # other options are compiled over one trace of one model (tests/one_trace.py)
    groups = [("interleave",), tuple(name for name in values if name != "interleave")]
    rows = torch.zeros(4, dtype=torch.int64)
    errors = {}
    for names in groups:
        torch._dynamo.reset()
        model = DSAModel(cfg, 128, dcp_size=world, interleave=values["interleave"] if "interleave" in names else 1)
        backend = OneTrace({name: {"dcp_size": world, "lowering": "fx", name: values[name]} for name in names})
        step = torch.compile(model, backend=backend, fullgraph=True)
        for name in names:
            backend.select(name)
            try:
                with torch.no_grad():
                    step(rows, rows, rows, rows - 1, torch.zeros(1, 2, dtype=torch.int32))
                errors[name] = "compiled"
            except Exception as e:  # noqa: BLE001
                cause = _root_cause(e)
                errors[name] = cause.problems if isinstance(cause, DCPValidationError) else repr(e)
    return errors


def test_ranks_compiled_with_different_options_are_refused_naming_the_values():
    ranks = run_on_ranks(_mismatch_rank, 2, timeout=240)
    for name, a, b in MISMATCHES:
        for errors in ranks:
            problems = errors[name]
            assert isinstance(problems, list), problems
            expected = f"option {name} differs across the DCP group (rank 0: {a!r}, rank 1: {b!r})"
            assert any(expected in p for p in problems), problems


def _one_token_differs_rank(rank, world):
    """Greedy generation over the standard schedule; on rank 1 one token of one step differs. Without
    and with debug_checks, compiled over one trace (tests/one_trace.py): debug_checks -> tokens or error."""
    from one_trace import OneTrace

    from dsa_dcp.debug_checks import DCPRuntimeCheckError
    from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    batch = standard_test_batch(cfg, max_new_tokens=3, seed=7)
    torch._dynamo.reset()
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=11)
    backend = OneTrace({checks: {"dcp_size": world, "lowering": "fx", "debug_checks": checks} for checks in (False, True)})
    step = torch.compile(model, backend=backend, fullgraph=True)
    calls = []

    def fed(input_ids, positions, req_ids, slots, page_table):
        calls.append(1)
        if rank == 1 and len(calls) == 2:  # the second step: one row's token differs on rank 1
            input_ids = input_ids.clone()
            input_ids[1] = (input_ids[1] + 1) % cfg.vocab_size
        return step(input_ids, positions, req_ids, slots, page_table)

    results = {}
    for checks in (False, True):
        backend.select(checks)
        model.reset_caches()
        calls.clear()
        try:
            with torch.no_grad():
                results[checks] = generate(fed, batch, 3, pad_to=16).tokens
        except DCPRuntimeCheckError as e:
            results[checks] = f"DCPRuntimeCheckError at step {len(calls)}: {e}"
    return results


def test_a_token_that_differs_on_one_rank_is_named_by_the_debug_checks():
    """Regression: one token changed on rank 1 for one step changed rank 0's tokens, and debug_checks did
    not notice (the top-k agrees while the contexts are shorter than the top-k). The step-input check
    names the input, the rank and the entry on every rank, before the step's first collective."""
    ranks = run_on_ranks(_one_token_differs_rank, 2, timeout=300)
    wrong = [r[False] for r in ranks]
    assert isinstance(wrong[0], list) and wrong[0] != wrong[1]  # without the checks: the ranks disagree
    for r in (r[True] for r in ranks):
        assert r.startswith("DCPRuntimeCheckError at step 2: the ranks of the DCP group were given different step "
                            "inputs: L['input_ids'] differs on ranks [1] from rank 0's (first at index 1: rank 1 has "), r
        assert "Every rank of a DCP group must be fed the same inputs every step" in r, r


# --------------------------------------------------------------------------- a page past the pool

POOL = 100  # slots; pages of 4 (the tiny configs' page size): page 25 holds slots 100..103
PAST_THE_POOL = [  # (index cache, interleave, where page 25 is)
    ("sharded", 4, "written"),  # generated tokens: slots 100..103 fell into rank 1's spare rows
    ("replicated", 1, "one_slot"),  # only slot 100 is written: its owner alone raised, its peer waited
    ("sharded", 1, "future"),  # a page no row writes yet: only the indexer reads it
]


def _past_the_pool_batch(cfg, where):
    import dataclasses

    from dsa_dcp.models import make_requests

    batch = make_requests(cfg, [3, 1 if where == "one_slot" else 2], max_new_tokens=3, num_slots=POOL, seed=3)
    page_table = batch.page_table.clone()
    page_table[1, -1 if where == "future" else 0] = 25
    return dataclasses.replace(batch, page_table=page_table)


def _first_error(fn):
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001 - the test compares it
        return f"{type(e).__name__}: {e}"
    return "no error"


def _past_the_pool_rank(rank, world):
    from dsa_dcp.models import DSAModel, generate, get_config

    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    errors = {}
    for index_cache, interleave, where in PAST_THE_POOL:
        torch._dynamo.reset()
        model = DSAModel(cfg, POOL, dcp_size=world, interleave=interleave, index_cache=index_cache, seed=1)
        step = torch.compile(model, backend="dsa_dcp", fullgraph=True, options={
            "dcp_size": world, "lowering": "fx", "interleave": interleave, "index_cache": index_cache})
        errors[where] = _first_error(lambda: generate(step, _past_the_pool_batch(cfg, where), 1, pad_to=8))
    # a top-k the step is given, one past the pool
    torch._dynamo.reset()
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world)
    q_nope, q_pe, topk, _, _ = _inputs(4)
    topk[1, 0] = S
    read = torch.compile(decode, backend="dsa_dcp", options={"dcp_size": world, "merge": "ag"}, fullgraph=True)
    errors["topk"] = _first_error(lambda: read(q_nope, q_pe, cache, topk))
    return errors


def test_a_page_past_the_pool_raises_the_single_rank_error_on_every_rank():
    """Regression: with a sharded index cache and interleave 4 the step generated tokens; elsewhere only the
    owning rank raised and its peers waited out the collective timeout. Now every rank raises the
    single-rank model's IndexError, before any collective (default lowering for the top-k case)."""
    from dsa_dcp.models import DSAModel, generate, get_config

    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    single = {where: _first_error(lambda: generate(DSAModel(cfg, POOL, seed=1), _past_the_pool_batch(cfg, where), 1,
                                                   pad_to=8))
              for _, _, where in PAST_THE_POOL}
    q_nope, q_pe, topk, _, _ = _inputs(4)
    topk[1, 0] = S
    single["topk"] = _first_error(lambda: decode(q_nope, q_pe, torch.zeros(S, DC + DR), topk))
    for where, err in single.items():
        assert err.startswith("IndexError: index ") and "is out of bounds for dimension 0 with size" in err, err
    ranks = run_on_ranks(_past_the_pool_rank, 2, timeout=300)
    for where, err in single.items():
        for errors in ranks:
            assert errors[where].startswith(err + ": "), (where, errors[where], err)
            assert "past the KV pool" in errors[where] and "so every rank raises this" in errors[where]
    assert "page 25 of request 1" in ranks[0]["future"] and "holds slots 100 to 103" in ranks[0]["future"]
    assert "of the step's top-k input" in ranks[0]["topk"]


_PAST_THE_POOL_ON_CUDA = """
import torch
from dsa_dcp.ops import CHECK_SLOTS
CHECK_SLOTS(torch.tensor([3, -1, 100], device="cuda"), 100, "the step's write slots")
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_the_pool_checks_on_cuda_are_device_assertions_without_a_host_sync():
    """On CUDA the checks never wait for the host (sync debug mode 'error'), Inductor keeps them and a
    CUDA graph captures them; a slot past the pool fails the device-side assertion (in a process of its
    own: the assertion ends the CUDA context)."""
    import os
    import subprocess
    import sys

    from dsa_dcp.ops import CHECK_PAGES, CHECK_SLOTS

    slots = torch.tensor([3, -1, 99], device="cuda")
    page_table = torch.tensor([[0, 24], [5, -1]], dtype=torch.int32, device="cuda")
    req_ids = torch.tensor([0, 1, -1], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        checked, pages = CHECK_SLOTS(slots, 100, "slots"), CHECK_PAGES(page_table, req_ids, 4, 100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(checked, slots) and torch.equal(pages, page_table)

    def step(slots, page_table, req_ids):
        return CHECK_SLOTS(slots, 100, "slots") * 2, CHECK_PAGES(page_table, req_ids, 4, 100) + 1

    compiled = torch.compile(step, backend="inductor", mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out = compiled(slots, page_table, req_ids)
    torch.cuda.synchronize()
    assert torch.equal(out[0], slots * 2) and torch.equal(out[1], page_table + 1)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _PAST_THE_POOL_ON_CUDA], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "device-side assert" in proc.stderr or "Assertion" in proc.stderr, proc.stderr[-2000:]


# --------------------------------------------------------------------------- a step retried on one rank

_fault = {"rank": -1, "call": -1, "calls": 0}


@dsa_dcp.sparse_attention
def faulty_attention(q_nope, q_pe, kv, topk, sm_scale):
    """The reference attention, which raises on the armed call (a failure inside one layer)."""
    _fault["calls"] += 1
    if _fault["calls"] == _fault["call"]:
        raise RuntimeError("injected failure")
    return dsa_dcp.kernels.sparse_mla_reference(q_nope, q_pe, kv, topk, sm_scale)


def layered_step(q_nope, q_pe, caches, topk, slots, rows):
    h = q_nope
    for cache in caches:
        OPS.kv_store.default(cache, slots, rows)
        out, _ = faulty_attention(h, q_pe, cache, topk, 0.3)
        h = h + out
    return h


def _retry_rank(rank, world):
    caches = [dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world) for _ in range(LAYERS)]
    step = torch.compile(layered_step, backend="dsa_dcp", fullgraph=True,
                         options={"dcp_size": world, "merge": "ag", "lowering": "fx", "debug_checks": True})
    step(*_inputs(4)[:2], caches, *_inputs(4)[2:])  # step 0: every rank completes it
    if rank == 1:  # step 1: rank 1 fails inside layer 2 ...
        _fault["calls"], _fault["call"] = 0, 3
    try:
        step(*_inputs(5)[:2], caches, *_inputs(5)[2:])
        first = "completed"
    except Exception as e:  # noqa: BLE001
        first = f"{type(e).__name__}: {e}"
    if rank == 1:  # ... and retries the step alone, as an engine that retries locally would
        try:
            step(*_inputs(5)[:2], caches, *_inputs(5)[2:])
            return first, "completed"
        except Exception as e:  # noqa: BLE001
            return first, f"{type(e).__name__}: {e}"
    return first, None


def test_a_step_retried_on_one_rank_fails_the_group_under_debug_checks():
    (rank0, _), (rank1_first, rank1_retry) = run_on_ranks(_retry_rank, 2, timeout=240)
    assert "injected failure" in rank1_first
    for message in (rank0, rank1_retry):
        assert "DCPRuntimeCheckError" in message and "out of step" in message, message
        assert "every rank must abandon it" in message


# --------------------------------------------------------------------------- dynamic shapes, int positions


def _dynamic_rank(rank, world):
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world)
    step = torch.compile(step_with_packets, backend="dsa_dcp", options={"dcp_size": world, "lowering": "fx"})
    outs = [step(*_inputs(6 + rows, rows)[:2], cache, *_inputs(6 + rows, rows)[2:]) for rows in (3, 5, 7)]
    return outs


def test_batch_sizes_compile_with_symbolic_shapes():
    """The default ``dynamic`` makes the batch symbolic after the first recompile; every pass copes."""
    refs, cache = [], torch.zeros(S, DC + DR)
    for rows in (3, 5, 7):
        refs.append(step_with_packets(*_inputs(6 + rows, rows)[:2], cache, *_inputs(6 + rows, rows)[2:]))
    for outs in run_on_ranks(_dynamic_rank, 2, timeout=240):
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def step_at(q_nope, q_pe, cache, topk, slots, rows, start: int):
    OPS.kv_store.default(cache, slots, rows)
    out, _ = OPS.sparse_mla.default(q_nope, q_pe, cache, topk, 0.3)
    return out * start


def test_a_step_recompiled_for_every_int_position_is_named():
    torch._dynamo.reset()
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=2)
    with fake_group(2):
        step = torch.compile(step_at, backend="dsa_dcp", dynamic=False, fullgraph=True,
                             options={"dcp_size": 2, "merge": "ag", "lowering": "fx"})
        args = list(_inputs(7))
        with warnings.catch_warnings():
            warnings.simplefilter("error", DCPCompileWarning)
            step(*args[:2], cache, *args[2:], start=3)
        with pytest.warns(DCPCompileWarning, match="specialized the step on a Python value, such as a position "
                                                   "passed as an int") as caught:
            step(*args[:2], cache, *args[2:], start=4)
    assert "step_at" in str(caught[0].message) and "Pass positions as tensors" in str(caught[0].message)


# --------------------------------------------------------------------------- epilogues in the wild


class FusedWeightLayer(torch.nn.Module):
    """An attention epilogue as published inference code writes it: the value up-projection sliced
    per step out of a fused ``wkv_b`` parameter, the output projection with a bias, ``.type_as(x)``."""

    def __init__(self, v: int = 5, hidden: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.v = v
        self.wkv_b = torch.nn.Parameter(torch.randn(H, 3 + v, DC, generator=g) * 0.3)  # [H, nope + v, Dc]
        self.wo = torch.nn.Linear(H * v, hidden)
        with torch.no_grad():
            self.wo.weight.copy_(torch.randn(hidden, H * v, generator=g) * 0.3)
            self.wo.bias.copy_(torch.randn(hidden, generator=g))

    def forward(self, q_nope, q_pe, cache, topk, slots, rows):
        OPS.kv_store.default(cache, slots, rows)
        out, _ = OPS.sparse_mla.default(q_nope, q_pe, cache, topk, 0.3)
        o = torch.einsum("bhc,hdc->bhd", out, self.wkv_b[:, -self.v:])  # a per-step slice of the fused weight
        return self.wo(o.flatten(1).float()).type_as(q_nope)


def _epilogue_rank(rank, world, merge):
    layer = FusedWeightLayer()
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=world)
    step = torch.compile(layer, backend="dsa_dcp", fullgraph=True,
                         options={"dcp_size": world, "merge": merge, "lowering": "fx"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DCPCompileWarning)  # no fallback to ag: the epilogue is sharded
        with torch.no_grad():
            out = step(*_inputs(8)[:2], cache, *_inputs(8)[2:])
    return out, dsa_dcp.backend_report().summary


@pytest.mark.parametrize("merge", ["a2a", "ag_rs"])
def test_a_value_weight_sliced_from_a_fused_parameter_and_a_type_as_tail_are_sharded(merge):
    layer = FusedWeightLayer()
    with torch.no_grad():
        ref = layer(*_inputs(8)[:2], torch.zeros(S, DC + DR), *_inputs(8)[2:])
    for out, summary in run_on_ranks(_epilogue_rank, 2, merge):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert summary["collectives"] == {"a2a": 2, "ag_rs": 3}[merge]  # the merge's, + the epilogue's all-reduce
