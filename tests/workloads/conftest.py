from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_server import FakeServer


@pytest.fixture()
def fake_server() -> Iterator[FakeServer]:
    s = FakeServer().start()
    yield s
    s.stop()
