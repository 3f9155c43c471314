from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)
