import os

# Triton kernels run under the interpreter on CPU-only machines; it must be set before any
# kernel is defined.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # On a CPU, Inductor compiles in this process and in each rank, one kernel after another: its
    # pool of compile workers (a new process per compiling process, importing torch again) costs
    # more CPU than it saves while the suite's workers and ranks keep every core busy. Ranks and
    # scripts the tests start inherit both settings (set before torch._inductor is imported).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # ... and scalar C++ (no at::vec): a cold kernel builds in a third of the time (a 2-layer step's
    # 18 kernels: 18 s -> 7 s of g++ on this machine); its reductions may add in another order,
    # within the tests' fp32 tolerances. examples/one_device.py's test (tests/test_examples.py)
    # compiles vectorized C++, as users get it.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402


# On 2 or more cores the suite runs on worker processes (pytest-xdist, in the `test` extra), one
# test file per worker at a time: two workers, or a worker per two cores up to 4 on more (the
# multi-rank tests start processes of their own). On this project's 2-core machine two workers keep
# both cores busy (2% idle over a whole run; one process keeps a core idle while a test waits on
# its ranks, a timeout or a compile). Not on a CUDA machine (the GPU
# tests share one GPU). `-n 0` (or DSA_DCP_TEST_WORKERS=0) runs it in this process, `-n N` or
# DSA_DCP_TEST_WORKERS=N on N workers.
@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if not hasattr(config.option, "numprocesses") or config.option.numprocesses is not None or _cuda \
            or "PYTEST_XDIST_WORKER" in os.environ:  # a worker runs its tests itself
        return
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("DSA_DCP_TEST_WORKERS", 1 if cores < 2 else min(4, max(2, cores // 2))))
    if workers > 1 and config.option.dist == "no" and not config.getoption("usepdb", False):
        config.option.numprocesses, config.option.dist = workers, "loadfile"


def pytest_collection_modifyitems(config, items):
    if _cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Hypothesis profiles for tests/test_properties.py: `ci` (the default) is small and reproducible
# (derandomized: the same examples every run); `soak` runs many random examples.
#   HYPOTHESIS_PROFILE=soak python -m pytest tests/test_properties.py
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - the property tests skip without hypothesis
    pass
else:
    _slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile(
        "ci",
        max_examples=30,
        deadline=None,
        derandomize=True,  # the same examples on every run and machine
        database=None,  # and no replay of failures saved by an earlier local run
        print_blob=True,
        suppress_health_check=_slow_ok,
    )
    settings.register_profile(
        "soak", max_examples=2000, deadline=None, print_blob=True, suppress_health_check=_slow_ok
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# One intra-op thread in the test process, as dsa_dcp.launch gives every rank: the tiny models' ops
# are far too small to split, and on a 2-core machine the second thread mostly spins (an eager
# tiny-model step: 24.8 -> 12.8 s of CPU). The single-rank references then run as the ranks do.
@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Ranks kept between runs (dsa_dcp.launch.keep_ranks): the end-to-end modules that start many
# short gloo runs opt in with `pytestmark = pytest.mark.usefixtures("kept_ranks")`; every other
# test starts its own ranks, as a user's program does.
@pytest.fixture
def kept_ranks():
    from dsa_dcp import launch

    launch.keep_ranks(True)
    try:
        yield
    finally:
        launch.keep_ranks(False)


@pytest.fixture(scope="session", autouse=True)
def _stop_kept_ranks():
    yield
    from dsa_dcp import launch

    launch.stop_kept_ranks()
