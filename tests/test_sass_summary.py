"""``benchmarks/sass_summary.py``: loop bodies and a range's issue order from a SASS listing
(CPU only)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LISTING = """
        Function : kern
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   FMUL R2, R2, R3 ;
        /*0030*/                   FMUL R4, R4, R3 ;
        /*0040*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;
        /*0050*/                   MUFU.EX2 R5, R5 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   MUFU.EX2 R6, R6 ;
        /*0080*/               @P0 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
"""


def _module():
    spec = importlib.util.spec_from_file_location("sass_summary", os.path.join(ROOT, "benchmarks", "sass_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loops_and_order():
    ss = _module()
    (name, body), = ss.functions(LISTING)
    assert name == "kern"
    assert "loop 0x10..0x80: 8 instructions" in ss.summary(name, body, 5, loops=True)
    text = ss.order(body, 0x10, 0x80)
    assert "order 0x10..0x80: 8 instructions" in text
    assert "QGMMA, FMUL x2, QGMMA, MUFU, WARPGROUP, MUFU, BRA" in text
    assert "WARPGROUP.DEPBAR.LE: after 1 of the range's 2 MUFU.EX2" in text
