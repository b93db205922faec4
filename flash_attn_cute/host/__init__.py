"""Shared host code: plain Python and torch, no DSL. Argument validation (``checks``), the
per-call cache (``call_cache``), tuning overrides read once per call (``tuning``), problem
descriptions (``problems``), compile-key layouts (``keys``), planning heuristics
(``heuristics``), numbers host and device share (``constants``), user-variant specs
(``user_variants``), the JIT / disk cache (``jit_cache``) and FP8 quantization (``fp8``)."""
