"""benchmarks/isa_cap.py: the environment each cap gives both sides' child processes, and
the CPU flags it reports (against /proc/cpuinfo read here)."""
import scripts

isa_cap = scripts.load("benchmarks/isa_cap.py")


def test_avx2_caps_every_library_and_native_removes_inherited_caps():
    inherited = {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    native = isa_cap.cap_env("native", inherited)
    assert native == {"PATH": "/bin"}
    avx2 = isa_cap.cap_env("avx2", {"PATH": "/bin", "MKL_ENABLE_INSTRUCTIONS": "AVX512"})
    assert avx2["PATH"] == "/bin"
    assert avx2["ONEDNN_MAX_CPU_ISA"] == "AVX2" and avx2["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert avx2["ATEN_CPU_CAPABILITY"] == "avx2" and avx2["OPENBLAS_CORETYPE"] == "Haswell"
    disabled = avx2["NPY_DISABLE_CPU_FEATURES"].split()
    assert {"X86_V4", "AVX512_ICL", "AVX512F", "AVX512_SKX"} <= set(disabled)


def test_cpu_flags_are_the_simd_flags_of_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    got = isa_cap.cpu()
    assert ("avx2" in got["simd_flags"]) == ("avx2" in flags)
    assert got["avx512"] == ("avx512f" in flags)
    assert set(got["simd_flags"]) <= set(flags) and "sse2" not in got["simd_flags"]
