"""Start-of-run gradient self-check of fla's linear-attention kernels, and the Hopper guard.

fla-core 0.6 refuses the gated backward `chunk_bwd_dqkwg` on Hopper with triton in
[3.4, 3.7.1) (fla #640: a miscompile of the BK=64 tiling; fla #984 reports wrong delta-rule
`prepare_wy_repr_bwd` dk/dbeta at chunk size 64 on Hopper with triton >= 3.4). The guard is a
module flag (`fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1`) read at call time, so it can be
lifted, but only where the kernels are shown right on the model being trained:

`check_backend_grads(model, ids, kinds, weights, amp)` runs one forward + backward of the
training loss on a small batch three times: the torch path in float32 (the reference), the
torch path under the training autocast (its rounding noise floor) and the fla path under the
training autocast. Per parameter it measures the relative error
`||g - g_ref|| / ||g_ref||`; the fla path passes when every parameter's error is at most
`max(tol, noise_factor * that parameter's torch-autocast error)` and the losses agree to
`tol`. `trainer.train` lifts the guard, runs the check, and keeps fla only if it passes
(else it restores the guard and trains on the torch path); train_log.json's `fla_check`
holds what was measured. On the CPU (no fla) the trainer skips all of this; the check itself
is backend-agnostic, so tests run it with a stand-in for the fla path.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from engine.models.layers.linear_base import LinearMixer

#: the fla module whose flag guards the gated backward on Hopper
GUARD_MODULE = "fla.ops.common.chunk_o"
GUARD_FLAG = "TRITON_ABOVE_3_7_1"
#: default per-parameter relative gradient error allowed on top of the autocast noise floor
DEFAULT_TOL = 0.05
#: the fla path may be this many times noisier than the torch path under the same autocast
NOISE_FACTOR = 3.0


def _guard_module():
    import importlib
    return importlib.import_module(GUARD_MODULE)


def hopper_guard_active() -> bool:
    """True when fla's gated chunk backward would refuse to run on this machine."""
    try:
        mod = _guard_module()
    except Exception:  # fla not importable: nothing to guard
        return False
    return bool(getattr(mod, "IS_NVIDIA_HOPPER", False) and getattr(mod, "TRITON_ABOVE_3_4_0", False)
                and not getattr(mod, GUARD_FLAG, True))


def set_hopper_guard(active: bool) -> None:
    """Restore (`active=True`) or lift (`False`) fla's Hopper guard of the gated backward."""
    setattr(_guard_module(), GUARD_FLAG, not active)


def has_linear_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(m, LinearMixer) for m in model.modules())


@dataclass
class GradCheck:
    """What the self-check measured (train_log.json `fla_check`)."""

    ok: bool
    test_backend: str
    ref_backend: str
    batch_shape: tuple[int, int]
    autocast: str | None
    tol: float
    noise_factor: float
    loss_ref: float
    loss_noise: float
    loss_test: float
    #: worst per-parameter relative error of the test path, and its parameter
    max_rel_err: float
    worst_param: str
    #: the torch-autocast relative error of that same parameter (noise floor)
    worst_param_noise: float
    max_noise_rel_err: float
    #: parameters over their limit: name -> [test error, limit]
    failures: dict[str, list[float]] = field(default_factory=dict)
    #: the largest test errors: name -> [test error, torch-autocast error]
    top: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    guard_lifted: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.error:
            return f"{self.test_backend} check failed to run: {self.error}"
        verdict = "passed" if self.ok else f"FAILED ({len(self.failures)} parameters over limit)"
        return (f"{self.test_backend} vs {self.ref_backend} gradient check {verdict}: max rel err "
                f"{self.max_rel_err:.3g} ({self.worst_param}; torch-autocast {self.worst_param_noise:.3g}), "
                f"loss {self.loss_test:.4f} vs {self.loss_ref:.4f}, tol {self.tol}, {self.seconds:.1f}s")


def _grads(model: torch.nn.Module, ids: torch.Tensor, kinds: torch.Tensor, backend: str,
           amp: torch.dtype | None, loss_fn: Callable) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(ids.device.type, dtype=amp) if amp is not None else torch.autocast(
        ids.device.type, enabled=False)
    with ctx:
        logits = model(ids, backend=backend)
    loss = loss_fn(logits, ids, kinds)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.norm())
    diff = float((a - ref).norm())
    if not (diff == diff):  # NaN
        return float("inf")
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def check_backend_grads(model: torch.nn.Module, ids: torch.Tensor, kinds: torch.Tensor, loss_fn: Callable,
                        amp: torch.dtype | None, test_backend: str = "fla", ref_backend: str = "torch",
                        tol: float = DEFAULT_TOL, noise_factor: float = NOISE_FACTOR, top_k: int = 8) -> GradCheck:
    """Compare the gradients of `loss_fn(model(ids, backend), ids, kinds)` on `test_backend`
    (under autocast `amp`) with the float32 `ref_backend` ones, parameter by parameter (see
    the module docstring). Leaves the model's parameters and grads untouched (grads cleared)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.train()
    loss_ref, ref = _grads(model, ids, kinds, ref_backend, None, loss_fn)
    if amp is not None:
        loss_noise, noisy = _grads(model, ids, kinds, ref_backend, amp, loss_fn)
    else:
        loss_noise, noisy = loss_ref, ref
    loss_test, test = _grads(model, ids, kinds, test_backend, amp, loss_fn)
    model.train(was_training)
    noise = {n: _rel(noisy[n], g) for n, g in ref.items()}
    errs = {n: (_rel(test[n], g) if n in test else float("inf")) for n, g in ref.items()}
    limits = {n: max(tol, noise_factor * noise[n]) for n in ref}
    failures = {n: [errs[n], limits[n]] for n in ref if not errs[n] <= limits[n]}
    loss_ok = abs(loss_test - loss_ref) <= tol * max(1.0, abs(loss_ref))
    if not loss_ok:
        failures["<loss>"] = [abs(loss_test - loss_ref), tol * max(1.0, abs(loss_ref))]
    worst = max(errs, key=lambda n: errs[n]) if errs else ""
    top = dict(sorted(((n, [round(errs[n], 5), round(noise[n], 5)]) for n in errs),
                      key=lambda kv: -kv[1][0])[:top_k])
    return GradCheck(
        ok=not failures, test_backend=test_backend, ref_backend=ref_backend, batch_shape=tuple(ids.shape),
        autocast=None if amp is None else str(amp).replace("torch.", ""), tol=tol, noise_factor=noise_factor,
        loss_ref=round(loss_ref, 6), loss_noise=round(loss_noise, 6), loss_test=round(loss_test, 6),
        max_rel_err=errs.get(worst, 0.0), worst_param=worst, worst_param_noise=noise.get(worst, 0.0),
        max_noise_rel_err=max(noise.values(), default=0.0),
        failures={n: [round(a, 5), round(b, 5)] for n, (a, b) in failures.items()}, top=top,
        seconds=round(time.perf_counter() - t0, 2))


def failed_check(test_backend: str, ref_backend: str, ids: torch.Tensor, tol: float, error: str,
                 seconds: float) -> GradCheck:
    """The record of a check whose test path raised."""
    return GradCheck(ok=False, test_backend=test_backend, ref_backend=ref_backend, batch_shape=tuple(ids.shape),
                     autocast=None, tol=tol, noise_factor=NOISE_FACTOR, loss_ref=float("nan"),
                     loss_noise=float("nan"), loss_test=float("nan"), max_rel_err=float("inf"), worst_param="",
                     worst_param_noise=float("nan"), max_noise_rel_err=float("nan"), seconds=round(seconds, 2),
                     error=error)
