"""Helpers for the project's own tests, benchmarks and examples; not part of the library's API.

``tests/``, ``benchmarks/`` and ``examples/`` do not import each other's helpers: what more than one of them needs
lives here. The tests of benchmark and example code sit beside it (``benchmarks/tests``, ``examples/tests``).

- :mod:`~flux_layers.devtools.launch`: start N local processes with torch.distributed initialised (gloo or nccl),
  re-raise a rank's failure in the parent; a free TCP port for a rendezvous.
- :mod:`~flux_layers.devtools.no_comm`: megatron-core's tensor-parallel collectives replaced by local copies, the
  ceiling of the layer and end-to-end benchmarks.
- :mod:`~flux_layers.devtools.records`: what every result JSON records (commit, command, GPU, settings) and writing it.
- :mod:`~flux_layers.devtools.gpu_monitor`: SM clock and power sampled by nvidia-smi, per variant's time windows.
- :mod:`~flux_layers.devtools.plot`: the figure of an end-to-end comparison record (needs matplotlib).
- :mod:`~flux_layers.devtools.oracle`: when a fused op's low-precision output is right (within 1.5x cuBLAS's error
  against fp32 on the same inputs).
- :mod:`~flux_layers.devtools.bad_inputs`: a catalogue of bad inputs to the ops, the fused functions and the layers,
  each with the rule its error must state, and a valid call after each.
- :mod:`~flux_layers.devtools.stress`: many pipelined fused calls (both ops and layouts, M changing, eager and
  CUDA-graph replays, a late rank) checked in batches.
"""
