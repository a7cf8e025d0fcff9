import functools
import io
import os
import tempfile
from pathlib import Path

import pytest
import torch

# Toy models run fastest on one thread (and CLI subprocesses inherit it): thread start-up costs
# more than it saves at this size, and far more when the cores are shared.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# One token cache for the whole test session (the CLI subprocesses inherit it), never the user's.
os.environ.setdefault("POSBENCH_CACHE", tempfile.mkdtemp(prefix="posbench-test-cache-"))
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_API_KEY", None)

from helpers import TOY  # noqa: E402 (after the environment it reads)
from matplotlib.figure import Figure  # noqa: E402

REAL_SAVEFIG = Figure.savefig


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda (tests/test_cuda.py) run only where torch sees a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@functools.cache
def blank_png() -> bytes:
    """A 1 x 1 PNG, rendered once per process: reports embed the figures and refuse a non-PNG."""
    blank = io.BytesIO()
    REAL_SAVEFIG(Figure(figsize=(0.1, 0.1)), blank, dpi=10, format="png")
    return blank.getvalue()


@pytest.fixture(scope="module", autouse=True)
def figures_drawn_not_rendered(request):
    """The figures that runs in a test process write are drawn (layout, ticks, labels: where a
    plotting bug shows) but not rasterized, and written as a blank pixel: three PNGs rendered are
    about 1 s of a toy run's 1.5 s on one core. A module or test marked `figures` writes real
    ones, as every `posbench` subprocess does."""
    if request.node.get_closest_marker("figures"):
        yield
        return

    def drawn(fig, fname, **kwargs):
        fig.draw_without_rendering()
        Path(fname).write_bytes(blank_png())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", drawn)
        yield


@pytest.fixture(autouse=True)
def real_figures(request, monkeypatch):
    """A test marked `figures` renders and writes its PNGs (figures_drawn_not_rendered)."""
    if request.node.get_closest_marker("figures"):
        monkeypatch.setattr(Figure, "savefig", REAL_SAVEFIG)


@pytest.fixture(scope="session")
def toy():
    return list(TOY)


@pytest.fixture(scope="session")
def stdlib_data():
    import posbench
    from posbench.data import prepare

    return prepare(posbench.compose([]).dataset)


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    """One finished toy RoPE run (`posbench train` with TOY, nothing else), trained once per test
    process (in it: helpers.run_in_process), and its stdout. Tests that change a run take a copy:
    `toy_run_copy`."""
    from helpers import posbench_cli

    home = tmp_path_factory.mktemp("toy_run")
    out = posbench_cli("train", *TOY, "hydra.run.dir=run", cwd=home, in_process=True).stdout
    return home / "run", out


@pytest.fixture
def toy_run_copy(toy_run, tmp_path):
    """A copy of toy_run's run dir, `tmp_path/run`, for the test to change."""
    import shutil

    return Path(shutil.copytree(toy_run[0], tmp_path / "run"))


@pytest.fixture
def flex_traced(monkeypatch):
    """posbench's compiled FlexAttention (attention/paths.py, as CUDA runs it) traced by dynamo,
    whose guards decide the recompiles on every device, and by AOT autograd, but not lowered to
    C++ by inductor: no CPU run of posbench takes that path, and its code generation is most of
    a CPU test's time."""
    import posbench.attention.paths as paths

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    caches = (paths._compiled_flex, paths._compiled_block_mask)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
