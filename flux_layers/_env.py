"""Every environment variable flux_layers reads, in one place.

All names share the ``FLUX_LAYERS_`` prefix. Values are read when asked for (not at import), so tests and
launchers can set them per process.

| variable | meaning | default |
|---|---|---|
| FLUX_LAYERS_BACKEND | ``auto`` / ``fused`` / ``reference``: which implementation the ops use | auto |
| FLUX_LAYERS_OPS_LIB | path of the compiled op library to load instead of the packaged one | (packaged) |
| FLUX_LAYERS_DIRECT_CALLS | ``1``: the fused ops are called from Python directly, without torch's op dispatch, where the arguments are plain tensors, no torch-function or dispatch mode is active and no input requires grad under grad mode (csrc/bindings/fastcall.cpp); ``0``: always through the registered op. Read when the library loads | 1 |
| FLUX_LAYERS_AG_MODE | copy-engine all-gather direction: ``push`` or ``pull`` | push |
| FLUX_LAYERS_AG_ORDER | all-gather order: ``auto`` (from topology), ``mesh``, ``ring`` (one node), ``internode`` (several nodes, NVLink inside each) or ``numa2d`` (PCIe nodes with two NUMA domains); flux_layers/runtime/topology.py | auto |
| FLUX_LAYERS_NODE_SIZE | ranks per node, declaring node boundaries (global rank // N is the node); emulates several nodes on one machine. ``0``: torchrun's LOCAL_WORLD_SIZE where the job spans nodes, else one node | 0 |
| FLUX_LAYERS_TRANSPORT | how chunks move between two ranks: ``copy_engine`` (peer-mapped memory, cudaMemcpy), ``nccl`` (send/recv through the group's NCCL communicator), ``hybrid`` (NCCL between nodes, peer-mapped memory inside them: the all-gather's host-driven copy-engine pushes, the reduce-scatter's two-level plan, the epilogue's stores inside the node and the node partials by NCCL; not yet run on GPUs; a group inside one node as under ``auto``) or ``auto`` (copy engine where the pair can map each other's memory, else NCCL; always NCCL across nodes). GEMM+ReduceScatter takes its NCCL transport only with ``nccl`` (not yet run on GPUs); under ``auto`` a group without peer access takes its reference path | auto |
| FLUX_LAYERS_NCCL_SMS | SMs the fused all-gather's GEMM leaves to NCCL's kernels on the ``nccl`` transport (flux_layers/runtime/multinode/nccl_transport.py) | 20 |
| FLUX_LAYERS_NUMA_MAP | comma-separated NUMA node of each local rank's GPU (e.g. ``0,0,0,0,1,1,1,1``), overriding detection (NVML, else sysfs); with ``FLUX_LAYERS_AG_ORDER=numa2d`` it forces the NUMA-2D order. Empty: detect | (empty) |
| FLUX_LAYERS_CHUNK_ROWS | rows per copy-engine chunk (0: per-shape heuristic) | 0 |
| FLUX_LAYERS_RS_TRANSPORT | GEMM+ReduceScatter's move of peer tiles: ``epilogue``, ``copy_engine``, ``auto`` (1) | auto |
| FLUX_LAYERS_RS_CHUNK_COLS | columns per copy-engine chunk of the reduce-scatter (0: 1024) | 0 |
| FLUX_LAYERS_TIMEOUT_S | bound on every cross-rank wait, seconds | 30 |
| FLUX_LAYERS_WORKSPACE_MAX_GIB | largest symmetric buffer one workspace may take, GiB (0: no cap) | 16 |
| FLUX_LAYERS_TUNING | path of a tuning table (JSON) to use instead of flux_layers/tuning_tables | (packaged) |
| FLUX_LAYERS_DISPATCH | ``table`` (per-shape fused/sequential choice), ``always`` (fused wherever supported) | table |
| FLUX_LAYERS_STREAM_K | ``auto``: the stream-K tail (2) where the tuning table's entry for the shape does not measure whole tiles faster; ``1``: the tail everywhere; ``0``: whole tiles only | auto |
| FLUX_LAYERS_STREAM_K_MAX_FILL | most % of the persistent grid a split last wave may fill (0: never) (2) | 75 |
| FLUX_LAYERS_CUDA_GRAPHS | ``1``: every fused-op workspace gets a CUDA-graph twin, so calls can be captured (3) | 0 |
| FLUX_LAYERS_FP8_CAST | CUDA casts to FP8 (flux_layers/ops/fp8.py): ``auto`` (one kernel per cast, csrc/kernels/fp8_cast_onepass.cu and fp8_cast_rowwise.cu), ``two_pass`` (an amax kernel, then a cast kernel: the benchmarks' baseline). Same bits either way | auto |
| FLUX_LAYERS_POISON_OUTPUTS | ``1``: fused ops fill their outputs with NaN before launching (tests) (4) | 0 |
| FLUX_LAYERS_TEST_SHARED_GPU | ``1``: the GPU tests' ranks share one GPU (flux_layers/devtools/launch.py); the NCCL transports' send/recv then run on a host-staged stand-in (flux_layers/runtime/multinode/sendrecv.py) | 0 |
| FLUX_LAYERS_TEST_TP | ranks of the GPU tests' groups, 2 to 8 (0: every visible GPU, at least 2 and at most 8; 2 where the ranks share one GPU) | 0 |
| FLUX_LAYERS_TEST_LAUNCH_S | most seconds a test's ranks may run (flux_layers/devtools/launch.py: the lower of this and the test's own limit; each rank prints its threads' stacks shortly before it is killed); 0: the test's own | 0 |
| FLUX_LAYERS_TEST_STAND_IN_TRACE | ``1``: the host-staged stand-in (flux_layers/runtime/multinode/sendrecv.py) writes a line to stderr at each step of each exchange (enqueued, taken, staged, moved, stored), with the rank, the exchange's number, its peers and bytes: which rank's exchanges went out of step | 0 |
| FLUX_LAYERS_TEST_PY_SPY | path of a ``py-spy`` executable: a test launch that hits its limit runs ``py-spy dump --native`` on each rank still running before it kills it (flux_layers/devtools/launch.py), which shows every thread's native frames and which thread holds the GIL. Empty: not run | (empty) |
| FLUX_LAYERS_TEST_NODES | emulated nodes of the NCCL-transport GPU tests (tests/gpu/test_nccl_transport_gpu.py: FLUX_LAYERS_TEST_TP / N ranks per node); 0: their default layouts | 0 |

(1) ``epilogue``: the GEMM epilogue stores into the peer; ``copy_engine``: staged locally, moved by the copy engine
per chunk; ``auto``: the tuning table's choice for the shape, else epilogue.
(2) The persistent GEMMs split the items of a last, partial wave along K, while that wave keeps at most
FLUX_LAYERS_STREAM_K_MAX_FILL percent (0-100) of the persistent grid busy.
(3) flux_layers/runtime/workspace.py.
(4) Proves that every output element is written.
"""
from __future__ import annotations

import os

_PREFIX = "FLUX_LAYERS_"

_DEFAULTS = {
    "BACKEND": "auto",
    "OPS_LIB": "",
    "DIRECT_CALLS": "1",
    "AG_MODE": "push",
    "AG_ORDER": "auto",
    "NODE_SIZE": "0",
    "TRANSPORT": "auto",
    "NUMA_MAP": "",
    "NCCL_SMS": "20",
    "CHUNK_ROWS": "0",
    "RS_TRANSPORT": "auto",
    "RS_CHUNK_COLS": "0",
    "TIMEOUT_S": "30",
    "WORKSPACE_MAX_GIB": "16",
    "TUNING": "",
    "DISPATCH": "table",
    "POISON_OUTPUTS": "0",
    "TEST_SHARED_GPU": "0",
    "TEST_TP": "0",
    "TEST_NODES": "0",
    "TEST_LAUNCH_S": "0",
    "TEST_STAND_IN_TRACE": "0",
    "TEST_PY_SPY": "",
    "CUDA_GRAPHS": "0",
    "STREAM_K": "auto",
    "STREAM_K_MAX_FILL": "75",
    "FP8_CAST": "auto",
}

_CHOICES = {
    "BACKEND": ("auto", "fused", "reference"),
    "DIRECT_CALLS": ("0", "1"),
    "AG_MODE": ("pull", "push"),
    "AG_ORDER": ("auto", "mesh", "ring", "internode", "numa2d"),
    "TRANSPORT": ("auto", "copy_engine", "nccl", "hybrid"),
    "DISPATCH": ("table", "always"),
    "POISON_OUTPUTS": ("0", "1"),
    "TEST_SHARED_GPU": ("0", "1"),
    "CUDA_GRAPHS": ("0", "1"),
    "STREAM_K": ("auto", "0", "1"),
    "FP8_CAST": ("auto", "two_pass"),
}


def get(name: str) -> str:
    """Value of ``FLUX_LAYERS_<name>``, validated against its allowed choices."""
    if name not in _DEFAULTS:
        raise KeyError(f"unknown flux_layers setting {name!r}; known: {sorted(_DEFAULTS)}")
    value = os.environ.get(_PREFIX + name, _DEFAULTS[name]).strip()
    choices = _CHOICES.get(name)
    if choices is not None and value not in choices:
        raise ValueError(f"{_PREFIX}{name}={value!r} is not one of {choices}")
    return value


def get_int(name: str) -> int:
    raw = get(name)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{_PREFIX}{name}={raw!r} is not an integer") from None


def get_float(name: str) -> float:
    raw = get(name)
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{_PREFIX}{name}={raw!r} is not a number") from None
