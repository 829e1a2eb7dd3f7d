"""Attention backends behind one interface: write new K/V by slot_mapping, then attend every
query token to its sequence's cached context, causal inside its own chunk."""

from cbgen.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
