"""Build flux_layers: the Python package, and (where a CUDA toolchain exists) the op library flux_layers/_C.

The op library registers torch ops with TORCH_LIBRARY and is the module flux_layers._C of the fused ops' direct
calls; it uses only the stable Python ABI (py_limited_api), so a build made under one Python version loads under
another (3.10 on) with the same torch.

FLUX_LAYERS_BUILD_OPS: ``auto`` (default: build if torch, nvcc and nvidia-cutlass are present, else install the
pure-Python package with only the reference backend), ``1`` (build or fail), ``0`` (never build).
Build with ``pip install --no-build-isolation .`` so the installed torch is the one compiled against.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
MODE = os.environ.get("FLUX_LAYERS_BUILD_OPS", "auto")


def _note(msg):
    print(f"[flux_layers] {msg}", flush=True)


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    base = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
    inc = os.path.join(base, "include")
    return inc if os.path.isdir(os.path.join(inc, "cutlass")) else None


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + ["/usr/local/cuda/bin/nvcc"]:
        if os.path.exists(cand):
            return cand
    return shutil.which("nvcc")


def _ops_build():
    """(ext_modules, cmdclass) for the op library, or ([], {}) with a note saying why not."""
    if MODE == "0":
        _note("FLUX_LAYERS_BUILD_OPS=0: not building the op library; only the reference backend is available.")
        return [], {}
    missing = []
    try:
        import torch  # noqa: F401
    except ImportError:
        missing.append("torch (install it first and build with --no-build-isolation)")
    nvcc = _nvcc()
    if nvcc is None:
        missing.append("the CUDA toolkit (nvcc)")
    cutlass_inc = _cutlass_include()
    if cutlass_inc is None:
        missing.append("CUTLASS headers (pip install nvidia-cutlass==4.2.0.0)")
    if missing:
        msg = "cannot build the op library, missing: " + "; ".join(missing)
        if MODE == "1":
            raise RuntimeError(msg)
        _note(msg + ". Installing the pure-Python package: only the reference backend (torch.distributed + "
              "matmul) is available, and fused ops raise FusedOpsUnavailable.")
        return [], {}

    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")  # sm_90a: wgmma, setmaxnreg, TMA multicast
    os.environ.setdefault("MAX_JOBS", str(max(1, os.cpu_count() or 1)))
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    csrc = os.path.join(ROOT, "csrc")
    sources = sorted(glob.glob(os.path.join(csrc, "bindings", "*.cpp")) +
                     glob.glob(os.path.join(csrc, "runtime", "*.cpp")) +
                     glob.glob(os.path.join(csrc, "kernels", "*.cu")))
    sources = [os.path.relpath(s, ROOT) for s in sources]
    undef_torch_half = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    ext = CUDAExtension(
        name="flux_layers._C",
        sources=sources,
        include_dirs=[os.path.join(csrc, "include"), os.path.join(csrc, "kernels"), cutlass_inc],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", "-DNDEBUG"],
            # -DNDEBUG: without it ptxas serialises wgmma (C7510) and the kernels lose speed.
            # CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL: CUTLASS calls cuTensorMapEncodeTiled directly, which
            # csrc/runtime/driver_api.cpp defines (one entry-point lookup per process, not one per descriptor).
            "nvcc": ["-O3", "-std=c++17", "-DNDEBUG", "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL",
                     "--expt-relaxed-constexpr", "--expt-extended-lambda",
                     "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=--warn-on-spills"] + undef_torch_half,
        },
        py_limited_api=True,
        # csrc/bindings/fastcall.cpp: THPVariable_Wrap and torch's tensor classes (stable Python ABI only otherwise).
        libraries=["torch_python"],
    )
    _note(f"building the op library with {nvcc} and CUTLASS headers from {cutlass_inc}")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ops_build()

setup(
    name="flux_layers",
    version="0.1.0",
    description="Megatron-style TP/SP linear layers with all-gather and reduce-scatter fused into the GEMM",
    packages=find_packages(include=["flux_layers", "flux_layers.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy", "pyyaml"],
    # megatron-core: the releases flux_layers.layers supports (flux_layers/layers/_megatron_compat.py); 0.16.1 is
    # the newest for Python 3.11, 0.19.x the newest for 3.12 (CI tests both).
    extras_require={
        "megatron": ["megatron-core>=0.16.1,<0.20"],
        "test": ["pytest", "pytest-timeout", "megatron-core>=0.16.1,<0.20", "matplotlib"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
    # The tuning tables are package data (flux_layers/runtime/tuning.py finds them through the package).
    package_data={"flux_layers": ["tuning_tables/*.json"]},
    include_package_data=False,
)
