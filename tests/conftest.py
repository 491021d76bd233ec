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

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
