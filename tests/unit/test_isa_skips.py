"""The tests a host without AVX-512 skips are reported in one line that names the ISA found."""
from __future__ import annotations

import textwrap

from megatron_mlp.testing.isa_skips import is_no_avx512_skip, isa_found

pytest_plugins = ["pytester"]


def test_only_avx512_skips_are_folded_when_reasons_differ():
    assert is_no_avx512_skip("this CPU cannot run the avx512 kernel path")
    assert is_no_avx512_skip("this CPU has no AVX-512 VPCLMULQDQ")
    assert not is_no_avx512_skip("megatron-core is not installed")
    assert not is_no_avx512_skip("this CPU cannot run the avx2 kernel path")


def test_isa_found_names_the_kernel_path_and_avx512_when_asked():
    text = isa_found()
    assert "AVX-512: yes" in text or "AVX-512: no" in text


def test_many_avx512_skips_fold_into_one_summary_line_naming_the_isa(pytester):
    import os
    conftest = os.path.join(os.path.dirname(os.path.dirname(__file__)), "conftest.py")
    pytester.makeconftest(open(conftest).read())
    pytester.makepyfile(test_x=textwrap.dedent("""
        import pytest
        @pytest.mark.parametrize("i", range(5))
        def test_a(i):
            pytest.skip("this CPU cannot run the avx512 kernel path")
        @pytest.mark.parametrize("i", range(3))
        def test_b(i):
            pytest.skip("this CPU has no AVX-512 VPCLMULQDQ")
        def test_c():
            pytest.skip("megatron-core is not installed")
    """))
    result = pytester.runpytest("-ra", "-p", "no:cacheprovider")
    lines = [ln for ln in result.outlines if ln.startswith("SKIPPED")]
    avx = [ln for ln in lines if "no AVX-512" in ln]
    assert len(avx) == 1 and avx[0].startswith("SKIPPED [8]") and "kernel ISA found: " in avx[0]
    assert any("megatron-core is not installed" in ln for ln in lines), "other skips keep their own line"
    assert any(ln.startswith("megatron_mlp kernel ISA: ") for ln in result.outlines)
