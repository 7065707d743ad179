"""GPT pretraining with flux_layers' linears (or megatron-core's, for comparison), run by
``examples/pretrain_gpt.py``.

| module | what |
|---|---|
| ``pretrain`` | flags, process start-up (spawn or torchrun), the single run and ``--compare`` |
| ``config`` | ``GPTRunConfig``, YAML loading, a flag per field, validation |
| ``model`` | process groups, CPU support for megatron-core, ``GPTModel`` from the flux or baseline spec |
| ``data`` | the synthetic token stream |
| ``train`` | optimizer, SP grad reduction, clipping, schedule, checkpoints, training loop, progress line |
| ``sizing`` | FLOPs and the memory estimate |
| ``report`` | ``--compare`` table and JSON (the plot is ``flux_layers.devtools.plot``) |
"""
