"""A step's input tensors, staged in preallocated buffers and moved to the device in one copy.

    host arena (pinned on CUDA) ──one non_blocking copy──▶ device arena (fixed capacity)

Every input is a fixed view of both arenas, so a tensor the forward pass reads (and a CUDA graph
captures) keeps its address from step to step; a step of B sequences and T tokens uses the
first rows of each view:

    section           dtype   capacity (rows)                    a step uses
    input_ids         int64   max_tokens                         [:T]
    positions         int64   max_tokens                         [:T]
    slot_mapping      int64   max_tokens                         [:T]
    logits_indices    int64   max_num_seqs                       [:rows that sample]
    temperature       float32 max_num_seqs                       [:rows that sample], when
    top_k             int64   max_num_seqs                        any of them samples at
    top_p, min_p      float32 max_num_seqs                        random (sampler.SamplingTensors)
    seed, draws       int64   max_num_seqs                       the same rows, device draws only
    query_start_loc   int32   max_num_seqs + 1                   [:B + 1]
    seq_lens          int32   max_num_seqs                       [:B]
    block_table       int32   max_num_seqs x max_blocks_per_seq  [:B], every column

The block table has a column for every block of a max_model_len sequence, so its shape and
strides depend on the batch size alone. It comes last, so one copy of the arena up to the
step's last block-table row moves everything. On the CPU the two arenas are one tensor:
nothing is copied.

Padding (a decode-only step run at a CUDA graph's batch size N > B, see cuda_graphs): rows
B..N-1 are one-token sequences that write nothing and read one key:

    row              input_id  position  slot  query_start_loc  seq_len  block_table row
    real i < B       ...       ...       ...   i                ...      its blocks
    padding B <= j   0         0         -1    j                1        0 0 ... 0

A negative slot is skipped by every backend's K/V write, so no real sequence's cache is
touched; seq_len 1 makes the padding row attend to key 0 of block 0 only, a finite value
whoever owns that block, so the padding rows' outputs (which nobody reads) are finite too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cbgen.attention import AttentionMetadata

ALIGN = 64
"""Byte alignment of each section in the arenas."""

PAD_SLOT = -1
"""slot_mapping of a padding row: a negative slot writes no K/V."""


@dataclass(frozen=True)
class _Section:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class StepBuffers:
    """The staging arenas of one runner (see the module docstring). host holds numpy views to
    fill, device the matching tensors the forward pass reads."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        layout = (
            ("input_ids", torch.int64, (max_num_tokens,)),
            ("positions", torch.int64, (max_num_tokens,)),
            ("slot_mapping", torch.int64, (max_num_tokens,)),
            ("logits_indices", torch.int64, (max_num_seqs,)),
            ("temperature", torch.float32, (max_num_seqs,)),
            ("top_k", torch.int64, (max_num_seqs,)),
            ("top_p", torch.float32, (max_num_seqs,)),
            ("min_p", torch.float32, (max_num_seqs,)),
            ("seed", torch.int64, (max_num_seqs,)),
            ("draws", torch.int64, (max_num_seqs,)),
            ("query_start_loc", torch.int32, (max_num_seqs + 1,)),
            ("seq_lens", torch.int32, (max_num_seqs,)),
            ("block_table", torch.int32, (max_num_seqs, max_blocks_per_seq)),
        )
        sections: dict[str, _Section] = {}
        offset = 0
        for name, dtype, shape in layout:
            section = _Section(name, dtype, shape, offset)
            sections[name] = section
            offset += -(-section.nbytes // ALIGN) * ALIGN
        self.sections = sections
        self.nbytes = offset
        on_cuda = self.device.type == "cuda"
        self.host_arena = torch.zeros(offset, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_arena = (
            self.host_arena
            if self.device.type == "cpu"
            else torch.zeros(offset, dtype=torch.uint8, device=self.device)
        )
        host_bytes = self.host_arena.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for s in sections.values():
            end = s.offset + s.nbytes
            self.host[s.name] = host_bytes[s.offset : end].view(_NUMPY[s.dtype]).reshape(s.shape)
            self.dev[s.name] = self.device_arena[s.offset : end].view(s.dtype).view(s.shape)
        self._views: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last copy: the host arena is not rewritten before it is done."""

    def begin(self) -> None:
        """Call before filling the host views: waits (on CUDA) until the previous step's copy
        has read them. Steps that read a sampled token have waited already; a step that samples
        nothing (only prefill chunks) has not."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def upload(self, num_seqs: int) -> None:
        """Move the filled host views to the device: one copy of the arena up to block-table
        row num_seqs (on the CPU, nothing to do)."""
        if self.device_arena is self.host_arena:
            return
        table = self.sections["block_table"]
        end = table.offset + num_seqs * self.max_blocks_per_seq * 4
        self.device_arena[:end].copy_(self.host_arena[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def views(
        self,
        num_tokens: int,
        num_seqs: int,
        num_sampling: int,
        max_query_len: int,
        max_seq_len: int,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A step's (input_ids, positions, metadata, logits_indices): the first rows of the
        device views."""
        input_ids, positions, slot_mapping = self._rows("tokens", num_tokens)
        query_start_loc, seq_lens, block_table = self._rows("seqs", num_seqs)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )
        return input_ids, positions, meta, self._rows("sampling", num_sampling)[0]

    def sampling_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of temperature, top_k, top_p and min_p on the device."""
        return self._rows("params", n)

    def draw_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of seed and draws on the device (sampler.SamplingTensors' last
        fields, for device draws)."""
        return self._rows("draws", n)

    def _rows(self, kind: str, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of the device views of one kind, made once per n (slicing a tensor
        costs about a microsecond, and a run meets few distinct sizes)."""
        views = self._views.get((kind, n))
        if views is None:
            dev = self.dev
            if kind == "tokens":
                views = (dev["input_ids"][:n], dev["positions"][:n], dev["slot_mapping"][:n])
            elif kind == "params":  # sampler.SamplingTensors' fields, in order
                views = tuple(dev[name][:n] for name in ("temperature", "top_k", "top_p", "min_p"))
            elif kind == "draws":
                views = (dev["seed"][:n], dev["draws"][:n])
            elif kind == "seqs":
                views = (
                    dev["query_start_loc"][: n + 1],
                    dev["seq_lens"][:n],
                    dev["block_table"][:n],
                )
            else:
                views = (dev["logits_indices"][:n],)
            self._views[(kind, n)] = views
        return views

    def data_ptrs(self) -> dict[str, int]:
        """Each device view's address: constant for the life of the buffers."""
        return {name: t.data_ptr() for name, t in self.dev.items()}


def fill_padding(host: dict[str, np.ndarray], num_real: int, num_rows: int) -> None:
    """Rows num_real..num_rows-1 of a decode-only step (one token per row, so token t is row
    t) as padding rows (see the module docstring)."""
    if num_rows <= num_real:
        return
    pad = slice(num_real, num_rows)
    host["input_ids"][pad] = 0
    host["positions"][pad] = 0
    host["slot_mapping"][pad] = PAD_SLOT
    host["seq_lens"][pad] = 1
    host["block_table"][pad] = 0
    qsl = host["query_start_loc"]
    qsl[num_real + 1 : num_rows + 1] = np.arange(num_real + 1, num_rows + 1)
