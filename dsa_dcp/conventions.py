"""What ``torch.compile`` users expect of a backend, in one place: ``mode=``, grad mode, reset.

- ``options_with_mode``: ``torch.compile(model, backend="dsa_dcp", mode=...)`` passes ``mode`` to
  the backend as a keyword (torch refuses ``mode`` and ``options`` together); it becomes the
  ``mode`` option, which ``DCPOptions.parse`` maps or refuses by name.
- ``grad_mode_problems``: the backend compiles inference steps. A step compiled with autograd on
  and inputs that require grad (a module's parameters) would return outputs that carry autograd
  history through ops that have no backward (``lse_combine``, the collectives); it is refused at
  compile time with the fix named (``torch.no_grad()`` / ``torch.inference_mode()``).
- ``on_compiler_reset``: ``torch.compiler.reset()`` (and ``torch._dynamo.reset()``) also runs
  the given callbacks, so ``dsa_dcp.backend_report()`` is cleared with dynamo's caches. Torch has
  no reset hook (checked in 2.11 and 2.13: ``torch.compiler.reset`` calls ``torch._dynamo.reset()``
  through the module attribute), so the attribute is wrapped once; code that bound
  ``from torch._dynamo import reset`` before ``dsa_dcp`` was imported keeps the unwrapped one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch

GRAD_MODE_MESSAGE = (
    "the dsa_dcp backend compiles inference steps, but this step is being compiled with autograd "
    "enabled and {n} input(s) that require grad (e.g. the module's parameters), so its outputs would "
    "carry autograd history through ops that have no backward; call the compiled model under "
    "`with torch.no_grad():` or `with torch.inference_mode():` (or call model.requires_grad_(False) once)"
)


def options_with_mode(options: Any, mode: str | None) -> Any:
    """``options`` with torch.compile's ``mode=`` folded in as the ``mode`` option."""
    if mode is None:
        return options
    from dsa_dcp.config import DCPOptions, OptionsError

    if isinstance(options, DCPOptions):  # only what was set, so the mode can pick the rest
        defaults = DCPOptions()
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                   if getattr(options, f.name) != getattr(defaults, f.name)}
    if options is not None and not isinstance(options, dict):
        return options  # DCPOptions.parse names what is wrong with it
    options = dict(options or {})
    if options.get("mode", mode) != mode:
        raise OptionsError(f"mode={mode!r} given to torch.compile, but options has mode={options['mode']!r}; "
                           f"give it once")
    options["mode"] = mode
    return options


def grad_mode_problems(example_inputs: Sequence[Any]) -> list[str]:
    """The refusal of a step compiled under autograd with inputs that require grad (or none)."""
    if not torch.is_grad_enabled():
        return []
    n = sum(1 for t in example_inputs if isinstance(t, torch.Tensor) and t.requires_grad)
    return [GRAD_MODE_MESSAGE.format(n=n)] if n else []


_reset_callbacks: list[Callable[[], None]] = []


def on_compiler_reset(callback: Callable[[], None]) -> None:
    """Run ``callback()`` after every ``torch.compiler.reset()`` / ``torch._dynamo.reset()``."""
    if callback not in _reset_callbacks:
        _reset_callbacks.append(callback)
    import torch._dynamo

    dynamo_reset = torch._dynamo.reset
    if getattr(dynamo_reset, "_dsa_dcp_wrapped", False):
        return

    @functools.wraps(dynamo_reset)
    def reset() -> None:
        dynamo_reset()
        for fn in list(_reset_callbacks):
            fn()

    reset._dsa_dcp_wrapped = True  # type: ignore[attr-defined]
    torch._dynamo.reset = reset
