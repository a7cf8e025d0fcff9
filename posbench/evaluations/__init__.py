"""Evaluations: the perplexity protocols and the sections under eval.<name>, one file each (the
contract is in posbench/evaluations/base.py). Every module in this package is imported here, so
a new file registers its evaluation by being there; nothing else changes."""
import importlib
import pkgutil

from posbench.evaluations.base import (EvalConfig, Evaluation, Section, SectionConfig,
                                       eval_schema, plan, register, registry, run, sections)
from posbench.evaluations.perplexity import Protocol, protocol_of

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "perplexity") and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def check(run_cfg) -> None:
    """Each evaluation's check of its typed config: the protocol that eval.protocol names, and
    every section, enabled or not (its keys are in the config either way)."""
    protocol = protocol_of(run_cfg.eval)
    protocol.check(protocol.config(run_cfg), run_cfg)
    for section in sections():
        section.check(section.config(run_cfg), run_cfg)


__all__ = ["EvalConfig", "Evaluation", "Protocol", "Section", "SectionConfig", "check",
           "eval_schema", "plan", "protocol_of", "register", "registry", "run", "sections"]
