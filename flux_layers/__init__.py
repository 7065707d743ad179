"""flux_layers: Megatron-style tensor-parallel linear layers whose sequence-parallel all-gather and
reduce-scatter are fused into the GEMM at tile granularity.

``flux_layers.ops`` holds the functional operators (fused CUDA kernels and a torch.distributed reference
backend); ``flux_layers.layers`` the autograd functions, modules and megatron-core specs.
"""
from flux_layers import _library
from flux_layers._library import FusedOpsUnavailable
from flux_layers.config import OverlapConfig

__version__ = "0.1.0"

# The layers import megatron-core (seconds); load them on first use so that the ops alone stay light.
_LAYERS = ("ColumnParallelLinear", "RowParallelLinear", "LayerNormColumnParallelLinear")


def fused_ops_available() -> bool:
    """Whether the compiled op library is loaded and a supported GPU is visible."""
    return _library.unavailable_reason() is None


def __getattr__(name: str):
    if name in _LAYERS:
        from flux_layers import layers
        return getattr(layers, name)
    raise AttributeError(f"module 'flux_layers' has no attribute {name!r}")


__all__ = ["FusedOpsUnavailable", "fused_ops_available", "OverlapConfig", *_LAYERS, "__version__"]
