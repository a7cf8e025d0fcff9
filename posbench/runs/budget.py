"""train.budget: what every run of a comparison spends alike (docs/design.md, "Training budgets").

- tokens (the default): train.steps steps of train.batch_size windows of train.seq_len tokens.
  An encoding that costs more per token than another then gets more compute.
- flops: the training FLOPs that the reference encoding (train.budget_reference, default rope)
  spends in train.steps steps at this model, batch and length. Each run trains
  round(budget / its FLOPs per step) steps, its warmup stretched in proportion. FLOPs per step:
  the estimate's count of the weights and the attention core (posbench/runs/estimate.py), the
  same for every attention path, plus three times the encoding's own forward FLOPs
  (PositionalEncoding.flops; a backward pass costs about twice a forward).
- wallclock: train.budget_seconds of training, evaluation left out; the learning rate follows
  the fraction of those seconds spent, and a resume continues from the checkpoint's seconds.
  Such runs are not bit-reproducible: how many steps fit depends on the machine and its load,
  so they are refused across devices: under several processes (each rank's clock would end
  training at its own step), and on resuming on another device than the checkpoint's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from posbench.config import to_container
from posbench.core.errors import ConfigError
from posbench.runs import distributed


def with_encoding(cfg, name: str):
    """cfg with the registered encoding `name` (its defaults) in place of its own."""
    from posbench.encodings import registry

    out = OmegaConf.create(to_container(cfg))
    out.encoding = dataclasses.asdict(registry()[name].config)
    return out


def budget_flops(cfg) -> float:
    """train.budget=flops: what the reference encoding spends in train.steps steps."""
    from posbench.runs.estimate import step_flops

    return cfg.train.steps * step_flops(with_encoding(cfg, cfg.train.budget_reference))


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule's keys (posbench/runs/train.py: lr_at) over a run's steps."""
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    steps: int


@dataclass(frozen=True)
class Budget:
    """How long a run trains: to `steps`, or (wallclock) until `seconds` are spent."""
    kind: str
    steps: Optional[int]  # None under wallclock
    schedule: object  # train's own keys under tokens (bit for bit today's), else a Schedule
    seconds: Optional[float] = None  # wallclock
    flops: Optional[float] = None  # flops: the budget, and each step's share of it
    flops_per_step: Optional[float] = None

    def spent(self, done: int, seconds: float) -> bool:
        return done >= self.steps if self.seconds is None else seconds >= self.seconds

    def spent_on(self, device) -> Optional[str]:
        """The machine whose seconds a wallclock budget counts (the checkpoint keeps it); None
        under the other budgets, which spend alike on any device."""
        return device_name(device) if self.seconds is not None else None

    def record(self, done: int, seconds: float, device) -> dict:
        """What results.json records of the budget (train.budget)."""
        if self.kind == "flops":
            return {"budget": "flops", "budget_flops": self.flops,
                    "flops_per_step": self.flops_per_step, "steps_run": done,
                    "flops_spent": done * self.flops_per_step}
        if self.kind == "wallclock":
            return {"budget": "wallclock", "budget_seconds": self.seconds,
                    "seconds_spent": seconds, "steps_reached": done, "device": device_name(device)}
        return {"budget": "tokens"}


def device_name(device) -> str:
    """The machine a wallclock budget was spent on: the GPU's name, or the CPU's threads."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def require_same_device(budget: Budget, started_on: Optional[str], device) -> None:
    """Refuses to resume a wallclock run on another device than its checkpoint's (None: not
    recorded, as in checkpoints of other budgets)."""
    if budget.seconds is None or started_on is None or started_on == device_name(device):
        return
    raise ConfigError(f"device={device_name(device)!r} is not accepted to resume this "
                      f"train.budget=wallclock run; expected the device it started on, "
                      f"{started_on!r} (the same seconds buy other steps on another device; "
                      "OMP_NUM_THREADS sets a CPU's threads), or a new run dir")


def plan(cfg) -> Budget:
    """The run's budget from its config."""
    t = cfg.train
    kind = t.get("budget", "tokens")  # absent from runs saved before it existed
    if kind == "tokens":
        return Budget(kind, t.steps, t)
    if kind == "wallclock":
        if distributed.world_size() > 1:
            raise ConfigError(f"train.budget=wallclock is not accepted under "
                              f"{distributed.world_size()} processes; expected one device: "
                              "seconds spent on several are not comparable with one's, and each "
                              "rank's clock would end training at its own step")
        return Budget(kind, None, t, seconds=float(t.budget_seconds))
    from posbench.runs.estimate import step_flops

    budget, per_step = budget_flops(cfg), step_flops(cfg)
    if budget < per_step:
        raise ConfigError(f"train.steps={t.steps} is not accepted with train.budget=flops; "
                          f"expected a budget of at least one step of {cfg.encoding.name}, "
                          f"{per_step:.4g} FLOPs ({t.budget_reference} spends {budget:.4g} in "
                          f"{t.steps} steps)")
    steps = round(budget / per_step)
    warmup = round(t.warmup_steps * steps / t.steps)
    return Budget(kind, steps, Schedule(t.lr, t.min_lr_ratio, warmup, steps), flops=budget,
                  flops_per_step=per_step)

