from tests.experts.auto_clock import clock  # noqa: F401  (the guard's test clock)
from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)
