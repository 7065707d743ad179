"""A learnable synthetic token stream, addressable by batch index.

A hidden random cyclic order of the vocabulary is drawn once from the seed. Each sample walks along that cycle (the
next token is the current token's successor) and, with probability ``jump_prob`` per position, jumps to a uniformly
random token. A model that learns the successor table reaches a loss near
``jump_prob * ln(V) + H(jump_prob)`` nats, far below the ``ln(V)`` of a uniform guess, so the loss curve shows
learning within a few dozen steps of a tiny model.

Batch ``i`` depends on (seed, i) alone: a resumed run that asks for the same indices sees the same tokens, so the
data position is the iteration number and needs no state of its own in a checkpoint.
"""
from __future__ import annotations

import torch


class SyntheticCycleWalk:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, jump_prob: float):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.jump_prob = jump_prob
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self.cycle = order                                # cycle[i] is the i-th token of the hidden cycle
        self.position = torch.empty_like(order)
        self.position[order] = torch.arange(vocab_size)   # position[token] is where it sits on the cycle

    def batch(self, index: int, batch_size: int) -> torch.Tensor:
        """Tokens [batch_size, seq_length + 1] (int64, CPU) of batch ``index``: inputs are [:, :-1], labels [:, 1:]."""
        g = torch.Generator().manual_seed((self.seed << 32) + index)
        n = self.seq_length + 1
        jumps = torch.rand(batch_size, n, generator=g) < self.jump_prob
        jumps[:, 0] = True
        targets = torch.randint(self.vocab_size, (batch_size, n), generator=g)
        k = torch.arange(n).expand(batch_size, n)
        last_jump = torch.where(jumps, k, torch.zeros_like(k)).cummax(dim=1).values
        start = self.position[targets.gather(1, last_jump)]
        return self.cycle[(start + k - last_jump) % self.vocab_size]
