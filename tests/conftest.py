import os

# Two processes fighting over 2 cores run 3-8x slower; tests are single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)


import logging

import pytest

GPU_SKIP_REASON = "gpu test (pytest.mark.gpu): needs CUDA, torch.cuda.is_available() is False"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one rule for GPU tests: an item marked `gpu` (a module's `pytestmark =
    pytest.mark.gpu`, or one test's `@pytest.mark.gpu`) is skipped without CUDA, with the
    reason. GPU tests sit next to their package's CPU tests (tests/structure/test_test_tree.py
    keeps it so); `pytest -m gpu` selects them, on the H200 as on a CPU (where they skip)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        # a GPU test that names a fixture its directory does not see is left to run here,
        # so its setup error shows in CI and not first on the device (session 19:
        # tests/bench had no `tiny_hf`)
        if item.get_closest_marker("gpu") is not None and not _missing_fixtures(item):
            item.add_marker(skip)


def _missing_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures a test function asks for that no conftest or plugin visible to it
    defines (parametrize arguments resolve as pseudo-fixtures and are not missing)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    fm = item.session._fixturemanager
    direct = set(getattr(getattr(item, "callspec", None), "params", {}))
    return [n for n in info.names_closure
            if n != "request" and n not in direct and not fm.getfixturedefs(n, item)]


@pytest.fixture(autouse=True)
def _ft_logger_as_found():
    """`ft` CLI entry points called in-process run `setup_logging`, which gives the `ft` logger
    its own handler and stops propagation; restore it after each test so later tests' caplog
    (attached to the root logger) still sees `ft.*` lines. Bug it avoids: log assertions that
    pass alone and fail after a CLI test in the same session."""
    lg = logging.getLogger("ft")
    saved = (lg.propagate, list(lg.handlers), lg.level)
    yield
    lg.propagate, lg.handlers[:], lg.level = saved[0], saved[1], saved[2]
