"""Loss-gated curriculum: keep the run on short prompts until the lookup has formed.

The retrieval tasks sit on an answer-loss plateau (the 4 value bytes at chance, ~2.87 nats
per answer token) for ~1000+ steps before the lookup circuit forms, and it forms sooner on
short prompts with few distractors (docs/training.md). A time-gated curriculum widens the
prompts on a clock whether or not that has happened; `CurriculumGate` instead holds the
data at size levels U(0, `hold_level`) (and the learning rate at its peak) until the
smoothed answer loss of the gate tasks (default `fact`) falls below `threshold`, or until
progress `deadline`, whichever comes first. From that point p0 on, the data curriculum and
the cosine learning-rate schedule run over the rest of the run:

    data progress  q = c * hold_level + (1 - c * hold_level) * (p - p0) / (1 - p0)
    lr progress      = (p - p0) / (1 - p0)

where c is DataConfig.curriculum_frac, so `data.size_level(q)` starts exactly where the
hold left off (U(0, hold_level)) and widens to full size as in the time-gated schedule.
`threshold <= 0` turns the gate off (data and lr progress are the run's progress).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .errors import TrainConfigError


@dataclass(frozen=True)
class GateConfig:
    """When the curriculum may leave the short prompts."""

    #: answer loss (nats per answer token, EMA) of the gate tasks below which the gate opens; 0: no gate
    threshold: float = 0.0
    tasks: tuple[str, ...] = ("fact",)
    #: progress at which the gate opens anyway
    deadline: float = 0.5
    #: size levels drawn while held: U(0, hold_level)
    hold_level: float = 0.15
    #: EMA factor per observation of the gate tasks' answer loss
    ema: float = 0.9

    def validate(self, curriculum_frac: float) -> None:
        if self.threshold < 0:
            raise TrainConfigError(f"curriculum gate threshold={self.threshold} must be >= 0")
        if self.threshold > 0 and curriculum_frac <= 0:
            raise TrainConfigError("a curriculum gate needs a curriculum: set curriculum_frac > 0")
        if not 0 < self.deadline <= 1:
            raise TrainConfigError(f"curriculum gate deadline={self.deadline} must be in (0, 1]")
        if not 0 <= self.hold_level <= 1:
            raise TrainConfigError(f"curriculum gate hold_level={self.hold_level} must be in [0, 1]")
        if not 0 <= self.ema < 1:
            raise TrainConfigError(f"curriculum gate ema={self.ema} must be in [0, 1)")
        if not self.tasks:
            raise TrainConfigError("curriculum gate needs at least one task")


@dataclass
class CurriculumGate:
    """Tracks the gate tasks' answer loss and maps run progress to data and lr progress."""

    cfg: GateConfig
    curriculum_frac: float
    ema_loss: float | None = None
    opened_at: float | None = None
    opened_step: int | None = None
    reason: str | None = None
    history: list = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.cfg.threshold > 0

    @property
    def is_open(self) -> bool:
        return not self.enabled or self.opened_at is not None

    def observe(self, step: int, progress: float, answer_loss_by_task: Mapping[str, float]) -> bool:
        """Feed one batch's per-task answer loss; returns True when this call opened the gate."""
        if self.is_open:
            return False
        seen = [answer_loss_by_task[t] for t in self.cfg.tasks if t in answer_loss_by_task]
        if seen:
            x = sum(seen) / len(seen)
            self.ema_loss = x if self.ema_loss is None else self.cfg.ema * self.ema_loss + (1 - self.cfg.ema) * x
        if self.ema_loss is not None and self.ema_loss < self.cfg.threshold:
            return self._open(step, progress, f"answer loss {self.ema_loss:.3f} < {self.cfg.threshold}")
        if progress >= self.cfg.deadline:
            return self._open(step, progress, f"deadline {self.cfg.deadline} reached (answer loss "
                                              f"{self.ema_loss if self.ema_loss is None else round(self.ema_loss, 3)})")
        return False

    def _open(self, step: int, progress: float, reason: str) -> bool:
        self.opened_at, self.opened_step, self.reason = progress, step, reason
        return True

    def _after(self, progress: float) -> float:
        p0 = self.opened_at or 0.0
        return 0.0 if p0 >= 1 else min(1.0, max(0.0, (progress - p0) / (1 - p0)))

    def data_progress(self, progress: float) -> float:
        if not self.enabled:
            return progress
        start = self.curriculum_frac * self.cfg.hold_level
        if self.opened_at is None:
            return start
        return start + (1 - start) * self._after(progress)

    def lr_progress(self, progress: float) -> float:
        if not self.enabled:
            return progress
        return 0.0 if self.opened_at is None else self._after(progress)

    def to_dict(self) -> dict:
        return {"threshold": self.cfg.threshold, "tasks": list(self.cfg.tasks), "deadline": self.cfg.deadline,
                "hold_level": self.cfg.hold_level, "opened_at_progress": self.opened_at,
                "opened_at_step": self.opened_step, "reason": self.reason,
                "ema_answer_loss": None if self.ema_loss is None else round(self.ema_loss, 4)}
