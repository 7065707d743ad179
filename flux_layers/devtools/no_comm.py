"""megatron-core's tensor-parallel all-gathers and reduce-scatters replaced by local copies: a ceiling.

A baseline stack run inside :func:`megatron_collectives_as_local_copies` does all of its computation (cuBLAS
GEMMs, attention, norms) but moves nothing between GPUs. Its step time bounds what any implementation of the
linears whose GEMMs run at cuBLAS speed can reach by hiding communication. The results are wrong (each rank
sees only its own shard) and the copies cost a little (an all-gather writes the local shard into every slot of
its output, so the tensors hold ordinary values; a reduce-scatter copies the local slice), so the ceiling is, if
anything, slightly low.
"""
from __future__ import annotations

import contextlib

import torch


class _Done:
    """The handle an ``async_op=True`` collective returns; the copy is already queued on the stream."""

    def wait(self):
        return None

    def is_completed(self):
        return True


def _group_size_rank(group):
    import torch.distributed as dist
    return dist.get_world_size(group), dist.get_rank(group)


def local_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """all_gather_into_tensor's signature: every slot of `output` (dim 0) receives this rank's `input`."""
    tp, _ = _group_size_rank(group)
    slots = output.view(tp, *input.shape)
    for s in range(tp):
        slots[s].copy_(input)
    return _Done() if async_op else None


def local_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, **_):
    """reduce_scatter_tensor's signature: `output` receives this rank's slice of `input`, unreduced."""
    tp, rank = _group_size_rank(group)
    output.copy_(input.view(tp, *output.shape)[rank])
    return _Done() if async_op else None


# Module attributes through which megatron-core (0.16.1 to 0.19.x) calls the collectives of its tensor-parallel
# linears and sequence-parallel mappings.
_PATCH_POINTS = (("megatron.core.tensor_parallel.layers", "dist_all_gather_func", local_all_gather),
                 ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func", local_reduce_scatter),
                 ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func", local_all_gather),
                 ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func", local_reduce_scatter),
                 ("megatron.core.utils", "dist_all_gather_func", local_all_gather))


@contextlib.contextmanager
def megatron_collectives_as_local_copies():
    """Inside: megatron-core's tensor-parallel all-gathers and reduce-scatters are local copies."""
    import importlib
    saved = []
    try:
        for module_name, attr, replacement in _PATCH_POINTS:
            module = importlib.import_module(module_name)
            if not hasattr(module, attr):
                raise RuntimeError(f"{module_name}.{attr} not found: this megatron-core calls its collectives "
                                   f"differently, the ceiling would still communicate")
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacement)
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
