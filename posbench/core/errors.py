"""What posbench tells its user in one line, with exit code 2 and nothing written, named by what
went wrong. The command line catches PosbenchError; every other exception is a bug or a failure
of a started run, recorded as such."""
from __future__ import annotations


class PosbenchError(Exception):
    """Input or state that posbench cannot use."""


class ConfigError(PosbenchError, ValueError):
    """A config value, command-line argument or run dir that is not accepted."""


class CheckpointError(PosbenchError):
    """A checkpoint that is corrupt, of another posbench version, or of another run."""


class DataUnavailable(PosbenchError):
    """A dataset that cannot be reached or loaded (the hub offline, a source that fails)."""


def require(ok: bool, key: str, value, accepted: str) -> None:
    """ConfigError `key=value is not accepted; expected <accepted>` unless ok."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is not accepted; expected {accepted}")


def require_positive(key: str, value) -> None:
    """require() of a positive integer (not a bool)."""
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value,
            "a positive integer")


def did_you_mean(value: str, options) -> str:
    """' (did you mean 'alibi'?)' for the closest option to a misspelt value, else ''."""
    import difflib

    names = [str(o) for o in options]
    if str(value) in names:  # nothing to suggest; checks call this for every accepted value too
        return ""
    close = difflib.get_close_matches(str(value), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_line(err: BaseException) -> str:
    """`Type: message` with the message's whitespace folded onto one line."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
