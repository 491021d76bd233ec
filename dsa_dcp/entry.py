"""``dsa_dcp.compile(model, **options)``: ``torch.compile`` with this backend, options checked first.

``torch.compile(model, backend="dsa_dcp", options={...})`` checks nothing until the first call:
dynamo traces the whole model, then the backend parses the options, and dynamo wraps whatever the
backend raises (``BackendCompilerFailed``; an error raised while tracing, such as a
``SparseAttentionContractError``, arrives as ``TorchRuntimeError``). ``dsa_dcp.compile``:

- parses the options (``DCPOptions.parse``) before anything is traced, so a bad key or value
  raises ``OptionsError`` at once, naming the option, the value and what is allowed;
- checks ``torch.compile``'s own flags by type (``fullgraph`` is ``True``/``False``, ``dynamic``
  is ``None``/``True``/``False``: ``torch.compile`` itself accepts ``fullgraph="yes"`` and fails on
  ``dynamic="no"`` deep inside dynamo);
- then calls ``torch.compile(model, backend="dsa_dcp", ...)`` with ``fullgraph=True`` and
  ``dynamic=False`` unless given (a DCP step must never fall back to the model's own code, and
  an engine pads rows to fixed buckets);
- returns what ``torch.compile`` returned (an ``OptimizedModule`` for a module, a function for a
  function), whose calls re-raise this package's own errors (``DCP_ERRORS``) unwrapped from
  dynamo's wrappers, so ``except dsa_dcp.OptionsError`` / ``DCPValidationError`` /
  ``SparseAttentionContractError`` / ``DCPRewriteError`` catch them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.conventions import options_with_mode


def dcp_errors() -> tuple[type[BaseException], ...]:
    """This package's refusals: what ``compile`` re-raises unwrapped, and the CLI prints in a line."""
    from dsa_dcp.config import OptionsError
    from dsa_dcp.decorator import SparseAttentionContractError
    from dsa_dcp.passes.errors import DCPRewriteError
    from dsa_dcp.validate import DCPValidationError

    return (OptionsError, DCPValidationError, SparseAttentionContractError, DCPRewriteError)


def find_dcp_error(exc: BaseException) -> BaseException | None:
    """The refusal of this package behind ``exc`` (itself, or what a dynamo wrapper holds), if any."""
    ours = dcp_errors()
    if isinstance(exc, ours):
        return exc
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(exc, TorchDynamoException):  # only dynamo's wrappers are looked through
        return None
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ours):
            return cause
        seen.add(id(cause))
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return None


def unwrapping_dcp_errors(fn: Callable) -> Callable:
    """``fn`` whose calls raise this package's refusals as themselves, not inside dynamo's wrappers."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            ours = find_dcp_error(e)
            if ours is None or ours is e:
                raise
            raise ours from None  # one error, ours, not a wrapper around it

    return call


def compile_flag_problems(fullgraph: object, dynamic: object) -> list[str]:
    """One message per bad ``torch.compile`` flag given to ``dsa_dcp.compile`` (checked by type, as the
    options are: a string or an int is not a flag)."""
    problems = []
    if not isinstance(fullgraph, bool):
        problems.append(f"fullgraph must be True or False, got {fullgraph!r}")
    if not (dynamic is None or isinstance(dynamic, bool)):
        problems.append(f"dynamic must be None, True or False, got {dynamic!r}")
    return problems


def compile(model: Any = None, *, fullgraph: bool = True, dynamic: bool | None = False, mode: str | None = None,
            **options: Any) -> Any:
    """``torch.compile(model, backend="dsa_dcp", options=options)``, with the options parsed now.

    ``options`` are ``DCPOptions`` fields as keywords (``dcp_size=2, merge="a2a"``); ``mode`` is
    ``torch.compile``'s (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
    ``"max-autotune-no-cudagraphs"``; see ``DCPOptions``). Raises ``OptionsError`` before any
    tracing. Without ``model``, returns a decorator. See the module docstring.
    """
    opts = DCPOptions.parse(options_with_mode(options, mode))
    flag_problems = compile_flag_problems(fullgraph, dynamic)
    if flag_problems:
        raise OptionsError("invalid torch.compile flags:\n  " + "\n  ".join(flag_problems))
    if model is None:
        return lambda m: compile(m, fullgraph=fullgraph, dynamic=dynamic, mode=mode, **options)
    compiled = torch.compile(model, backend="dsa_dcp", options=opts, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(compiled, torch.nn.Module):  # an OptimizedModule: its forward runs the compiled code
        compiled.forward = unwrapping_dcp_errors(compiled.forward)
        return compiled
    return unwrapping_dcp_errors(compiled)

