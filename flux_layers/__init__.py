"""flux_layers: Megatron-style tensor-parallel linear layers whose sequence-parallel all-gather and
reduce-scatter are fused into the GEMM at tile granularity.

``flux_layers.ops`` holds the functional operators (fused CUDA kernels and a torch.distributed reference
backend); ``flux_layers.layers`` the autograd functions, modules and megatron-core specs.
"""
from flux_layers import _library
from flux_layers._library import FusedOpsUnavailable

__version__ = "0.1.0"


def fused_ops_available() -> bool:
    """Whether the compiled op library is loaded and a supported GPU is visible."""
    return _library.unavailable_reason() is None


__all__ = ["FusedOpsUnavailable", "fused_ops_available", "__version__"]
