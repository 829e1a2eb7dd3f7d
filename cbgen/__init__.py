"""cbgen: offline batch generation with continuous batching over a paged KV cache."""

from cbgen.config import EngineConfig
from cbgen.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch; keep `import cbgen` (and the CLI's --help) light.
    if name == "LLM":
        from cbgen.llm import LLM

        return LLM
    raise AttributeError(name)
