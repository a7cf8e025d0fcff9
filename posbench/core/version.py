"""The package version: pyproject.toml reads it from here, checkpoints record it."""
__version__ = "0.1.0"
