"""cbgen on a Ray cluster (`pip install 'cbgen[ray]'`):

    driver      `cbgen run --ray`: this process reads and writes, engine actors generate
    actor       the engine actor the driver feeds and drains (EngineActor)
    cluster     which cluster (local, auto, an address), how many engines and their resources
    processor   build_processor: a Ray Data processor of cbgen's engines, for one's own pipelines
    worker      an engine kept full from a queue by a thread: what every actor runs

Only the driver and the processor import Ray, and only when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Processor", "build_processor"]


def __getattr__(name: str) -> Any:
    # the processor pulls in the engine (torch); `import cbgen.ray` stays light
    if name in __all__:
        from cbgen.ray import processor

        return getattr(processor, name)
    raise AttributeError(name)
