"""Shared-memory mbarriers for kernels that also compile for sm_80.

The DSL's ``cute.arch`` mbarrier waits and ``cp.async`` arrivals check for sm_90, while
the PTX they stand for exists from sm_80 on (``mbarrier.test_wait``,
``cp.async.mbarrier.arrive``). These spell it out, taking the barrier's 32-bit shared
address (``data_ptr().toint()``), so one kernel source serves the A100 and the H200;
from sm_90 on the wait uses ``try_wait``, which lets the warp sleep instead of spinning.
"""

import cutlass
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.base_dsl import Arch, BaseDSL
from cutlass.cutlass_dsl import dsl_user_op


def _asm(text: str, constraints: str, args, *, loc=None, ip=None):
    llvm.inline_asm(None, [Int32(a).ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def init(addr: Int32, count: int, *, loc=None, ip=None):
    """One thread: the barrier expects ``count`` arrivals per phase (a CTA-wide barrier
    must follow before any thread uses it)."""
    _asm("mbarrier.init.shared.b64 [$0], $1;", "r,r", (addr, count), loc=loc, ip=ip)


@dsl_user_op
def cp_async_arrive(addr: Int32, *, loc=None, ip=None):
    """This thread's arrival, made once every ``cp.async`` it issued before has landed
    (``.noinc``: the arrival is one of the ``count`` given to ``init``)."""
    _asm("cp.async.mbarrier.arrive.noinc.shared.b64 [$0];", "r", (addr,), loc=loc, ip=ip)


@dsl_user_op
def arrive(addr: Int32, *, loc=None, ip=None):
    """This thread's arrival now (release: its earlier shared stores are visible to the
    threads that see the phase complete)."""
    _asm("{\n\t.reg .b64 state;\n\tmbarrier.arrive.shared.b64 state, [$0];\n\t}", "r", (addr,), loc=loc, ip=ip)


@dsl_user_op
def wait(addr: Int32, phase: Int32, *, loc=None, ip=None):
    """Blocks until the phase of parity ``phase`` completed (acquire)."""
    op = "try_wait" if BaseDSL._get_dsl().get_arch_enum() >= Arch.sm_90 else "test_wait"
    _asm("{\n\t.reg .pred done;\n\tWAIT:\n\t"
         f"mbarrier.{op}.parity.shared.b64 done, [$0], $1;\n\t"
         "@!done bra WAIT;\n\t}", "r,r", (addr, phase), loc=loc, ip=ip)


def nth(base: Int32, i):
    """The shared address of the i-th of consecutive mbarriers (8 bytes each) from ``base``."""
    return base + 8 * i


def phase_of(i: Int32, stages: cutlass.Constexpr[int]):
    """The parity of the phase that the i-th fill of a ring of ``stages`` barriers completes."""
    return (i // stages) & 1
