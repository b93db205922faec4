"""Arch-neutral kernel families (SM80 and up; CuTe DSL): the split-KV combine (``combine``)
and the KV-cache append with rotary embedding (``kv_append``)."""
