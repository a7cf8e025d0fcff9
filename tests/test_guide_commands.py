"""Every `posbench` command in the ```bash blocks of README.md and docs/guide.md, run here in the
cheapest faithful way, through the console script's own function in this process:

- `posbench train ...` with `--dry-run` appended: Hydra composes and validates every job's config
  (a sweep's too), and each prints its estimate; nothing trains. A dry run drops
  `hydra/launcher=...` and `hydra.launcher.*` (it runs the jobs' composition in this process), so
  the joblib and slurm lines check everything but the launcher;
- `posbench reproduce NAME` with `--dry-run` appended; `--help`, `--cfg job`, `--list`, `list`
  and commands that already say `--dry-run` as they are;
- commands that need a finished run (`eval`, `report`, `inspect`, `extend`,
  `reproduce NAME --report DIR`) on one toy run trained once (conftest's TOY), `RUN_DIR` its run
  dir and `SWEEP_DIR` the folder that holds it, with the overrides in TOY_EXTRA appended where
  the toy run needs them.

Every other line of those blocks (pip, wandb sync, torchrun) is named in OTHER with why it does
not run here; a posbench command that could not run would be named in CANNOT_RUN with why (none
today). Also here: the README's length, its relative links and the guide's, and the guide's
Python API block. About 60 s on one core: the toy run, then about 1 s a command (the swept
extension 6 s)."""
import re
import shutil
from pathlib import Path

import pytest

from helpers import run_in_process
from posbench.runs import estimate

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/guide.md"]

# the lines of the pages' bash blocks that are not posbench commands, and why they do not run here
OTHER = {
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "installs PyTorch from the network (.ci/run installs the pinned CPU build)",
    "pip install -e .": "installs the package (done where this test runs)",
    'pip install -e ".[test]"': "installs the test extra (done where this test runs)",
    "pytest": "the test suite this test is part of (.ci/run runs the README's line word for word)",
    'pip install -e ".[cluster]"': "installs the launcher plugins from the network",
    'pip install -e ".[wandb]"': "installs wandb from the network",
    "wandb sync outputs/multirun/<date>/<time>/*/wandb/offline-run-*":
        "uploads to wandb's servers (the offline runs it syncs are read in tests/test_cli.py)",
    "torchrun --nproc_per_node=8 --no-python posbench train model=gpt2-small hydra.run.dir=runs/r1":
        "8 processes of gpt2-small; DDP itself is tested with 2 CPU processes (tests/test_ddp.py)",
}
# posbench commands of the pages that cannot run here, and why: none today
CANNOT_RUN: dict[str, str] = {}
# appended to a command that runs on the toy run (trained at 32 tokens, 1 layer of 32)
TOY_EXTRA = {
    "extend": ["train.steps=4"],  # 4 fine-tuning steps instead of 200
    # the passkey format takes 58 tokens: more than the toy's windows of 32 and 64
    "eval.retrieval.enabled=true": ["eval.retrieval.lengths=[64,128]"],
    # Self-Extend's grid: 9 re-scores, at the toy's 2L and 4L rather than 4L..64L
    "eval.rope_window=8,16,24": ["eval.lengths=[64,128]"],
}
# files that a command of the pages reads and another one writes: the writer runs first, where the
# file is not there yet (parametrized commands may run in any order, on any worker)
WRITTEN_BY = {"RUN_DIR/longrope-512-seed0.json": "posbench longrope RUN_DIR --length 512"}
# the paths the pages stand for a run's dir and a sweep's
PLACEHOLDERS = {"RUN_DIR": "sweep/run", "SWEEP_DIR": "sweep",
                "outputs/reproduce/alibi_table2_cpu": "sweep"}


def bash_lines(page: str) -> list[str]:
    """The command lines of a page's ```bash blocks: continuations joined, comments dropped,
    `a && b` split."""
    text = (ROOT / page).read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines += [part.strip() for part in line.split("&&")]
    return [" ".join(line.split()) for line in lines]


def posbench_commands() -> list[str]:
    """The pages' posbench commands, the first of those that run here as the same argv
    (`reproduce X` is run as `reproduce X --dry-run`, which the pages also show)."""
    runs = {}
    for command in (c for page in PAGES for c in bash_lines(page)):
        if command.startswith("posbench ") or command == "posbench":
            runs.setdefault(tuple(as_run_here(command)[0]), command)
    return list(runs.values())


def as_run_here(command: str) -> tuple[list[str], str]:
    """The argv after `posbench` this test runs for `command`, and how it runs."""
    argv = command.split()[1:]
    verb = argv[0] if argv else ""
    as_is = {"--help", "-h", "--cfg", "--list", "--dry-run", "--version"} & set(argv)
    if verb == "list" or as_is:
        return argv, "as is"
    if verb == "train" or (verb == "reproduce" and "--report" not in argv):
        return argv + ["--dry-run"], "dry run"
    extra = [x for key, more in TOY_EXTRA.items() if key == verb or key in argv for x in more]
    return argv + extra, "on the toy run"


@pytest.fixture(scope="module")
def toy_sweep(tmp_path_factory, toy_run):
    """One finished toy RoPE run, `sweep/run` (conftest's toy_run, copied)."""
    home = tmp_path_factory.mktemp("toy")
    shutil.copytree(toy_run[0], home / "sweep" / "run")
    return home


def test_the_pages_name_every_line_they_do_not_run():
    """A new command in a bash block either starts with posbench (and runs below) or is named in
    OTHER with why it does not run; a named one that left the pages goes from OTHER too."""
    lines = [line for page in PAGES for line in bash_lines(page)]
    others = {line for line in lines if not line.startswith("posbench")}
    assert others == set(OTHER)
    assert set(CANNOT_RUN) <= set(posbench_commands())
    for command in posbench_commands():  # a path the test cannot stand in for
        assert "<" not in command, f"{command}: write RUN_DIR or SWEEP_DIR for a run's path"


@pytest.mark.parametrize("command", posbench_commands())
def test_the_command_runs(command, toy_sweep, tmp_path, monkeypatch, capsys):
    if command in CANNOT_RUN:
        pytest.skip(CANNOT_RUN[command])
    def here(argv):
        for placeholder, path in PLACEHOLDERS.items():
            argv = [arg.replace(placeholder, str(toy_sweep / path)) for arg in argv]
        return argv

    argv, how = as_run_here(command)
    argv = here(argv)
    (tmp_path / "conf").symlink_to(ROOT / "conf")  # as run from the repo's root
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # a dry run here composes and checks every job and prints its estimate; its wall time, which
    # would train a step of each model shape (the ladder's widest takes seconds), is tested in
    # test_estimate.py
    monkeypatch.setattr(estimate, "step_seconds", lambda *args, **kwargs: 0.1)
    for written, writer in WRITTEN_BY.items():
        assert writer in posbench_commands()
        if written in command and not Path(here([written])[0]).exists():
            assert run_in_process(here(writer.split()[1:]), monkeypatch, capsys).returncode == 0
    proc = run_in_process(argv, monkeypatch, capsys)
    assert proc.returncode == 0, f"{command} ({how}): {proc.stderr[-3000:]}"
    if how == "dry run":
        assert "--dry-run" in proc.stdout
        assert [p.name for p in tmp_path.iterdir()] == ["conf"]  # nothing written


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_finds_its_file_and_heading(page):
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / page).parent / path if path else ROOT / page
        if not target.exists() or (anchor and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, f"{page}: {broken}"


def test_the_python_api_block_runs(toy_sweep):
    """The guide's Python API block, `idx` a batch of zeros and RUN_DIR the toy run."""
    text = (ROOT / "docs/guide.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
               if b.startswith("import posbench\n")]
    code = code.replace('"RUN_DIR"', repr(str(toy_sweep / "sweep" / "run")))
    scope = {}
    exec("import torch\nidx = torch.zeros(2, 8, dtype=torch.long)\n" + code, scope)
    assert scope["logits"].shape[:2] == (2, 8)
    assert scope["run"].results["status"] == "ok"
