"""`posbench reproduce`: a registry of published results, each one file in this package (the
contract is in posbench/reproduce/base.py), run as a posbench sweep and judged claim by claim
(posbench/reproduce/judge.py). Every module here but the machinery is an entry and is imported
here, so a new file registers its entry by being there; nothing else changes."""
import importlib
import pkgutil

from posbench.reproduce.base import Reproduction, Rescore, Sweep, register, registry
from posbench.reproduce.claims import (NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, VERDICTS,
                                       Measured)

MACHINERY = ("base", "claims", "judge", "command", "rescores")

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in MACHINERY and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Measured", "NOT_COMPARABLE", "NOT_REPRODUCED", "REPRODUCED", "Reproduction", "Rescore",
           "Sweep", "VERDICTS", "register", "registry"]
