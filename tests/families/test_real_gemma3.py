"""The real-model tier on Gemma 3 270M Q4_K_M (``$VXC_GEMMA3_GGUF``): the checks of
``tests/families/real_models.py``."""

from __future__ import annotations

import pytest

# the checks, collected here in this order (the int8 check reads the paragraph check's references), and the fixtures
# they use
from tests.families.real_models import gemma3, gemma3_gguf  # noqa: F401
from tests.families.real_models import test_lowered_at_real_geometry_and_replayed  # noqa: F401
from tests.families.real_models import test_greedy_64_tokens  # noqa: F401
from tests.families.real_models import test_paragraph_at_the_floor_and_bf16  # noqa: F401
from tests.families.real_models import test_gguf_tokenizer_matches_transformers  # noqa: F401
from tests.families.real_models import test_int8_activations_on_the_real_file  # noqa: F401


@pytest.fixture(scope="module")
def real(gemma3):  # noqa: F811
    return gemma3
