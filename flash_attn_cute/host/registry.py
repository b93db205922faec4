"""The backend registries, one per problem kind: name -> module path (imported on first use
by ``seam.backend_module``). Plain data below the seam, so that validation can name the
backends without importing the seam."""

# One line per backend of each kind.
BACKENDS = {
    "sm80": "flash_attn_cute.sm80",
    "sm90": "flash_attn_cute.sm90",
    "sm100": "flash_attn_cute.sm100",
}
MLA_BACKENDS = {
    "sm80": "flash_attn_cute.sm80.mla",
    "sm90": "flash_attn_cute.sm90.mla",
}
REGISTRIES = {"fwd": BACKENDS, "mla": MLA_BACKENDS}
