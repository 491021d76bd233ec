"""Where the backend files each ``CompileReport`` so ``dsa_dcp.inspect(compiled)`` can find it.

A report is filed under the object dynamo compiled, as it appears in the frame being traced:

- the module instance (``self`` of the compiled ``forward``) when the frame is a method of an
  ``nn.Module`` — ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``_orig_mod`` is
  that instance, so two instances of one class never share reports;
- otherwise the frame's code object — ``torch.compile(fn)`` keeps ``fn`` as
  ``_torchdynamo_orig_callable``, and ``fn.__code__`` is the code dynamo traced.

The frame is read from dynamo's current instruction translator while the backend runs. If that
is unavailable (another torch version), the report is kept with weak references to the graph's
tensor inputs, and a module is matched by its parameters and buffers being among them (dynamo
lifts them to graph inputs). Keys and tensors are held weakly: the registry never keeps a model
alive.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

MAX_REPORTS = 16
_by_key: WeakIdKeyDictionary = WeakIdKeyDictionary()
# reports whose frame could not be found, with their tensor inputs (held weakly)
_unkeyed: list[tuple[Any, WeakIdKeyDictionary]] = []


def traced_frame() -> tuple[Any, types.CodeType | None]:
    """``(self or None, code)`` of the frame dynamo is compiling now, if it can be found."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside dynamo, or another torch
        return None, None
    if tx is None:
        return None, None
    code = getattr(tx, "f_code", None)
    self_obj = None
    if code is not None and code.co_argcount >= 1:
        candidate = getattr(tx, "f_locals", {}).get(code.co_varnames[0])
        if isinstance(candidate, torch.nn.Module):
            self_obj = candidate
    return self_obj, code


def record(report: Any, example_inputs: Sequence[Any]) -> list[Any]:
    """File ``report`` under the compiled module or function; returns the keys used."""
    module, code = traced_frame()
    keys: list[Any] = [module] if module is not None else ([code] if code is not None else [])
    for key in keys:
        filed = _by_key.setdefault(key, [])
        filed.append(report)
        del filed[:-MAX_REPORTS]  # recompiles: keep the latest few
    if not keys:
        tensors = WeakIdKeyDictionary()
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                tensors[x] = True
        _unkeyed.append((report, tensors))
        del _unkeyed[:-MAX_REPORTS]
    return keys


def keys_for(obj: Any) -> list[Any]:
    """The registry keys a user's object may be filed under (compiled or original)."""
    keys = []
    orig = getattr(obj, "_orig_mod", None)  # OptimizedModule
    if isinstance(orig, torch.nn.Module):
        keys.append(orig)
    if isinstance(obj, torch.nn.Module):
        keys.append(obj)
    fn = obj
    seen = set()
    while hasattr(fn, "_torchdynamo_orig_callable") and id(fn) not in seen:
        seen.add(id(fn))
        fn = fn._torchdynamo_orig_callable
    for f in (fn, getattr(fn, "__self__", None), getattr(fn, "__func__", None), getattr(obj, "forward", None)):
        if isinstance(f, torch.nn.Module):
            keys.append(f)
        code = getattr(getattr(f, "__func__", f), "__code__", None)
        if code is not None:
            keys.append(code)
    return keys


def reports_for(obj: Any) -> list[Any]:
    """Every report filed for ``obj`` (a ``torch.compile`` result, or the module/function given to it)."""
    keys = keys_for(obj)
    for key in keys:
        found = _by_key.get(key)
        if found:
            return list(found)
    for module in (k for k in keys if isinstance(k, torch.nn.Module)):
        owned = list(module.parameters()) + list(module.buffers())
        found = [r for r, tensors in _unkeyed if any(t in tensors for t in owned)]
        if found:
            return found
    return []
