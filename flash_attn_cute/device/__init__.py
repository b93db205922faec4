"""Device code every kernel family shares (CuTe DSL; imported only when a kernel compiles):
the forward and MLA argument lists and work tiles (``fwd_kernel``, ``mla_kernel``), the
register epilogue, barrier ids, sequence lengths, block ranges and splits, tile
schedulers, GQA packing, paged-KV addressing, row copies, the online softmax, attention
variants, layout views, fake tensors and launch helpers. Length, block-range, split,
packing, page and store arithmetic is written here once, for every arch."""
