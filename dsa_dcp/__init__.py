"""dsa_dcp: decode context parallelism for DeepSeek-Sparse-Attention models, as a torch.compile backend.

Public API: ``sparse_attention`` (the model-author decorator), ``DCPOptions`` (the backend's
options), ``allocate_kv_cache`` (a rank's KV cache for a DCP group), ``backend`` (the callable registered as ``backend="dsa_dcp"``), ``inspect`` (what the
backend did to a compiled model: ``dsa_dcp.inspect(compiled)``).
"""

from dsa_dcp import ops as _ops  # noqa: F401  registers the op vocabulary
from dsa_dcp.backend import dsa_dcp_backend as backend
from dsa_dcp.backend import last_report as backend_report
from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.decorator import SparseAttentionContractError, sparse_attention
from dsa_dcp.kv_cache import allocate_kv_cache
from dsa_dcp import inspect  # a callable package: dsa_dcp.inspect(compiled)

__version__ = "0.1.0"

__all__ = [
    "DCPOptions",
    "OptionsError",
    "SparseAttentionContractError",
    "allocate_kv_cache",
    "backend",
    "backend_report",
    "inspect",
    "sparse_attention",
    "__version__",
]
