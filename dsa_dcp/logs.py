"""The compiler's logs under torch's logging switches: ``TORCH_LOGS=dsa_dcp`` and ``set_logs``.

Every logger of this package is named ``dsa_dcp.*`` (``dsa_dcp.passes``, ``dsa_dcp.backend``,
``dsa_dcp.lowering``, ...). ``register()`` makes ``dsa_dcp`` a log name of ``torch._logging``:

- ``TORCH_LOGS=dsa_dcp``: INFO, one line per pass with its stats, per compilation;
- ``TORCH_LOGS=+dsa_dcp``: DEBUG, pass-level detail (nodes added and removed, every refusal of a
  pass with its reason);
- ``torch._logging.set_logs(dsa_dcp=logging.INFO)`` from Python (the same as
  ``set_logs(modules={"dsa_dcp": logging.INFO})``). ``set_logs`` takes a fixed list of keywords,
  so ``register()`` wraps it once with one more, ``dsa_dcp``, passed on as ``modules``; every
  other argument goes to torch's own ``set_logs`` unchanged.

As with torch's own logs, ``TORCH_LOGS`` takes precedence over ``set_logs``.
"""

from __future__ import annotations

import functools
from typing import Any

NAME = "dsa_dcp"


def register() -> None:
    """Register ``dsa_dcp`` with ``torch._logging`` (idempotent)."""
    import torch._logging
    from torch._logging import _internal

    if not _internal.log_registry.is_log(NAME):
        _internal.register_log(NAME, NAME)
    set_logs = torch._logging.set_logs
    if getattr(set_logs, "_dsa_dcp_wrapped", False):
        return

    @functools.wraps(set_logs)
    def set_logs_with_dsa_dcp(*, dsa_dcp: int | None = None, modules: dict[str, Any] | None = None,
                              **kwargs: Any) -> None:
        if dsa_dcp is not None:
            modules = {**(modules or {}), NAME: dsa_dcp}
        return set_logs(modules=modules, **kwargs)

    set_logs_with_dsa_dcp._dsa_dcp_wrapped = True  # type: ignore[attr-defined]
    torch._logging.set_logs = set_logs_with_dsa_dcp

