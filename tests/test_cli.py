"""The command line: arguments checked before any rank starts, with the valid values listed; a
refusal printed once per group; a line per stage; ``python -m dsa_dcp`` and ``--version``."""

import os
import re
import subprocess
import sys

import pytest
import torch

import dsa_dcp
from dsa_dcp import cli, demo
from dsa_dcp.launch import RankError, run_on_ranks
from dsa_dcp.models import DSAModel, get_config
from dsa_dcp.models.runner import decode_step_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = "deepseek-v3.2, deepseek-v3.2-tiny, glm5, glm5-tiny, glm5.2, glm5.2-tiny, glm5.1, glm5.1-tiny"


def test_python_m_dsa_dcp_and_version():
    done = subprocess.run([sys.executable, "-m", "dsa_dcp", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"dsa-dcp {dsa_dcp.__version__}", done.stderr


@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if a rank would be started."""

    def spawned(*args, **kwargs):
        raise AssertionError("a rank was started for arguments that should have been refused")

    monkeypatch.setattr(demo, "run_on_ranks", spawned)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--dcp", "0"], "argument --dcp: must be an integer >= 1, got 0"),
        (["demo", "--interleave", "0"], "argument --interleave: must be an integer >= 1, got 0"),
        (["demo", "--steps", "two"], "argument --steps: must be an integer >= 1, got 'two'"),
        (["demo", "--layers", "-1"], "argument --layers: must be an integer >= 0, got -1"),
        (["demo", "--model", "glm-5.2-tiny"], f"--model 'glm-5.2-tiny' is not a built-in config; valid: {NAMES}"),
        (["demo", "--merge", "allgather"], "argument --merge: invalid choice: 'allgather' (choose from"),
        (["demo", "--dcp", "3"], "--dcp 3 with --merge a2a: glm5.2-tiny has 4 attention heads, which this merge "
                                 "splits evenly over the group; valid --dcp: 1, 2, 4 (or --merge ag)"),
        (["inspect", "glm-5.2-tiny"], f"TARGET 'glm-5.2-tiny' is neither a built-in config nor module:factory; "
                                      f"built-in configs: {NAMES}"),
        (["inspect", "glm5.2-tiny", "--gpu-mem", "0"], "argument --gpu-mem: must be a number > 0, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv, message, no_ranks, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.count("error:") == 1


# ------------------------------------------------------------------ a refusal, once per group

def _compile_the_global_cache(rank, world):
    """Every rank compiles a model whose KV caches are the global ones: refused on each rank."""
    cfg = get_config("glm5.2-tiny", n_layers=2)
    inputs, num_slots = decode_step_inputs(cfg, 2, 7, "cpu")
    step = dsa_dcp.compile(DSAModel(cfg, num_slots), dcp_size=world)  # dcp_size=world missing in the model
    with torch.no_grad():
        step(*inputs)


def test_a_refusal_on_every_rank_is_printed_once(capsys):
    with pytest.raises(RankError) as info:
        run_on_ranks(_compile_the_global_cache, 2, timeout=120)
    err = info.value
    assert set(err.exceptions) == {0, 1}
    assert {t for t, _ in err.exceptions.values()} == {"dsa_dcp.validate.DCPValidationError"}
    assert cli._rank_refusals(err, "demo", 2) == 2
    printed = capsys.readouterr().err
    message = err.exceptions[0][1]
    assert printed == f"dsa-dcp demo: DCPValidationError: {message}\n"
    assert "kv" in message.lower() and "dcp_size" in message  # the rule that refused, named


def test_a_failure_that_is_no_refusal_is_shown_in_full():
    err = RankError("1 of 2 rank(s) did not return a result", {1: "failed"}, {1: ("builtins.ValueError", "bug")})
    assert cli._rank_refusals(err, "demo", 2) is None


# ------------------------------------------------------------------ progress, end to end

def test_demo_prints_its_stages_and_the_result(capfd):
    # the sizes examples/cpu_ranks.py runs at in tests/test_examples.py (16 rows a step): Inductor
    # finds most of the kernels that run built (here: 7 s to compile after it, against 29 s at 8 rows)
    assert cli.main(["demo", "--layers", "2", "--steps", "2"]) == 0
    out, err = capfd.readouterr()
    assert "tokens match single rank    yes" in out
    stages = re.findall(r"^\[\s*(\d+\.\d)s\] (.*)$", err, flags=re.M)
    assert [s for _, s in stages] == [
        "starting 2 CPU rank(s) over gloo",
        "rank 0: joined the process group of 2",
        "rank 0: single-rank reference generated (6 engine steps, eager)",
        "rank 0: compiled (the first DCP step ran)",
        "rank 0: DCP steps done (6 engine steps)",
        "every rank finished",
    ], err
    times = [float(t) for t, _ in stages]
    assert times == sorted(times)


def one_layer_model(dcp_size=1):
    """A ``module:factory`` for ``dsa-dcp inspect``: GLM-5.2-tiny cut to one layer (4 heads)."""
    cfg = get_config("glm5.2-tiny", n_layers=1)
    inputs, num_slots = decode_step_inputs(cfg, 2, 7, "cpu")
    return DSAModel(cfg, num_slots, dcp_size=dcp_size), inputs


def test_inspect_prints_its_stages_and_a_refusal_once(monkeypatch, capsys):
    monkeypatch.chdir(HERE)
    torch.compiler.reset()
    assert cli.main(["inspect", "test_cli:one_layer_model", "--dcp", "2"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"sparse attention nodes\s+1\n", captured.out)
    assert re.findall(r"^\[\s*\d+\.\ds\] (.*)$", captured.err, flags=re.M) == [
        "inspect: compiling test_cli:one_layer_model for rank 0 of 2 (merge a2a) in this process",
        "inspect: compiled and analysed",
    ]
    torch.compiler.reset()
    assert cli.main(["inspect", "test_cli:one_layer_model", "--dcp", "3", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsa-dcp inspect: DCPValidationError: dsa_dcp cannot compile this program")
    assert err.count("dsa-dcp inspect:") == 1 and "Traceback" not in err and "heads" in err


def test_bench_indexer_topk_paths(monkeypatch):
    """``bench indexer --topk-paths`` passes the forced top-k paths to time (all by default, none
    when given alone), named as ``bench.indexer.TOPK_PATHS`` names them; an unknown one is refused."""
    import dsa_dcp.bench.indexer as bench_indexer

    seen = []
    monkeypatch.setattr(bench_indexer, "main", lambda args: seen.append(args.topk_paths) or 0)
    for extra, want in (([], list(bench_indexer.TOPK_PATHS)), (["--topk-paths"], []),
                        (["--topk-paths", "row", "sampled_split"], ["row", "sampled_split"])):
        assert cli.main(["bench", "indexer", "--only", "topk", *extra]) == 0
        assert seen.pop() == want
    with pytest.raises(SystemExit):
        cli.main(["bench", "indexer", "--topk-paths", "chunked"])
