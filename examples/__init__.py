"""Examples of flux_layers in use; ``examples.gpt`` is the GPT pretraining run by ``examples/pretrain_gpt.py``."""
