"""The machinery under the public entry points (``flash_attn_cute.interface``, ``.mla``):
the call kit (each public argument described once, one generic run path), the append
step of ``flash_attn_with_kvcache`` and the ``torch.compile`` custom op."""
