"""The GPU check's sections as tests under the `cuda` marker: on a machine with a CUDA GPU,
`pytest -m cuda tests/tools/test_gpu_sections.py` runs each section's checks (greedy against
transformers, bf16 top-1, sampling, memory, CUDA graphs, throughput and the 8B roofline) as a
test that fails with the section's figures. `python -m tools.gpu_check` stays the one command
that runs them under a time budget and records the figures (docs/GPU.md); its kernel_tests
section is the cuda-marked tests of tests/kernels, so it is not repeated here. Without CUDA
every test here is skipped, and tests/engine/test_gpu_path.py runs the check's CPU smoke test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.gpu_check import SECTIONS
from tools.gpu_context import CheckContext

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckContext]:
    """One context for the module: the random-weight checkpoints are built once."""
    folder: Path = tmp_path_factory.mktemp("gpu-check")
    yield CheckContext(torch.device("cuda"), quick=False, folder=folder)


@pytest.mark.parametrize(
    ("name", "section"),
    [(name, section) for name, section, _ in SECTIONS if name != "kernel_tests"],
)
def test_gpu_check_section(context: CheckContext, name: str, section: Any) -> None:
    context.start_section(600.0)
    try:
        passed = bool(section(context))
        assert passed, f"{name}: {context.figures}"
    finally:
        context.free()
