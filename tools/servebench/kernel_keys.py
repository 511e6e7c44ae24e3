"""Which Triton kernel specialisations a benchmark's timed requests launch first
(`KernelLaunches`): the check that a warm-up covered every timed path.

Triton compiles a kernel once per specialisation: its constexpr arguments, the dtype of
each tensor argument and whether its address is 16-byte aligned, and for each integer
argument whether it is 1, a multiple of 16, or beyond 32 bits (unless the kernel says
`do_not_specialize`, which for a tensor drops the alignment), plus launch options such as `num_warps`. `KernelLaunches` records,
while `recording()` is active, that key for every launch (through `JITFunction.run` on
a GPU and `InterpretedFunction.run` under TRITON_INTERPRET, so the same check runs on
the CPU), with the label of what was running (`label`, set by the caller: a warm-up,
or `workload/method/state`). `seal()` ends the warm-up; `cold()` lists the keys first
launched after it: on a GPU each is a compilation (and, for autotuned kernels, a tuning
sweep) that a timed request paid. Computing a key at every launch costs host time, so
the recorder is a diagnostic.

`CompileCounter` is the check that costs a timed request nothing: between units of work
(never inside one) it counts the kernels Triton holds compiled in this process (each
`JITFunction`'s per-device kernel cache), so a count that grew across a unit means that
unit met a specialisation first (compiled it, or loaded it from the on-disk cache). On
the CPU nothing is compiled (the interpreter keeps no kernel cache): the counts stay 0.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class ColdLaunch:
    """A kernel specialisation first launched after the warm-up, and by what."""

    label: str
    kernel: str
    key: str


def _value_key(name: str, value: Any, constexpr: bool, no_specialize: bool) -> Any:
    if constexpr:
        return ("c", repr(value))
    if isinstance(value, torch.Tensor):
        if no_specialize:
            return ("t", str(value.dtype))
        return ("t", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        if no_specialize:
            return ("i", abs(value) >= 2**31)
        return ("i", value == 1, value % 16 == 0, abs(value) >= 2**31)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return None
    return (type(value).__name__,)


_PARAMS: dict = {}  # kernel function -> its parameters (name, is constexpr), read once


def _params(fn) -> list[tuple[str, bool]]:
    got = _PARAMS.get(fn)
    if got is None:
        got = _PARAMS[fn] = [(n, "constexpr" in str(p.annotation)) for n, p in inspect.signature(fn).parameters.items()]
    return got


def launch_key(fn, do_not_specialize, args: tuple, kwargs: dict) -> tuple[str, str]:
    """(kernel name, specialisation key) of one launch of the Python kernel `fn` (module
    docstring); arguments it does not take (launch options) are part of the key."""
    params = _params(fn)
    names = [n for n, _ in params]
    bound = dict(zip(names, args))
    extra = {}
    for k, v in kwargs.items():
        (bound if k in names else extra)[k] = v
    dns = set(do_not_specialize or ())
    parts = []
    for i, (n, constexpr) in enumerate(params):
        if n not in bound:
            continue
        parts.append((n, _value_key(n, bound[n], constexpr, n in dns or i in dns)))
    parts += [(k, repr(v)) for k, v in sorted(extra.items())]
    return fn.__name__, repr(parts)


class KernelLaunches:
    """The recorder (module docstring). Not thread-safe: launches come from the engine's
    thread."""

    def __init__(self) -> None:
        #: what is running now (set by the caller); recorded with each new key
        self.label = ""
        self.first_label: dict[tuple[str, str], str] = {}
        self.sealed = False
        self._cold: list[ColdLaunch] = []

    def launched(self, kernel: str, key: str) -> None:
        k = (kernel, key)
        if k in self.first_label:
            return
        self.first_label[k] = self.label
        if self.sealed:
            self._cold.append(ColdLaunch(self.label, kernel, key))

    def seal(self) -> None:
        """The warm-up is over: keys first launched from now on are cold launches."""
        self.sealed = True

    def cold(self) -> list[dict]:
        return [c.__dict__.copy() for c in self._cold]

    def count(self) -> int:
        return len(self.first_label)

    @contextlib.contextmanager
    def recording(self) -> Iterator["KernelLaunches"]:
        """Record every Triton launch in this process while the block runs (the kernel
        classes' `run` wrapped, and restored after)."""
        patched = []
        for cls, dns_of in _kernel_classes():
            real = cls.run

            def run(kernel_self, *args, _real=real, _dns=dns_of, **kwargs):
                if not kwargs.get("warmup"):
                    fn = kernel_self.fn
                    call_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                    self.launched(*launch_key(fn, _dns(kernel_self), args, call_kwargs))
                return _real(kernel_self, *args, **kwargs)

            cls.run = run
            patched.append((cls, real))
        try:
            yield self
        finally:
            for cls, real in patched:
                cls.run = real


def compiled_kernels() -> dict[str, int]:
    """Kernels held compiled by Triton in this process, per kernel name (the entries of
    every JITFunction's per-device kernel caches); {} without Triton."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return {}
    out: dict[str, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        found = [obj for obj in gc.get_objects() if isinstance(obj, JITFunction)]
    for obj in found:
        n = 0
        for entry in list(getattr(obj, "device_caches", {}).values()):
            cache = entry[0] if isinstance(entry, tuple) and entry else None
            n += len(cache) if isinstance(cache, dict) else 0
        if n:
            name = getattr(getattr(obj, "fn", None), "__name__", repr(obj))
            out[name] = out.get(name, 0) + n
    return out


class CompileCounter:
    """Kernels compiled between two calls (module docstring): `since()` answers the kernels
    whose compiled count grew since the last call (or construction), by name."""

    def __init__(self) -> None:
        self._last = self._count()

    @staticmethod
    def _count() -> dict[str, int]:
        try:
            return compiled_kernels()
        except Exception:  # noqa: BLE001  (a check that cannot read Triton's caches must not end the run)
            return {}

    def since(self) -> dict[str, int]:
        now = self._count()
        grew = {k: n - self._last.get(k, 0) for k, n in now.items() if n > self._last.get(k, 0)}
        self._last = now
        return grew


def _kernel_classes() -> list:
    """Triton's kernel classes whose `run` launches a kernel, each with how to read its
    do_not_specialize list; none without Triton."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - CPU installs without triton launch nothing
        return []
    return [(JITFunction, lambda k: getattr(k, "do_not_specialize", None)),
            (InterpretedFunction, lambda k: (getattr(k, "kwargs", None) or {}).get("do_not_specialize"))]
