"""The one compiled part of tandem: engine/hardware/csrc/, tandem's CPU kernels (the integer-dot products over GGUF
blocks of engine/hardware/int_dot.py, the paged decode attention of engine/attention/cpu_decode.py), built as the
extension tandem.engine.hardware._cpu_kernels (engine/hardware/cpu_kernels.py loads it). Everything else is in
pyproject.toml.

The build needs torch's headers: the Makefile installs tandem with --no-build-isolation after torch. Where torch is
missing from the build (an isolated build) or the compiler fails, the extension is left out with a warning and
tandem runs on torch's kernels instead (engine/hardware/cpu_features.py says which); TANDEM_NO_CPU_KERNELS=1 leaves
it out on purpose (a pure-Python wheel for other targets: deploy/wheelhouse.py)."""

import os
import warnings

from setuptools import setup


def cpu_kernels():
    """(ext_modules, cmdclass) of the kernels' build, or nothing to build."""
    if os.environ.get("TANDEM_NO_CPU_KERNELS"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        warnings.warn("torch is not importable in this build: tandem's CPU kernels are left out (install with "
                      "pip's --no-build-isolation after torch to build them)", stacklevel=1)
        return [], {}
    # No -march: each instruction set's functions carry their own target attribute, so one build runs on any
    # x86-64 CPU and picks its path at run time. -fopenmp: at::parallel_for (an inline OpenMP loop) splits the
    # work over torch's intra-op threads; the libgomp.so.1 it needs is the one torch itself loads.
    sources = [f"engine/hardware/csrc/{name}.cpp" for name in ("module", "int_dot", "decode_attention")]
    extension = CppExtension("tandem.engine.hardware._cpu_kernels", sources, extra_compile_args=["-O3", "-fopenmp"],
                             extra_link_args=["-fopenmp"], optional=True)
    return [extension], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = cpu_kernels()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
