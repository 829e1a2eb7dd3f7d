"""Memory for the packed matmul weights: anonymous maps advised for transparent huge pages."""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
"""Transparent huge page size (x86-64, and arm64 with 4 KiB base pages)."""


class HugePageArena:
    """Buffers in anonymous memory maps advised for transparent huge pages
    (`MADV_HUGEPAGE`, which the kernel honours when THP is `always` or `madvise`), handed
    out back to back from chunks of at least `chunk_bytes` (huge-page aligned, so each page
    the buffers fill is one 2 MiB page).

    For the packed matmul weights, which every decode step streams from memory once: with
    4 KiB pages the stream meets a new TLB entry every 4 KiB, and the hardware prefetchers
    stop at each page boundary. On SmolLM2 a decode step of 8 sequences measured ~10 %
    faster with the weights in 2 MiB pages, 16 sequences ~4 %, 64 (bound by arithmetic) ~1 %
    (docs/PERFORMANCE.md, "Decode-sized matmuls"). Buffers keep their chunk
    alive; nothing is ever returned to a chunk."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, the current chunk's unused tail
        self.huge = hasattr(mmap, "MADV_HUGEPAGE")

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised 1-D tensor of numel elements of dtype (64-byte aligned)."""
        nbytes = numel * dtype.itemsize
        if not self.huge or numel == 0:
            return torch.empty(numel, dtype=dtype)
        size = -(-nbytes // 64) * 64  # keep the next buffer on a cache line
        if self._chunk is None or self._chunk.numel() < size:
            self._chunk = self._new_chunk(size)
            if self._chunk is None:
                return torch.empty(numel, dtype=dtype)
        out, self._chunk = self._chunk[:nbytes], self._chunk[size:]
        return out.view(dtype)

    def _new_chunk(self, nbytes: int) -> torch.Tensor | None:
        nbytes = -(-max(nbytes, self.chunk_bytes) // HUGE_PAGE) * HUGE_PAGE
        try:
            # one spare huge page, to start on a 2 MiB boundary wherever the map lands
            buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_HUGEPAGE)  # before anything touches the pages
        except (OSError, ValueError):
            self.huge = False
            return None
        whole = torch.frombuffer(buf, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        return whole[start : start + nbytes]


WEIGHTS = HugePageArena()
"""The arena every packed weight form takes its memory from (float32 and bf16 panels, GGUF
blocks)."""
