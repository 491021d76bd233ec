"""Where the Triton kernels run in this test process, shared by the kernel test files.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without CUDA before anything imports
triton, so the kernels run on CPU tensors under the interpreter. If triton was imported before
that (a test file run in a process that had already imported it), the interpreter cannot be
switched on any more: those files then rerun themselves in a fresh process
(``rerun_in_fresh_interpreter``) and skip their Triton cases here.
"""

import os
import subprocess
import sys
import zlib

import pytest
import torch

from dsa_dcp.kernels import _common
from dsa_dcp.kernels import kv_store as kv_store_mod
from dsa_dcp.kernels import lse_combine as lse_combine_mod
from dsa_dcp.kernels import sparse_mla as sparse_mla_mod
from dsa_dcp.kernels import topk_remap as topk_remap_mod

INTERPRET = _common.is_interpreted(topk_remap_mod._topk_remap_kernel)
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
NEEDS_FRESH_PROCESS = DEVICE == "cpu" and not (INTERPRET and _common.interpreter_ready())
SKIP_REASON = "triton was imported without TRITON_INTERPRET=1; test_in_fresh_interpreter runs this case"


def rerun_in_fresh_interpreter(test_file: str, *pytest_args: str, timeout: float = 900) -> None:
    """Run ``test_file`` under pytest in a new process with ``TRITON_INTERPRET=1``; fail with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file), *pytest_args]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.fixture(autouse=True)
def interpreter_or_fresh_process(request):
    """Imported by a kernel test file: its Triton cases skip where the interpreter cannot run in
    this process (``NEEDS_FRESH_PROCESS``), and its ``test_in_fresh_interpreter`` runs them."""
    if NEEDS_FRESH_PROCESS and request.node.originalname != "test_in_fresh_interpreter":
        pytest.skip(SKIP_REASON)


def fresh_interpreter_test(test_file: str):
    """``test_in_fresh_interpreter = fresh_interpreter_test(__file__)`` in a kernel test file: the
    test that reruns the file under the interpreter where this process cannot."""

    @pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the interpreter works in this process")
    def test_in_fresh_interpreter():
        rerun_in_fresh_interpreter(test_file, timeout=600)

    return test_in_fresh_interpreter


def seeded(*params) -> torch.Generator:
    """A CPU generator seeded from ``params`` (a test's parametrization): fresh inputs per case,
    the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def on_device(*ts):
    """``ts`` with each tensor moved to ``DEVICE`` (other values as they are)."""
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]
