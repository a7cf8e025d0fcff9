"""Positional encodings, one file per family. Every module in this package is imported here, so a
new file registers its encodings by being there; nothing else changes."""
import importlib
import pkgutil

from posbench.encodings.base import (Dims, EncodingConfig, PositionalEncoding, build_encoding,
                                     encoding_config, positions_for, register, registry)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base" and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def list_encodings():
    return list(registry())


__all__ = ["Dims", "EncodingConfig", "PositionalEncoding", "build_encoding", "encoding_config",
           "list_encodings", "positions_for", "register", "registry"]
