"""Reference DSA models (DeepSeek-V3.2-, GLM-5-, GLM-5.2-shaped), their configs and a paged runner."""

from .config import ALIASES, CONFIGS, DSAConfig, get_config
from .dsa import DSAModel, TensorParallel, shard_for_tp
from .runner import GenerationResult, Request, RequestBatch, generate, make_requests, standard_test_batch

__all__ = [
    "ALIASES", "CONFIGS", "DSAConfig", "DSAModel", "GenerationResult", "Request", "RequestBatch",
    "TensorParallel", "generate", "get_config", "make_requests", "shard_for_tp", "standard_test_batch",
]
