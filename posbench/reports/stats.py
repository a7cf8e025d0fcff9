"""The report's statistics over a group's seeds: the mean with a 95% Student-t interval."""
from __future__ import annotations

import math
from typing import List

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060,
       2.056, 2.052, 2.048, 2.045, 2.042)
BAND = "95% interval of the mean over seeds (Student t)"


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else 1.96 + 2.4 / df  # within 0.002 beyond 30


def mean_band(xs: List[float]) -> dict:
    """{mean, sd, sem, ci95, n} of one value's seeds (sd and ci95 0 for one seed)."""
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    sem = sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "sem": sem, "ci95": t95(n - 1) * sem if n > 1 else 0.0,
            "n": n}
