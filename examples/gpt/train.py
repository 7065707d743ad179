"""Optimizer, gradient handling, learning-rate schedule, checkpoints and the training loop of the example.

Why not megatron-core's DistributedDataParallel, ``get_megatron_optimizer`` and ``clip_grad_norm_fp32``: in 0.16.1
to 0.19.x they allocate their buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` and so cannot run the
CPU (gloo) version of this example, which is what CI trains. The pieces here do the same work on either device:

- :class:`MixedPrecisionAdamW`: torch AdamW (fused kernel on CUDA) on fp32 master copies of bf16 weights, as
  megatron's Float16OptimizerWithFloat16Params does (fp32 runs optimise the weights directly);
- :func:`allreduce_sequence_parallel_grads`: sums over the TP group the gradients of the parameters tagged
  ``sequence_parallel`` (the norm weights, which see only this rank's sequence shard), as megatron's
  ``finalize_model_grads`` does;
- :func:`clip_grad_norm_`: the global gradient norm over TP ranks, counting TP-replicated parameters once;
- the schedule is megatron-core's own ``OptimizerParamScheduler`` (linear warm-up, cosine decay to ``min_lr``).

There is no data parallelism: TP spans every process, so the only gradient reduction is the one for SP.

Checkpoint layout: ``DIR/iter_NNNNNNN/rank_RRR.pt`` (one file per TP rank: its weight shards, master weights,
optimizer and scheduler state, RNG states) and ``DIR/latest`` (the last complete iteration). The data position is the
iteration number (see ``data``), so a resumed run continues the same loss curve.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import SHAPE_FIELDS, GPTRunConfig
from .data import SyntheticCycleWalk
from .sizing import peak_tflops, train_flops_per_iter


class MixedPrecisionAdamW:
    """AdamW over fp32 master weights; gradients are reduced, clipped and applied in fp32."""

    def __init__(self, model: torch.nn.Module, cfg: GPTRunConfig, tp_group):
        self.tp_group = tp_group
        self.clip_grad = cfg.clip_grad
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        decay = [m for p, m in zip(self.params, self.masters) if p.dim() > 1]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.dim() <= 1]
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        fused = self.params[0].is_cuda
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=fused)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def step(self) -> float:
        """Apply one update from the gradients in ``param.grad``; returns the gradient norm before clipping."""
        for p, m in zip(self.params, self.masters):
            if m is not p and p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None  # NOTE: frees each bf16 grad as its fp32 copy appears (memory peak: see sizing.py)
        allreduce_sequence_parallel_grads(self.params, self.masters, self.tp_group)
        grad_norm = clip_grad_norm_(self.params, self.masters, self.clip_grad, self.tp_group)
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)
        return grad_norm

    def state_dict(self) -> dict:
        # fp32 runs: the masters are the weights, and torch.save stores shared storage once.
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for p, m, saved in zip(self.params, self.masters, state["masters"]):
            m.copy_(saved)
            if m is not p:
                p.copy_(m)


def allreduce_sequence_parallel_grads(params, grad_owners, tp_group) -> None:
    """Sum over TP ranks the grads of parameters tagged ``sequence_parallel`` (``grad_owners[i].grad`` holds the
    gradient of ``params[i]``)."""
    if dist.get_world_size(tp_group) == 1:
        return
    grads = [o.grad for p, o in zip(params, grad_owners)
             if getattr(p, "sequence_parallel", False) and o.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def clip_grad_norm_(params, grad_owners, max_norm: float, tp_group) -> float:
    """Scale grads so that their global 2-norm is at most ``max_norm`` (0: no clipping); returns the norm."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    counted = [o.grad for p, o in zip(params, grad_owners)
               if o.grad is not None and param_is_not_tensor_parallel_duplicate(p, tp_group)]
    device = grad_owners[0].device
    sq = torch.stack(torch._foreach_norm(counted)).pow(2).sum() if counted else torch.zeros((), device=device)
    dist.all_reduce(sq, group=tp_group)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([o.grad for o in grad_owners if o.grad is not None], coef)
    return norm.item()


def build_scheduler(optimizer: MixedPrecisionAdamW, cfg: GPTRunConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.train_iters, lr_decay_style="cosine", start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.train_iters, wd_incr_style="constant")


# ---- checkpoints -------------------------------------------------------------------------------------------------

def _rng_state() -> dict:
    from megatron.core import tensor_parallel
    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(save_dir: str, step: int, model, optimizer, scheduler, cfg: GPTRunConfig,
                    linear_impl: str) -> str:
    rank, tp = dist.get_rank(), dist.get_world_size()
    path = os.path.join(save_dir, f"iter_{step:07d}")
    os.makedirs(path, exist_ok=True)
    torch.save({"iteration": step, "tp": tp, "linear_impl": linear_impl, "config": dataclasses.asdict(cfg),
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": _rng_state()},
               os.path.join(path, f"rank_{rank:03d}.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(save_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
        os.replace(tmp, os.path.join(save_dir, "latest"))
    dist.barrier()
    return path


def checkpoint_path(load_dir: str, step: int | None = None) -> tuple[int, str]:
    """(iteration, directory) of the checkpoint of iteration ``step`` in ``load_dir``, or of the latest one."""
    if step is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"--load {load_dir}: no checkpoint there (no {latest})")
        with open(latest) as f:
            step = int(f.read().strip())
    path = os.path.join(load_dir, f"iter_{step:07d}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--load {load_dir}: no checkpoint of iteration {step} (no {path})")
    return step, path


def load_checkpoint(load_dir: str, model, optimizer, scheduler, cfg: GPTRunConfig, linear_impl: str,
                    step: int | None = None) -> int:
    """Restore the state saved by :func:`save_checkpoint` (iteration ``step``, default the latest); returns the
    iteration it was saved at."""
    step, path = checkpoint_path(load_dir, step)
    rank, tp = dist.get_rank(), dist.get_world_size()
    # NOTE: CPU first: RNG states must be CPU tensors, and the optimizer state would not fit twice on the GPU.
    ckpt = torch.load(os.path.join(path, f"rank_{rank:03d}.pt"), map_location="cpu", weights_only=True)
    if ckpt["tp"] != tp:
        raise ValueError(f"--load {load_dir}: checkpoint has tensor-parallel size {ckpt['tp']}, this run {tp}")
    if ckpt["linear_impl"] != linear_impl:
        raise ValueError(f"--load {load_dir}: checkpoint was written with --linear-impl {ckpt['linear_impl']}, "
                         f"this run uses {linear_impl}")
    differ = {k: (ckpt["config"][k], getattr(cfg, k)) for k in SHAPE_FIELDS if ckpt["config"][k] != getattr(cfg, k)}
    if differ:
        raise ValueError(f"--load {load_dir}: model shape differs from the checkpoint's (checkpoint, this run): "
                         f"{differ}")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    _set_rng_state(ckpt["rng"])
    return step


# ---- training loop -----------------------------------------------------------------------------------------------

@dataclass
class RunHistory:
    """Per-iteration record of one training run (the iterations this process ran)."""
    iterations: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None


@dataclass
class RunOptions:
    """The run-control flags the loop needs (everything that is not the model/training config)."""
    linear_impl: str
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    ckpt_step: int | None = None
    exit_interval: int = 0
    log_interval: int = 10
    peak_tflops: float | None = None
    cuda_graphs: bool = False  # the model was built with megatron-core's local CUDA graphs (model.build_model)


class Progress:
    """One line per ``log_interval`` iterations on rank 0: loss, lr, grad norm, step time, tokens/s, TFLOP/s, MFU."""

    def __init__(self, cfg: GPTRunConfig, opts: RunOptions, start: int, device: torch.device):
        self.cfg, self.opts, self.start = cfg, opts, start
        self.flops = train_flops_per_iter(cfg)
        self.gpus = dist.get_world_size()
        self.peak = opts.peak_tflops or (peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda"
                                         else None)
        self.window: list[float] = []
        self.began = time.perf_counter()
        self.enabled = dist.get_rank() == 0

    def update(self, it: int, loss: float, step_s: float, grad_norm: float, lr: float) -> None:
        self.window.append(step_s)
        last = it == self.cfg.train_iters or (self.opts.exit_interval and it % self.opts.exit_interval == 0)
        if not self.enabled or not (it == self.start + 1 or it % self.opts.log_interval == 0 or last):
            return
        step = sum(self.window) / len(self.window)
        self.window = []
        tflops = self.flops / step / self.gpus / 1e12
        mfu = f"{100 * tflops / self.peak:.1f}%" if self.peak else "n/a"
        done = (it - self.start) / max(1, self.cfg.train_iters - self.start)
        eta = (time.perf_counter() - self.began) * (1 - done) / max(done, 1e-9)
        bar = "#" * round(20 * it / self.cfg.train_iters)
        print(f"iter {it:>{len(str(self.cfg.train_iters))}}/{self.cfg.train_iters} [{bar:<20}] loss {loss:.4f} | "
              f"lr {lr:.2e} | grad norm {grad_norm:.3f} | {1e3 * step:.1f} ms/it | "
              f"{self.cfg.tokens_per_iter / step:,.0f} tok/s | {tflops:.1f} TFLOP/s/GPU | MFU {mfu} | "
              f"ETA {eta:.0f} s", flush=True)


def train_step(model, optimizer, data: SyntheticCycleWalk, cfg: GPTRunConfig, it: int,
               position_ids: torch.Tensor, cuda_graphs: bool = False) -> tuple[float, float]:
    """One optimizer step on iteration ``it``'s micro-batches; returns (mean loss, grad norm). With
    ``cuda_graphs``, the layers' forward and backward passes of the first step are recorded and captured at its end
    (as megatron-core's schedules do); later steps replay them."""
    optimizer.zero_grad()
    total = torch.zeros((), device=position_ids.device)
    for micro in range(cfg.num_microbatches):
        tokens = data.batch((it - 1) * cfg.num_microbatches + micro, cfg.micro_batch_size)
        tokens = tokens.to(position_ids.device, non_blocking=True)
        if micro == 0:
            model.set_is_first_microbatch()  # as megatron's schedules: FP8 linears recast their weights (if fp8)
        per_token = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
        loss = per_token.float().mean() / cfg.num_microbatches
        loss.backward()
        total += loss.detach()
    if cuda_graphs:
        from megatron.core.transformer.cuda_graphs import create_cudagraphs
        create_cudagraphs()  # a no-op once the graphs exist
    grad_norm = optimizer.step()
    loss_value = total.item()
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value} at iteration {it}")
    return loss_value, grad_norm


def train(model, cfg: GPTRunConfig, opts: RunOptions, device: torch.device) -> RunHistory:
    """Train ``model`` to ``cfg.train_iters`` (from the checkpoint in ``opts.load`` if given)."""
    from megatron.core import parallel_state
    tp_group = parallel_state.get_tensor_model_parallel_group()
    optimizer = MixedPrecisionAdamW(model, cfg, tp_group)
    scheduler = build_scheduler(optimizer, cfg)
    start = 0
    if opts.load:
        start = load_checkpoint(opts.load, model, optimizer, scheduler, cfg, opts.linear_impl, opts.ckpt_step)
        if dist.get_rank() == 0:
            print(f"resumed from {opts.load} at iteration {start}"
                  + (f"; nothing left to train (train_iters {cfg.train_iters})" if start >= cfg.train_iters else ""),
                  flush=True)
    data = SyntheticCycleWalk(cfg.vocab_size, cfg.seq_length, cfg.seed, cfg.data_jump_prob)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, -1)
    progress = Progress(cfg, opts, start, device)
    history = RunHistory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    for it in range(start + 1, cfg.train_iters + 1):
        began = time.perf_counter()
        scheduler.step(1)  # the schedule's value at iteration it: the first step already has a non-zero lr
        loss, grad_norm = train_step(model, optimizer, data, cfg, it, position_ids, opts.cuda_graphs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if opts.cuda_graphs and opts.linear_impl == "flux":
            from flux_layers.runtime.workspace import check_graph_replays
            check_graph_replays()  # a fused op's timeout inside a replay surfaces here (no host code ran)
        step_s = time.perf_counter() - began
        lr = optimizer.param_groups[0]["lr"]
        for name, value in (("iterations", it), ("losses", loss), ("step_times_s", step_s),
                            ("grad_norms", grad_norm), ("lrs", lr)):
            getattr(history, name).append(value)
        progress.update(it, loss, step_s, grad_norm, lr)
        stop = bool(opts.exit_interval) and it % opts.exit_interval == 0
        if opts.save and (it == cfg.train_iters or stop or (opts.save_interval and it % opts.save_interval == 0)):
            path = save_checkpoint(opts.save, it, model, optimizer, scheduler, cfg, opts.linear_impl)
            if dist.get_rank() == 0:
                print(f"saved checkpoint {path}", flush=True)
        if stop:
            if dist.get_rank() == 0:
                print(f"exiting at iteration {it} (--exit-interval {opts.exit_interval})", flush=True)
            break
    if device.type == "cuda":
        history.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    return history
