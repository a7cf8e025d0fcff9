"""The encodings tables of README.md and docs/encodings.md, built from the registry so that the
pages cannot drift from the code (tests/test_docs.py compares; scripts/gen_encodings_doc.py
rewrites both)."""
from __future__ import annotations

from posbench.encodings.base import Dims, registry

HOOK_PLACES = (("positions", "position ids"), ("embed", "input embedding"),
               ("rotate", "q/k maps"), ("score_mod", "attention logits"),
               ("row_mod", "logit rows (context)"), ("mix_heads", "logits across heads"),
               ("value_mod", "attention values"))
# a small model, only to list which parameters an encoding learns
PROBE = Dims(n_layer=2, n_head=4, d_model=64, train_len=64, max_len=128)


def where_applied(module) -> str:
    # a layer pattern acts through the encodings of its layers
    layers = [module.at_layer(i)[0] for i in range(PROBE.n_layer)] + [module]
    return ", ".join(place for hook, place in HOOK_PLACES
                     if any(getattr(m, hook) is not None for m in layers)) or "—"


def learned_parameters(module) -> str:
    names = sorted({name.split(".")[0] for name, _ in module.named_parameters()})
    return ", ".join(f"`{n}`" for n in names) or "—"


def encodings_table() -> str:
    rows = ["| name | family | where applied | learned | relative | past the training length | reference |",
            "|---|---|---|---|---|---|---|"]
    for name, entry in registry().items():
        cls, module = entry.cls, entry.cls(entry.config, PROBE)
        rows.append(f"| `{name}` | {cls.family} | {where_applied(module)} | {learned_parameters(module)} "
                    f"| {'yes' if cls.relative else 'no'} | {cls.past_train_len} | {cls.reference} |")
    return "\n".join(rows) + "\n"


def readme_table() -> str:
    rows = ["| encoding | family | what it does |", "|---|---|---|"]
    rows += [f"| `{name}` | {entry.cls.family} | {entry.description} |"
             for name, entry in registry().items()]
    return "\n".join(rows) + "\n"
