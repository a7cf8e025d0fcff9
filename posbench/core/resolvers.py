"""The OmegaConf resolvers of posbench/conf/config.yaml, registered on `import posbench`.

- `${posbench.job_dir:}` names a sweep's job dir after its swept values, one level deep and safe
  in any shell: `encoding-alibi_seed-1`. The name does not hold the job's number, so a sweep
  started again over more or fewer values (another seed, one more task) finds the jobs it has
  run already. All of the job's overrides are kept in its `.hydra/overrides.yaml`.
- `${posbench.user_conf:conf}` puts the user's own config folder, relative to where the command
  runs, on Hydra's search path when there is one.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

# hydra.<SWEPT>: the keys a command line sweeps; `posbench train -m` adds it (the keys a config
# sweeps are in hydra.sweeper.params)
SWEPT = "posbench_swept"
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
VALUE_CHARS = 24  # a longer value is shortened
PIECE_CHARS = 12  # what is kept of a shortened value
NAME_CHARS = 100  # a job dir's name at most


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def _safe(text: str, limit: int) -> str:
    return UNSAFE.sub("-", text).strip("-.")[:limit].rstrip("-.")


def short_value(value: str) -> str:
    """The value as it is when it is short and safe; else a readable piece of it (a path's last
    part) and a hash of the whole, so that different values keep different names."""
    if len(value) <= VALUE_CHARS and not UNSAFE.search(value) and not value.startswith("."):
        return value
    piece = _safe(value.strip("'\"[]/").rsplit("/", 1)[-1], PIECE_CHARS)
    return f"{piece}-{_digest(value)}" if piece else _digest(value)


def summary(pairs: Iterable[Tuple[str, str]], limit: int = NAME_CHARS) -> str:
    """`<key>-<value>_...` in safe characters, at most `limit` long (a longer one keeps its
    start and a hash of the whole); also the tag that names a re-score, whose files put more
    around it (posbench/runs/rescore.py passes a smaller limit)."""
    text = "_".join(f"{_safe(key, limit)}-{short_value(value)}" for key, value in pairs)
    if len(text) > limit:
        text = f"{text[:limit - 7].rstrip('-._')}-{_digest(text)}"
    return text


def override_key(override: str) -> str:
    """The config key a `key=value` override sets, without Hydra's + and ~ prefixes."""
    return override.partition("=")[0].lstrip("+~")


def job_dir_name(num: int, overrides: Sequence[str], keys: Iterable[str],
                 sweep_dir: Path | None = None) -> str:
    """`<key>-<value>_...` over the overrides (`key=value`) whose key is one of `keys`, in their
    order; the job number when there is none. A sweep dir that holds the job under the name
    earlier versions gave it (`<num>_<key>-<value>_...`, numbered by its place in that sweep)
    keeps that name, so those sweeps resume into their own job dirs."""
    keys = {key.lstrip("+~") for key in keys}
    pairs = [(override_key(override), override.partition("=")[2]) for override in overrides]
    text = summary((key, value) for key, value in pairs if key in keys)
    if not text:
        return str(num)
    if sweep_dir is not None and sweep_dir.is_dir():
        numbered = [p.name for p in sweep_dir.iterdir()
                    if p.is_dir() and re.fullmatch(rf"\d+_{re.escape(text)}", p.name)]
        if numbered:
            return min(numbered)
    return text


def _job_dir(*, _root_: DictConfig) -> str:
    """Resolved in each job, whose config holds its own overrides (every key, swept or not)."""
    hydra = _root_.hydra
    swept = {key.lstrip("+~") for key in [*hydra.get(SWEPT, []),
                                           *(hydra.sweeper.get("params") or {})]}
    # keys that do not change what is trained stay out, so a sweep started again with them
    # resumes into the same job dirs
    unchanged = {key.lstrip("+~") for key in hydra.job.config.override_dirname.exclude_keys}
    return job_dir_name(hydra.job.num, hydra.overrides.task, swept - unchanged,
                        Path(hydra.sweep.dir))


def _user_conf(folder: str) -> List[str]:
    """[file://<folder, absolute>] when it exists, else nothing: Hydra warns about a search path
    entry that does not exist, and most folders a command runs in have no conf/."""
    path = Path(folder).resolve()
    return [f"file://{path}"] if path.is_dir() else []


OmegaConf.register_new_resolver("posbench.job_dir", _job_dir)
OmegaConf.register_new_resolver("posbench.user_conf", _user_conf)
