"""`HostSyncGuard`: records the operations of a block of code that would make the host wait
for a CUDA device, or that copy between host memory and the device (either breaks CUDA-graph
capture), on any device, the CPU included, so a CPU test can pin "decode_step never
synchronises" (torch.cuda.set_sync_debug_mode needs a GPU).

Two torch modes watch the code:
- a `TorchFunctionMode` (Python-level calls, which on the CPU never reach aten): `tolist`,
  `item`, `cpu`, `numpy`, `bool/int/float/index` of a tensor, `.to("cpu")`, `nonzero`,
  `where(cond)` with one argument, and `t[tensor_index] = python_scalar` (index_put_ copies
  the scalar from pageable host memory to the device: a synchronising copy, refused in
  graph capture);
- a `TorchDispatchMode` (aten ops): nonzero, _local_scalar_dense, masked_select, unique*,
  repeat_interleave without output_size, bincount, index/index_put with a bool index,
  copies to the CPU from another device, and any non-view aten op on a registered *host*
  tensor (`host_tensors`, e.g. the HiSparse mirror: on CUDA each is a host<->device copy;
  the mirror may only be touched by the Triton gather kernel, which reads it by address).

Not recorded: operations run by the Triton interpreter (TRITON_INTERPRET=1 moves kernel
arguments itself) and frames listed in `exempt` (functions whose host reads run on the CPU
only, e.g. the kernels' CPU range checks, `CPU_ONLY_CHECKS`). Each record carries the last
frames of project code that led to it. `ops` counts the non-view aten ops the code ran
(outside the interpreter): on CUDA roughly its kernel launches, the cost of an eager step.
"""
from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncGuard", "SyncRecord", "CPU_ONLY_CHECKS"]

#: (file suffix, function) whose host reads happen only for CPU tensors (guarded by
#: `device.type == "cpu"`): range checks of kernel arguments that CUDA skips
CPU_ONLY_CHECKS: tuple[tuple[str, str], ...] = (
    ("kernels/paged_decode_attention.py", "_validate"),
    ("kernels/hisparse_select.py", "_validate_scores"),
    ("engine/models/decoder.py", "_check_ids"),
)

_T = torch.Tensor
_HOST_READS = {_T.tolist: "tolist", _T.item: "item", _T.cpu: ".cpu()", _T.numpy: "numpy",
               _T.__bool__: "bool(tensor)", _T.__int__: "int(tensor)", _T.__float__: "float(tensor)",
               _T.__index__: "index(tensor)", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
               torch.argwhere: "argwhere"}
_SYNC_OPS = ("nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2",
             "unique_consecutive", "unique_dim", "bincount", "histc", "equal", "is_nonzero")
_SKIP_FRAMES = ("triton/runtime/interpreter", "triton/language/")
_QUIET_OPS = ("is_pinned", "_pin_memory", "empty_like", "empty", "empty_strided", "set_", "detach")


@dataclass
class SyncRecord:
    """One offending operation: `op` (aten or Python name), `reason`, `where` (the last
    frames of project code, innermost last)."""

    op: str
    reason: str
    where: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.op}: {self.reason} at {' <- '.join(reversed(self.where))}"


def _is_cpu_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cpu"
    return isinstance(d, str) and d.split(":")[0] == "cpu"


def _tensor_index(idx: Any) -> list[torch.Tensor]:
    items = idx if isinstance(idx, tuple) else (idx,)
    return [i for i in items if isinstance(i, torch.Tensor)]


class _Functions(TorchFunctionMode):
    def __init__(self, guard: "HostSyncGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _HOST_READS.get(func)
        if name is not None:
            self.guard._note(name, "reads a tensor on the host (a device->host copy and a sync on CUDA)")
        elif func is torch.where and len(args) + len(kwargs) == 1:
            self.guard._note("where(cond)", "is nonzero: its output size depends on the data (sync)")
        elif func is _T.to and (any(_is_cpu_device(a) for a in args[1:]) or _is_cpu_device(kwargs.get("device"))):
            self.guard._note(".to(cpu)", "copies to the host (a device->host copy and a sync on CUDA)")
        elif func is _T.__setitem__ and len(args) == 3:
            value = args[2]
            if isinstance(value, (bool, int, float)) and _tensor_index(args[1]):
                self.guard._note("setitem(tensor index, python scalar)",
                                 "index_put_ copies the scalar from pageable host memory to the device "
                                 "(synchronising; refused in CUDA-graph capture): use index_fill_ or a device tensor")
        return func(*args, **kwargs)


class _Aten(TorchDispatchMode):
    def __init__(self, guard: "HostSyncGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view and not self.guard._in_interpreter():
            self.guard.ops += 1
        reason = self._reason(func, name, args, kwargs)
        if reason is not None:
            self.guard._note(f"aten::{name}", reason)
        return func(*args, **kwargs)

    def _reason(self, func, name: str, args, kwargs) -> Optional[str]:
        if name in _SYNC_OPS:
            return "has a data-dependent result read by the host (sync)"
        if name == "repeat_interleave" and kwargs.get("output_size") is None and \
                any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args[:2]) and \
                not (len(args) > 1 and isinstance(args[1], int)):
            return "without output_size computes its size on the host (sync)"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                return "with a boolean mask index is nonzero (sync)"
        if name in ("_to_copy", "copy_", "copy"):
            src, dst_cpu = (args[1], args[0].device.type == "cpu") if name != "_to_copy" else \
                (args[0], _is_cpu_device(kwargs.get("device")))
            if isinstance(src, torch.Tensor) and dst_cpu and src.device.type != "cpu":
                return "copies from the device to the host (sync)"
        if self.guard._host_ptrs and not func.is_view and name not in _QUIET_OPS:
            for a in list(args) + list(kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.guard._host_ptrs:
                        return "touches a host tensor through aten (a host<->device copy on CUDA; not graph-safe)"
        return None


class HostSyncGuard:
    """`with HostSyncGuard(host_tensors=[...]) as g: ...`; then `g.records` (module docstring)."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = (),
                 exempt: tuple[tuple[str, str], ...] = CPU_ONLY_CHECKS) -> None:
        self._host_ptrs = {t.untyped_storage().data_ptr() for t in host_tensors}
        self.exempt = exempt
        self.records: list[SyncRecord] = []
        self.ops = 0
        self._modes: list[Any] = []

    def __enter__(self) -> "HostSyncGuard":
        self._modes = [_Functions(self), _Aten(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []

    @staticmethod
    def _in_interpreter() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if any(s in frame.f_code.co_filename.replace("\\", "/") for s in _SKIP_FRAMES):
                return True
            frame = frame.f_back
        return False

    def _note(self, op: str, reason: str) -> None:
        frame = sys._getframe(2)
        frames = []
        while frame is not None:
            fn = frame.f_code.co_filename.replace("\\", "/")
            if any(s in fn for s in _SKIP_FRAMES):
                return
            if any(fn.endswith(f) and frame.f_code.co_name == fun for f, fun in self.exempt):
                return
            frames.append(frame)
            frame = frame.f_back
        where = [f"{s.filename}:{s.lineno} in {s.name}" for s in traceback.extract_stack(frames[0])
                 if "/torch/" not in s.filename.replace("\\", "/") and s.filename != __file__]
        self.records.append(SyncRecord(op, reason, where[-4:]))
