"""Attention backends behind one interface (base.py): write new K/V by slot_mapping, then
attend every query token to its sequence's cached context, causal inside its own chunk.

    torch   the plain reference, torch ops only (torch_backend.py)
    cpu     the C kernels of cbgen.cpu, the reference where they cannot run (cpu_backend.py)
    triton  the kernels of cbgen_kernels, the default on CUDA (triton_backend.py)
    flash   vllm_flash_attn's paged varlen kernel (flash_backend.py)

select.py picks one.
"""

from cbgen.attention.base import AttentionBackend, AttentionMetadata
from cbgen.attention.select import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
