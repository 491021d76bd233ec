"""dsa_dcp: decode context parallelism for DeepSeek-Sparse-Attention models, as a torch.compile backend.

Public API: ``sparse_attention`` (the model-author decorator), ``DCPOptions`` (the backend's
options), ``backend`` (the callable registered as ``backend="dsa_dcp"``).
"""

from dsa_dcp import ops as _ops  # noqa: F401  registers the op vocabulary
from dsa_dcp.backend import dsa_dcp_backend as backend
from dsa_dcp.backend import last_report as backend_report
from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.decorator import SparseAttentionContractError, sparse_attention

__version__ = "0.1.0"

__all__ = ["DCPOptions", "OptionsError", "SparseAttentionContractError", "backend", "backend_report", "sparse_attention", "__version__"]
