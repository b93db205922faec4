"""Hardware named-barrier ids (``bar.sync`` / ``bar.arrive``), one enum per kernel family.

A CTA has 16 named barriers; id 0 is ``__syncthreads`` and is left alone. A member whose
comment says "+ i" is the first of a run of ids (one per stage, buffer or warpgroup).
Kernels pass ``int(member) [+ i]`` as ``barrier_id``.
"""

import enum


class Sm90FwdBarrier(enum.IntEnum):
    """``sm90/flash_fwd.py``."""

    CONSUMERS = 1  # all consumer threads: Q gathered by cp.async, V tail zeroed, epilogue
    SCHEDULER = 2  # + consumer warpgroup (up to 3): its turn to issue MMAs (ping-pong)
    TILE_FULL = 5  # dynamic persistent tiles: producer warp 0 wrote the next tile's index
    TILE_EMPTY = 6  # the consumers read it
    TILE_FULL_PRODUCER = 7  # the same for the other producer warps that walk the tiles
    TILE_EMPTY_PRODUCER = 8


class Sm90MlaBarrier(enum.IntEnum):
    """``sm90/mla_decode.py``, over the consumer threads."""

    CONSUMERS = 1  # Q landed
    XCHG = 2  # qk="split": both halves of S written
    STATS = 3  # the final 1 / row sum (qk="one") or both warpgroups' row sums (qk="seesaw") written


class Sm90MlaTmaBarrier(enum.IntEnum):
    """``sm90/mla_decode_tma.py``, over both warpgroups (its module docstring draws the
    seesaw: who arrives, who syncs, once per pair of tiles)."""

    Q = 1  # Q landed and the row max initialised
    SCALE0 = 2  # warpgroup 0 wrote the max and correction of its tile (S_a)
    SCALE1 = 3  # warpgroup 1 wrote those of S_b (1 where there is no tile b)
    P0 = 4  # warpgroup 0 wrote P_a (at the pair's max) to sP0
    O1_ISSUED = 5  # warpgroup 1 wrote sP1 and issued its P V of sP0
    SUMS = 6  # both warpgroups' row sums written
    VT0 = 7  # fp8: warpgroup 0 wrote its half of V^T (its 128 threads; VT0 + 1: warpgroup 1's)
    VT1 = 8
    O_STAGED = 9  # O written to shared memory for the bulk row stores


class Sm80MlaBarrier(enum.IntEnum):
    """``sm80/mla_decode.py`` (its module docstring says who arrives and who syncs; a KV
    stage's FULL is an mbarrier)."""

    P_FULL = 1  # + P buffer (2): P and its row corrections written by the S warps
    P_EMPTY = 3  # + P buffer (2): the O warps read P
    O_DONE = 5  # O warps only: every O warp finished P V on the stage
    FINAL = 6  # the S warps wrote 1 / row sum


class Sm100FwdBarrier(enum.IntEnum):
    """``sm100/flash_fwd.py`` (its role handshakes are mbarriers)."""

    TMEM_ALLOC = 1  # the TMEM users meet once the MMA warp allocated TMEM (and before it frees it)
    Q_QUANT = 2  # + stage (2): quantize_q, the stage's softmax warpgroup (its amax, then its stores)
