"""What every section of the GPU check shares: the run's CheckContext (device, quick mode, the
checkpoints built once, the running section's budget and figures), the machine's constants, and
transformers as the reference (a checkpoint loaded, its greedy tokens).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cbgen.config import Device, Dtype, EngineConfig
from cbgen.engine.engine import Engine
from tools.gpu_fixtures import build_checkpoint
from tools.model_shapes import CHECKPOINTS, QUICK_CHECKPOINTS

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
HBM_BYTES_PER_S = 4.3e12
"""The H200's memory bandwidth, the roofline's denominator."""


@dataclass
class CheckContext:
    device: torch.device
    quick: bool
    """Toy shapes and sizes: the CPU smoke test of this script."""
    folder: Path
    """Where the checkpoints are built (a temporary folder the driver removes)."""
    log_prefix: Path | None = None
    """Where logs worth keeping go (PREFIX.pytest.log); None: into folder."""
    end: float = 0.0
    """time.monotonic() at which the running section's budget is spent."""
    figures: dict[str, Any] = field(default_factory=dict)
    """What the running section has measured so far."""
    _built: dict[tuple[str, torch.dtype], Path] = field(default_factory=dict)

    def start_section(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.figures = {}

    def left(self) -> float:
        """Seconds left in the running section's budget."""
        return self.end - time.monotonic()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shapes(self) -> dict[str, dict[str, Any]]:
        return QUICK_CHECKPOINTS if self.quick else CHECKPOINTS

    def checkpoint(self, name: str, dtype: torch.dtype = torch.float32) -> Path:
        """The random-weight checkpoint of that shape, built once per run."""
        key = (name, dtype)
        if key not in self._built:
            folder = self.folder / f"{name}-{str(dtype).removeprefix('torch.')}"
            self._built[key] = build_checkpoint(self.shapes()[name], folder, dtype)
        return self._built[key]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def engine(self, model: Path | str, dtype: Dtype, **options: Any) -> Engine:
        options.setdefault("kv_cache_memory", (64 << 20) if self.quick else GiB)
        device: Device = "cuda" if self.cuda else "cpu"
        return Engine(EngineConfig(model=str(model), device=device, dtype=dtype, **options))


def vocab_size(ctx: CheckContext, name: str) -> int:
    return int(ctx.shapes()[name]["vocab_size"])


# ---- transformers, the reference ------------------------------------------------------------


def hf_greedy(
    model: Any, prompt: list[int], n: int, device: torch.device, **options: Any
) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([prompt], device=device)
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0, **options
    )
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return [int(t) for t in out[0, x.shape[1] :]]


def hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
