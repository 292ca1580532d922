"""scripts/sass_loops.py: innermost loops and their counts from nvdisasm text."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "sass_loops", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sass_loops.py"))
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

SASS = """
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0, gsb0 ;
.L_x_2:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0, gsb0 ;
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0040*/                   MUFU.EX2 R1, R1 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   MUFU.EX2 R2, R2 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0080*/                   STL [R1+0x4], R3 ;
        /*0090*/               @P0 BRA `(.L_x_2) ;
        /*00a0*/                   LDL R3, [R1+0x4] ;
        /*00b0*/               @P1 BRA `(.L_x_1) ;
"""


def test_innermost_loop_counts():
    loops = sass_loops.innermost_loops(SASS)
    assert loops == [dict(BAR=1, STL=1, LDL=0, EX2=2, HGMMA=1, EX2async=1)]
