"""Every bad option value is an ``OptionsError`` naming the option, the value and what is allowed;
``dsa_dcp.compile`` reports it before anything is traced; ``mode`` is mapped or refused by name."""

import time

import pytest
import torch

import dsa_dcp
from dsa_dcp.config import MODES, DCPOptions, OptionsError
from dsa_dcp.inspection.targets import fake_group

# (options, the option named, the value as the message shows it, what is allowed)
BAD = [
    ({"dcp_size": 2, "rank": True}, "rank", "True", "[0, dcp_size)"),
    ({"dcp_size": 2, "rank": 1.0}, "rank", "1.0", "[0, dcp_size)"),
    ({"cuda_graphs": 1}, "cuda_graphs", "1", "None, True or False"),
    ({"cuda_graphs": 0}, "cuda_graphs", "0", "None, True or False"),
    ({"cuda_graphs": 1.0}, "cuda_graphs", "1.0", "None, True or False"),
    ({"share_remaps": 1}, "share_remaps", "1", "True or False"),
    ({"debug_checks": "yes"}, "debug_checks", "'yes'", "True or False"),
    ({"allow_multi_host": 0}, "allow_multi_host", "0", "True or False"),
    ({"dcp_size": True}, "dcp_size", "True", "an integer >= 1"),
    ({"dcp_size": 2.0}, "dcp_size", "2.0", "an integer >= 1"),
    ({"interleave": False}, "interleave", "False", "an integer >= 1"),
    ({"page_size": True}, "page_size", "True", "None or an integer >= 1"),
    ({"batch_sizes": [1, True]}, "batch_sizes", "(1, True)", "increasing list of integers >= 1"),
    ({"group": 0}, "group", "0", "None (the world group), a torch.distributed ProcessGroup or a group name"),
    ({"group": 12}, "group", "12", "None (the world group), a torch.distributed ProcessGroup or a group name"),
    ({"group": ["dcp"]}, "group", "['dcp']", "a group name (str)"),
    ({"merge": ["a2a"]}, "merge", "['a2a']", "['ag', 'a2a', 'ag_rs', 'fused_a2a']"),
    ({"lowering": None}, "lowering", "None", "['fx', 'inductor']"),
    ({"mode": "lite"}, "mode", "'lite'", str(list(MODES))),
    ({"mode": "max-autotune", "lowering": "fx"}, "mode", "'max-autotune'", "lowering='inductor'"),
    ({"mode": "reduce-overhead", "cuda_graphs": False}, "mode", "'reduce-overhead'", "cuda_graphs=False"),
    ({"mode": "max-autotune-no-cudagraphs", "cuda_graphs": True}, "mode", "'max-autotune-no-cudagraphs'",
     "cuda_graphs=True"),
]


@pytest.mark.parametrize("options, key, shown, allowed", BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_a_bad_value_names_the_option_the_value_and_what_is_allowed(options, key, shown, allowed):
    with pytest.raises(OptionsError) as err:
        DCPOptions.parse(options)
    message = str(err.value)
    assert key in message and shown in message and allowed in message, message


def test_an_arbitrary_object_as_group_is_refused():
    class NotAGroup:
        def __repr__(self):
            return "<NotAGroup>"

    with pytest.raises(OptionsError, match=r"group must be None .* got NotAGroup <NotAGroup>"):
        DCPOptions.parse({"dcp_size": 2, "group": NotAGroup()})


@pytest.mark.parametrize("options", ["a2a", 5, ["dcp_size", 2]], ids=["str", "int", "list"])
def test_options_that_are_not_a_dict_are_refused(options):
    with pytest.raises(OptionsError) as err:
        DCPOptions.parse(options)
    message = str(err.value)
    assert "options must be a dict" in message and repr(options) in message and "DCPOptions" in message


def test_a_bad_value_through_torch_compile_is_an_options_error():
    f = torch.compile(lambda x: x + 1, backend="dsa_dcp", options="a2a")
    with pytest.raises(Exception) as err:
        f(torch.zeros(2))
    assert isinstance(dsa_dcp.entry.find_dcp_error(err.value), OptionsError), repr(err.value)


def test_a_group_name_must_name_a_group_of_this_process():
    layer = torch.nn.Linear(2, 2).requires_grad_(False)
    with fake_group(2):
        step = dsa_dcp.compile(layer, dcp_size=2, group="no-such-group")  # a str parses; it is resolved when compiling
        with pytest.raises(OptionsError, match=r"group='no-such-group' names no process group of this process; "
                                               r"the groups here are \['0'\]"):
            step(torch.zeros(1, 2))


def test_valid_values_still_parse():
    opts = DCPOptions.parse({"dcp_size": 2, "rank": 1, "cuda_graphs": False, "batch_sizes": [1, 8], "group": "0"})
    assert (opts.rank, opts.cuda_graphs, opts.batch_sizes, opts.group) == (1, False, (1, 8), "0")
    assert DCPOptions.parse(opts) is opts


@pytest.mark.parametrize(
    "mode, lowering, cuda_graphs, inductor",
    [
        ("default", "inductor", None, {}),
        ("reduce-overhead", "inductor", None, {}),  # CUDA graphs where the step runs on CUDA: the default
        ("max-autotune", "inductor", None, {"max_autotune": True, "coordinate_descent_tuning": True}),
        ("max-autotune-no-cudagraphs", "inductor", False, {"max_autotune": True, "coordinate_descent_tuning": True}),
    ],
)
def test_each_mode_maps_to_options(mode, lowering, cuda_graphs, inductor):
    opts = DCPOptions.parse({"mode": mode})
    assert (opts.mode, opts.lowering, opts.cuda_graphs, opts.inductor_config()) == (mode, lowering, cuda_graphs,
                                                                                       inductor)
    assert opts.cache_key() != DCPOptions.parse({}).cache_key() or mode == "default"


@pytest.mark.parametrize("mode", ["default", "max-autotune"])
def test_a_group_of_ranks_asks_inductor_for_deterministic_choices(mode):
    """Over a group, Inductor must not pick a reduction's tiling by each rank's own timing: ranks
    would round the values they replicate (hidden states, logits, a draft's cache) differently."""
    import torch._inductor.config as inductor

    alone, group = DCPOptions.parse({"mode": mode}), DCPOptions.parse({"mode": mode, "dcp_size": 2})
    assert "deterministic" not in alone.inductor_config()
    assert group.inductor_config().get("deterministic") is (True if hasattr(inductor, "deterministic") else None)
    assert {k: v for k, v in group.inductor_config().items() if k != "deterministic"} == alone.inductor_config()


def test_compile_refuses_a_misspelled_option_before_tracing():
    calls = []

    def model(x):
        calls.append(1)  # dynamo would run this while tracing
        return x + 1

    start = time.perf_counter()
    with pytest.raises(OptionsError, match=r"unknown dsa_dcp option\(s\) \['dcp'\]; valid options are \['dcp_size'"):
        dsa_dcp.compile(model, dcp=2)
    assert time.perf_counter() - start < 1.0 and not calls
    with pytest.raises(OptionsError, match=r"merge must be one of .*, got 'allgather'"):
        dsa_dcp.compile(model, merge="allgather")
    with pytest.raises(OptionsError, match=r"mode must be one of .*, got 'fast'"):
        dsa_dcp.compile(model, mode="fast")


TOO_BIG = [
    ({"dcp_size": 10**30}, "dcp_size must be at most 2147483647 (sizes reach the kernels as 32-bit integers), "
                           "got 1000000000000000000000000000000"),
    ({"interleave": 2**31}, "interleave must be at most 2147483647"),
    ({"page_size": 2**40}, "page_size must be at most 2147483647"),
    ({"dcp_size": 2**16, "interleave": 2**16}, "dcp_size * interleave must be at most 2147483647"),
    ({"batch_sizes": [1, 2**31]}, "batch_sizes must be a non-empty increasing list of integers >= 1 (at most "
                                  "2147483647), got (1, 2147483648)"),
]


@pytest.mark.parametrize("options, message", TOO_BIG, ids=[str(o) for o, _ in TOO_BIG])
def test_sizes_past_what_the_kernels_take_are_refused(options, message):
    with pytest.raises(OptionsError) as err:
        DCPOptions.parse(options)
    assert message in str(err.value), str(err.value)
    with pytest.raises(OptionsError):  # before any tracing
        dsa_dcp.compile(lambda x: x, **options)


@pytest.mark.parametrize("flags, message", [
    ({"dynamic": "no"}, "dynamic must be None, True or False, got 'no'"),
    ({"dynamic": 0}, "dynamic must be None, True or False, got 0"),
    ({"fullgraph": "yes"}, "fullgraph must be True or False, got 'yes'"),
    ({"fullgraph": 1}, "fullgraph must be True or False, got 1"),
], ids=["dynamic='no'", "dynamic=0", "fullgraph='yes'", "fullgraph=1"])
def test_compile_checks_torch_compile_flags_by_type_before_tracing(flags, message):
    calls = []

    def model(x):
        calls.append(1)
        return x + 1

    with pytest.raises(OptionsError, match="invalid torch.compile flags") as err:
        step = dsa_dcp.compile(model, **flags)
        step(torch.zeros(2))
    assert message in str(err.value) and not calls
    # the decorator form checks them too
    with pytest.raises(OptionsError, match="invalid torch.compile flags"):
        dsa_dcp.compile(**flags)
