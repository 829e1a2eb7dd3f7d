"""Triton kernels on the CPU run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton loads, where there is no CUDA device)."""

from __future__ import annotations

import pytest
import torch


def triton_kernels_can_run(device: torch.device) -> None:
    """Fail (not skip) a kernel test that would run compiled kernels on the CPU."""
    import cbgen_kernels

    if device.type == "cpu" and not cbgen_kernels.interpreted():
        pytest.fail(
            "cbgen_kernels was imported without TRITON_INTERPRET=1 (triton was imported before "
            "this module set it), so its kernels cannot run on the CPU"
        )
