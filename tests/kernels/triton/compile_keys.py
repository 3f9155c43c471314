"""The compile keys a GPU would use for our Triton launches, recorded on the CPU.

Triton compiles one binary per (kernel, signature specialisation, constexpr values, launch
options): an integer argument specialises on `== 1` and `% 16 == 0`, a pointer on 16-byte
alignment, unless the kernel lists it in `do_not_specialize`. Under TRITON_INTERPRET=1 nothing
is compiled, so `record_keys()` patches the interpreter's launch and computes, for every launch,
the key the JIT cache would look up — with Triton's own specialisation function
(`native_specialize_impl`, the one `JITFunction` binds), the kernel's own `do_not_specialize`
lists and the launch's constexprs and options. Two launches with one key share one compile on
the H200; a new key mid-serve is a compile a request waits for (issue 20 item 6).

    with record_keys(execute=False) as keys:   # execute=False: record only, run nothing
        ...launches...
    keys["_router_topk_kernel"]  -> set of keys
"""
from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def compile_key(fn_obj: Any, args: tuple, kwargs: dict) -> tuple:
    """The JIT cache key of one launch of the interpreted kernel `fn_obj` (without the source
    hash and target, which are the same for every launch of one kernel on one GPU)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sig = inspect.signature(fn_obj.fn)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    opts = {k: v for k, v in kwargs.items() if k not in names}
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names})
    dns = set(fn_obj.kwargs.get("do_not_specialize") or ())
    dns_oa = set(fn_obj.kwargs.get("do_not_specialize_on_alignment") or ())
    key = []
    for i, p in enumerate(params):
        if p.name not in bound.arguments:
            key.append((p.name, "default"))
            continue
        a = bound.arguments[p.name]
        if _is_constexpr(p):
            key.append((p.name, repr(a)))
        elif a is None:
            key.append((p.name, "None"))
        else:
            spec = not (i in dns or p.name in dns)
            align = not (i in dns_oa or p.name in dns_oa)
            key.append((p.name, native_specialize_impl(BaseBackend, a, False, spec, align)))
    return tuple(key) + tuple(sorted((k, repr(v)) for k, v in opts.items()))


@contextlib.contextmanager
def record_keys(execute: bool = True) -> Iterator[dict[str, set]]:
    """{kernel name: its distinct compile keys} over the launches inside the block. With
    `execute=False` the kernels do not run (a shape sweep whose outputs nobody reads)."""
    from triton.runtime.interpreter import InterpretedFunction

    keys: dict[str, set] = collections.defaultdict(set)
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        keys[self.fn.__name__].add(compile_key(self, args, kwargs))
        if execute:
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = run
    try:
        yield keys
    finally:
        InterpretedFunction.run = orig


def diff(keys: dict[str, set]) -> str:
    """Per kernel, which arguments differ between its keys: what made the compiles."""
    out = []
    for name, ks in sorted(keys.items()):
        ks = list(ks)
        varying = sorted({ks[0][j][0] for k in ks[1:] for j in range(min(len(k), len(ks[0])))
                          if k[j] != ks[0][j]})
        out.append(f"{name}: {len(ks)} keys, varying {varying}")
    return "\n".join(out)
