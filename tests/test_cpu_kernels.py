"""The kind of CPU that golden values are kept for (tests/cpu_kernels.py)."""
from tests.cpu_kernels import kind_of

# flags as /proc/cpuinfo lists them on three machines the suite has run on (abridged)
AVX2_ONLY = {"fpu", "sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"}
AVX512 = AVX2_ONLY | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16"}
AMX = AVX512 | {"amx_bf16", "amx_tile", "amx_int8"}


def test_kinds_part_by_the_widest_vector_instructions():
    assert kind_of("x86_64", AVX2_ONLY) == "x86-avx2"
    assert kind_of("x86_64", AVX512) == "x86-avx512"
    assert kind_of("x86_64", AMX) == "x86-avx512-amx"
    assert kind_of("x86_64", {"sse4_2"}) == "x86"


def test_other_machines_are_their_own_kind():
    assert kind_of("aarch64", {"asimd", "sve"}) == "aarch64"
    assert kind_of("AMD64", AVX512) == "x86-avx512"
