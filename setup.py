"""Builds the C++ core `megatron_mlp._C` with pybind11.

Plain `pip install .` / `pip install -e .`: no CMake, no JIT at import, no libtorch, no libaio.
SIMD paths are selected at run time (function-level target attributes), so the build
never uses -march=native and the wheel runs on any x86-64 (or other) CPU.
"""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup

ParallelCompile("MLP_BUILD_JOBS", default=0).install()

sources = sorted(glob.glob("csrc/src/**/*.cpp", recursive=True))
extra_compile_args = ["-O3", "-Wall", "-Wextra", "-fno-strict-aliasing"]
if os.environ.get("MLP_DEBUG_BUILD"):
    extra_compile_args = ["-O0", "-g", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Pybind11Extension(
            "megatron_mlp._C",
            sources,
            include_dirs=["csrc/include"],
            cxx_std=17,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"],
        )
    ],
)
