import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """S, N and U over one tiny engine (fronts.start_stack), shared by the suite's files."""
    from fronts import build_tiny, start_stack

    s = start_stack(build_tiny(Path(tmp_path_factory.mktemp("rel")) / "tiny"))
    yield s
    s.stop()
