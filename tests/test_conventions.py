"""torch.compile's conventions: ``mode=``, grad mode, ``torch.compiler.reset()``, ``TORCH_LOGS``,
and ``dsa_dcp.compile`` raising this package's errors unwrapped."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsa_dcp
from dsa_dcp.config import OptionsError
from dsa_dcp.validate import DCPValidationError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(x)


def _linear(seed=0):
    torch.manual_seed(seed)
    return _Projection()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_accepts_mode(mode):
    torch.compiler.reset()
    layer, x = _linear(), torch.randn(3, 8)
    step = torch.compile(layer, backend="dsa_dcp", mode=mode)
    with torch.no_grad():
        torch.testing.assert_close(step(x), layer(x))
    opts = dsa_dcp.backend_report().options
    assert opts.mode == mode
    assert opts.lowering == "inductor"  # the default, and what max-autotune needs


def test_an_unsupported_mode_is_refused_by_name():
    torch.compiler.reset()
    step = torch.compile(_linear(), backend="dsa_dcp", mode="lite")
    with pytest.raises(Exception) as err, torch.no_grad():
        step(torch.randn(3, 8))
    ours = dsa_dcp.entry.find_dcp_error(err.value)
    assert isinstance(ours, OptionsError) and "mode must be one of" in str(ours) and "'lite'" in str(ours)


def test_compiling_under_autograd_is_refused_with_the_fix_named():
    layer = _linear()
    step = dsa_dcp.compile(layer)
    with pytest.raises(DCPValidationError) as err:  # raised as itself: dsa_dcp.compile unwraps it
        step(torch.randn(3, 8))
    message = str(err.value)
    assert "compiles inference steps" in message and "torch.no_grad()" in message and "torch.inference_mode()" in message
    assert "2 input(s) that require grad" in message  # the weight and the bias
    with torch.no_grad():
        out = step(torch.randn(3, 8))
    assert not out.requires_grad
    with torch.inference_mode():
        assert not step(torch.randn(3, 8)).requires_grad


def test_autograd_on_is_fine_when_nothing_requires_grad():
    step = dsa_dcp.compile(lambda x, w: x @ w)
    x, w = torch.randn(3, 8), torch.randn(8, 2)
    torch.testing.assert_close(step(x, w), x @ w)


def test_compiler_reset_clears_the_backend_report():
    step = dsa_dcp.compile(_linear())
    with torch.no_grad():
        step(torch.randn(3, 8))
    assert dsa_dcp.backend_report() is not None
    torch.compiler.reset()
    assert dsa_dcp.backend_report() is None
    with torch.no_grad():
        step(torch.randn(3, 8))  # compiles again after the reset
    assert dsa_dcp.backend_report() is not None
    torch._dynamo.reset()
    assert dsa_dcp.backend_report() is None


@dsa_dcp.sparse_attention
def _wrong_shape_attention(q_nope, q_pe, kv, topk, sm_scale):
    return q_nope[:, :1], q_nope.new_zeros(q_nope.shape[:2])


def _attend(q_nope, q_pe, kv, topk):
    return _wrong_shape_attention(q_nope, q_pe, kv, topk, 0.5)[0]


def test_compile_raises_a_contract_error_as_itself():
    step = dsa_dcp.compile(_attend)
    args = torch.randn(2, 4, 16), torch.randn(2, 4, 8), torch.randn(32, 24), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(dsa_dcp.SparseAttentionContractError, match="_wrong_shape_attention"):
        step(*args)
    torch.compiler.reset()
    with pytest.raises(Exception) as err:  # plain torch.compile: dynamo's wrapper, ours inside it
        torch.compile(_attend, backend="dsa_dcp")(*args)
    assert not isinstance(err.value, dsa_dcp.SparseAttentionContractError)
    assert isinstance(dsa_dcp.entry.find_dcp_error(err.value), dsa_dcp.SparseAttentionContractError)


def test_compile_keeps_what_torch_compile_returns_usable():
    torch.compiler.reset()  # another Linear compiled above would serve this one from dynamo's cache
    layer = _linear().requires_grad_(False)
    step = dsa_dcp.compile(layer)
    assert isinstance(step, torch.nn.Module) and step._orig_mod is layer
    x = torch.randn(3, 8)
    torch.testing.assert_close(step(x), layer(x))
    assert dsa_dcp.inspect(step).report.options.dcp_size == 1
    assert dict(step.named_parameters()).keys() == {"_orig_mod.proj.weight", "_orig_mod.proj.bias"}

    @dsa_dcp.compile(fullgraph=False)
    def double(x):
        return 2 * x

    torch.testing.assert_close(double(x), 2 * x)
    assert dsa_dcp.inspect(double).report.options.dcp_size == 1


def test_set_logs_takes_dsa_dcp():
    passes = logging.getLogger("dsa_dcp.passes")
    package = logging.getLogger("dsa_dcp")
    before = (package.level, package.propagate, list(package.handlers))
    try:
        torch._logging.set_logs(dsa_dcp=logging.INFO)
        assert passes.isEnabledFor(logging.INFO) and not passes.isEnabledFor(logging.DEBUG)
        torch._logging.set_logs(dsa_dcp=logging.DEBUG, dynamo=logging.WARNING)
        assert passes.isEnabledFor(logging.DEBUG)
    finally:
        torch._logging.set_logs()
    assert not passes.isEnabledFor(logging.INFO)
    # torch's set_logs leaves the package's logger to its own handler (no propagation): give it back
    # to the root logger, where pytest's log capture listens, for the tests after this one
    package.level, package.propagate, package.handlers[:] = before


_LOGGED_COMPILE = textwrap.dedent("""
    import torch, dsa_dcp
    from dsa_dcp.inspection.targets import fake_group
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.runner import decode_step_inputs

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)
    inputs, num_slots = decode_step_inputs(cfg, 2, 7, "cpu")
    with fake_group(2), torch.no_grad():
        dsa_dcp.compile(DSAModel(cfg, num_slots, dcp_size=2), dcp_size=2, lowering="fx")(*inputs)  # the passes log
""")


@pytest.mark.parametrize("setting", ["dsa_dcp", "+dsa_dcp"])
def test_torch_logs_shows_a_line_per_pass(setting):
    env = dict(os.environ, TORCH_LOGS=setting, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _LOGGED_COMPILE], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    for name in ("localize_kv_writes", "dcp_rewrite", "share_remaps"):
        assert sum(f"pass {name} (rank 0 of 2): {{" in line for line in lines) == 1, done.stderr[-3000:]
    assert any("compiled for rank 0 of 2" in line for line in lines)
    detail = [line for line in lines if "pass dcp_rewrite: +" in line]
    assert len(detail) == (1 if setting.startswith("+") else 0), done.stderr[-3000:]
