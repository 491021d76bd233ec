"""dsa_dcp: decode context parallelism for DeepSeek-Sparse-Attention models, as a torch.compile backend.

Public API: ``compile`` (``torch.compile`` with this backend, options checked before tracing),
``sparse_attention`` (the model-author decorator), ``DCPOptions`` (the backend's options),
``allocate_kv_cache`` (a rank's KV cache for a DCP group), ``allocate_index_cache`` (an
indexer's key cache, replicated or sharded), ``backend`` (the callable registered as
``backend="dsa_dcp"``), ``backend_report`` (what the last compilation did; cleared by
``torch.compiler.reset()``), ``inspect`` (what the backend did to a compiled model:
``dsa_dcp.inspect(compiled)``), and the refusals: ``OptionsError``, ``DCPValidationError``,
``SparseAttentionContractError``, ``DCPRewriteError``. Logs: ``TORCH_LOGS=dsa_dcp`` (``dsa_dcp.logs``).
"""

from dsa_dcp import ops as _ops  # noqa: F401  registers the op vocabulary
from dsa_dcp import ops_positions as _ops_positions  # noqa: F401  ops over position-indexed caches
from dsa_dcp.backend import dsa_dcp_backend as backend
from dsa_dcp.backend import last_report as backend_report
from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.decorator import SparseAttentionContractError, sparse_attention
from dsa_dcp.entry import compile
from dsa_dcp.kv_cache import allocate_index_cache, allocate_kv_cache
from dsa_dcp.passes.errors import DCPRewriteError
from dsa_dcp.validate import DCPValidationError
from dsa_dcp.inspection import inspect  # dsa_dcp.inspect(compiled); the tool is dsa_dcp.inspection
from dsa_dcp import logs as _logs

__version__ = "0.1.0"

_logs.register()  # TORCH_LOGS=dsa_dcp, torch._logging.set_logs(dsa_dcp=...)


def _register_backend_name() -> None:
    """Make ``backend="dsa_dcp"`` work from a source tree on ``PYTHONPATH`` too.

    An installed package is found through its ``torch_dynamo_backends`` entry point, which torch
    loads itself (registering here as well would then be a duplicate); without one, the name is
    registered when the package is imported.
    """
    from importlib.metadata import entry_points

    from torch._dynamo import register_backend

    if any(ep.name == "dsa_dcp" for ep in entry_points(group="torch_dynamo_backends")):
        return
    try:
        register_backend(backend, name="dsa_dcp")
    except AssertionError:  # registered already (a reload)
        pass


_register_backend_name()

__all__ = [
    "DCPOptions",
    "DCPRewriteError",
    "DCPValidationError",
    "OptionsError",
    "SparseAttentionContractError",
    "allocate_index_cache",
    "allocate_kv_cache",
    "backend",
    "backend_report",
    "compile",
    "inspect",
    "sparse_attention",
    "__version__",
]
