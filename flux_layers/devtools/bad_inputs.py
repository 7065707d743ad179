"""A catalogue of bad inputs to the public operators, the fused functions and the layers' constructors, each with the
rule its error message must state; shared by benchmarks/reliability.py and the tests.

A case is answered clearly when the call raises one of the case's exception types and the message names the argument
(one of ``names``, as a whole word) and states the rule (one of ``rules``, a substring, any case). Every rank makes
the same bad call (a case is not a rank mismatch; those are benchmarks/reliability.py's rank_mismatch), and
:func:`run_cases` makes a valid call of each op after each case and checks it: a rejected call must leave the ranks in
step and the workspaces usable.

``cpu`` marks the cases whose rejection is the same on every backend (the shared argument checks of
flux_layers/ops/_checks.py, the layers' constructors): the CPU tests run those on gloo with the reference backend;
``stage`` says where a case is expected to be stopped: ``args`` (ops' shared checks, before a path is chosen),
``fused`` (the fused path's Python checks, before the cross-rank check and the workspace), ``op`` (the op library's
per-call checks, before the epoch advances), ``layer`` (a constructor).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

ROWS, K, N = 128, 256, 256  # the valid problem: rows per rank, K, N (ag_gemm: N / tp per rank)


@dataclass
class Env:
    """What a case needs: this rank's group and device, the backend the ops are asked for ('fused' on GPUs,
    'reference' on CPU) and the dtype of the valid inputs."""
    rank: int
    tp: int
    group: object
    device: torch.device
    backend: str
    dtype: torch.dtype
    seed: int = 0

    @classmethod
    def here(cls, rank: int, tp: int, group=None, seed: int = 0) -> Env:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return cls(rank, tp, group if group is not None else dist.group.WORLD, device,
                   "fused" if cuda else "reference", torch.bfloat16 if cuda else torch.float32, seed)

    def t(self, *shape, dtype=None, device=None) -> torch.Tensor:
        return torch.randn(*shape, device=device or self.device).to(dtype or self.dtype)

    def ag(self, x, w, b=None, **kw):
        from flux_layers import ops
        kw.setdefault("backend", self.backend)
        return ops.ag_gemm(x, w, b, group=self.group, **kw)

    def rs(self, x, w, b=None, **kw):
        from flux_layers import ops
        kw.setdefault("backend", self.backend)
        return ops.gemm_rs(x, w, b, group=self.group, **kw)

    def ag_args(self):
        """Valid (x_shard_m [ROWS, K], w [N/tp, K], b [N/tp]) of ag_gemm."""
        return self.t(ROWS, K), self.t(N // self.tp, K), self.t(N // self.tp)

    def rs_args(self):
        """Valid (x [ROWS * tp, K / tp], w [N, K / tp], b [N]) of gemm_rs."""
        return self.t(ROWS * self.tp, K // self.tp), self.t(N, K // self.tp), self.t(N)


def _misaligned(env: Env, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view one element past a 16-byte boundary."""
    return env.t(rows * cols + 8).view(-1)[1:1 + rows * cols].view(rows, cols)


def _fused_ag(env: Env, x, w, b=None, **kw):
    from flux_layers.ops import fused_ag_gemm
    return fused_ag_gemm.ag_gemm(x, w, b, group=env.group, **kw)


def _fused_rs(env: Env, x, w, b=None, **kw):
    from flux_layers.ops import fused_gemm_rs
    return fused_gemm_rs.gemm_rs(x, w, b, group=env.group, **kw)


def _megatron_config(env: Env, **kw):
    from megatron.core import ModelParallelConfig
    return ModelParallelConfig(tensor_model_parallel_size=env.tp, sequence_parallel=kw.pop("sp", True),
                               params_dtype=env.dtype, perform_initialization=False,
                               use_cpu_initialization=env.device.type == "cpu", **kw)


def _column(env: Env, output_size: int, **kw):
    from flux_layers.layers import ColumnParallelLinear
    return ColumnParallelLinear(K, output_size, config=_megatron_config(env), init_method=torch.nn.init.zeros_,
                                tp_group=env.group, **kw)


def _row(env: Env, input_size: int, input_is_parallel: bool = True):
    from flux_layers.layers import RowParallelLinear
    return RowParallelLinear(input_size, N, config=_megatron_config(env), init_method=torch.nn.init.zeros_,
                             bias=True, input_is_parallel=input_is_parallel, skip_bias_add=False, tp_group=env.group)


def _overlap(**kw):
    from flux_layers.layers import OverlapConfig
    return OverlapConfig(**kw)


def _ws(env: Env, op: str):
    """The cached workspace the valid calls use (created collectively if absent: every rank runs the same case)."""
    from flux_layers.runtime import workspace
    if op == "ag":
        return workspace.get_ag_workspace(env.group, env.dtype, ROWS * env.tp, K)
    return workspace.get_rs_workspace(env.group, env.dtype, ROWS * env.tp, N)


@dataclass(frozen=True)
class BadInput:
    name: str
    call: Callable[[Env], object]
    names: tuple[str, ...]          # the message names one of these (whole word)
    rules: tuple[str, ...]          # and states one of these (substring, any case)
    stage: str                      # where it is stopped: args | fused | op | layer
    cpu: bool = False               # the same rejection on CPU with the reference backend
    errors: tuple[type, ...] = (ValueError,)
    min_devices: int = 1            # CUDA devices this process must see


def _bias_nc(e, n):
    return e.t(2 * n)[::2]


# The Python check says "bias must have shape (N,)"; the op library's "bias must have shape [N] (...), got [...]".
_BIAS_SHAPE = ("must have shape",)

CASES: tuple[BadInput, ...] = (
    # ---- ops' shared argument checks (every backend)
    BadInput("ag_x_1d", lambda e: e.ag(e.t(ROWS * K), e.t(N // e.tp, K)), ("x",), ("2-D",), "args", cpu=True),
    BadInput("ag_x_3d", lambda e: e.ag(e.t(2, ROWS // 2, K), e.t(N // e.tp, K)), ("x",), ("2-D",), "args",
             cpu=True),
    BadInput("ag_weight_1d", lambda e: e.ag(e.t(ROWS, K), e.t(K)), ("weight",), ("2-D",), "args", cpu=True),
    BadInput("ag_k_mismatch", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K // 2)), ("K",), ("disagree on K",),
             "args", cpu=True),
    BadInput("ag_dtype_mismatch", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K, dtype=torch.float16)),
             ("weight",), ("same dtype", "of one dtype"), "args", cpu=True),
    # the bias is not part of a call's decision: checked per call (by the reference op, or the op library)
    BadInput("ag_bias_shape", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K), e.t(N // e.tp + 8)), ("bias",),
             _BIAS_SHAPE, "op", cpu=True),
    BadInput("ag_bias_dtype", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K), e.t(N // e.tp, dtype=torch.float64)),
             ("bias",), ("dtype and device of x", "bias dtype"), "op", cpu=True),
    BadInput("ag_weight_layout", lambda e: e.ag(*e.ag_args(), weight_layout="tn"), ("weight_layout",),
             ("must be 'nt'",), "args", cpu=True),
    BadInput("ag_backend", lambda e: e.ag(*e.ag_args(), backend="fast"), ("backend",), ("must be one of",), "args",
             cpu=True),
    BadInput("ag_x_on_cpu", lambda e: e.ag(e.t(ROWS, K, device="cpu"), e.t(N // e.tp, K)), ("x",),
             ("same device",), "args"),
    BadInput("ag_bias_on_cpu", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K), e.t(N // e.tp, device="cpu")),
             ("bias",), ("dtype and device of x", "must be a CUDA tensor on"), "op"),
    BadInput("ag_mixed_gpus", lambda e: e.ag(e.t(ROWS, K, device="cuda:0"), e.t(N // e.tp, K, device="cuda:1")),
             ("x",), ("same device",), "args", min_devices=2),
    BadInput("rs_return_gathered", lambda e: e.rs(*e.rs_args(), return_gathered=True), ("return_gathered",),
             ("unexpected keyword",), "args", cpu=True, errors=(TypeError,)),
    BadInput("rs_m_indivisible", lambda e: e.rs(e.t(ROWS * e.tp + 1, K // e.tp), e.t(N, K // e.tp)), ("M",),
             ("not divisible by the group size",), "fused", cpu=True),
    BadInput("rs_nn_k_mismatch", lambda e: e.rs(e.t(ROWS * e.tp, K // e.tp), e.t(K // e.tp + 8, N),
                                                weight_layout="nn"), ("K",), ("disagree on K",), "args", cpu=True),
    BadInput("rs_bias_shape", lambda e: e.rs(e.t(ROWS * e.tp, K // e.tp), e.t(N, K // e.tp), e.t(N // 2)),
             ("bias",), _BIAS_SHAPE, "op", cpu=True),
    BadInput("rs_x_3d", lambda e: e.rs(e.t(e.tp, ROWS, K // e.tp), e.t(N, K // e.tp)), ("x",), ("2-D",), "args",
             cpu=True),
    BadInput("rs_backend", lambda e: e.rs(*e.rs_args(), backend="nccl"), ("backend",), ("must be one of",), "args",
             cpu=True),
    # ---- the fused path's checks (before the cross-rank check and the workspace)
    BadInput("ag_fp32_fused", lambda e: e.ag(e.t(ROWS, K, dtype=torch.float32), e.t(N // e.tp, K,
                                                                                       dtype=torch.float32),
                                             backend="fused"), ("x", "weight"),
             ("bfloat16 or float16", "bfloat16, float16 or FP8"), "fused", errors=(RuntimeError,)),
    BadInput("fused_ag_fp32", lambda e: _fused_ag(e, e.t(ROWS, K, dtype=torch.float32),
                                                  e.t(N // e.tp, K, dtype=torch.float32)), ("x_shard_m",),
             ("bfloat16 or float16", "bfloat16, float16, float8"), "fused"),
    BadInput("fused_ag_on_cpu", lambda e: _fused_ag(e, e.t(ROWS, K, device="cpu"), e.t(N // e.tp, K, device="cpu")),
             ("x_shard_m",), ("CUDA tensor",), "fused"),
    BadInput("fused_ag_n_not_multiple_of_8", lambda e: _fused_ag(e, e.t(ROWS, K), e.t(100, K)), ("N",),
             ("multiple of 8",), "fused"),
    BadInput("fused_ag_k_not_multiple_of_8", lambda e: _fused_ag(e, e.t(ROWS, 100), e.t(N // e.tp, 100)), ("K",),
             ("multiple of 8",), "fused"),
    BadInput("fused_ag_x_non_contiguous", lambda e: _fused_ag(e, e.t(ROWS, 2 * K)[:, ::2], e.t(N // e.tp, K)),
             ("x_shard_m",), ("unit stride",), "fused"),
    BadInput("fused_ag_weight_transposed_view", lambda e: _fused_ag(e, e.t(ROWS, K), e.t(K, N // e.tp).t()),
             ("weight",), ("unit stride",), "fused"),
    BadInput("fused_ag_x_misaligned", lambda e: _fused_ag(e, _misaligned(e, ROWS, K), e.t(N // e.tp, K)),
             ("x_shard_m",), ("16-byte aligned",), "fused"),
    BadInput("fused_ag_x_row_stride", lambda e: _fused_ag(e, e.t(ROWS, K + 4)[:, :K], e.t(N // e.tp, K)),
             ("x_shard_m",), ("not a multiple of 16 bytes",), "fused"),
    BadInput("fused_ag_mode", lambda e: _fused_ag(e, *e.ag_args(), mode="both"), ("mode",), ("'pull' or 'push'",),
             "fused"),
    BadInput("fused_ag_chunk_rows", lambda e: _fused_ag(e, *e.ag_args(), chunk_rows=-1), ("chunk_rows",),
             (">= 0",), "fused"),
    BadInput("fused_ag_ws_kind", lambda e: _fused_ag(e, *e.ag_args(), ws=_ws(e, "rs")), ("ws",),
             ("AgWorkspace",), "fused", errors=(TypeError,)),
    BadInput("fused_ag_ws_too_small", lambda e: _fused_ag(e, e.t(_ws(e, "ag").max_m // e.tp + 8, K),
                                                          e.t(N // e.tp, K), ws=_ws(e, "ag")), ("M", "max_m"),
             ("the workspace holds",), "fused"),
    BadInput("fused_rs_transport", lambda e: _fused_rs(e, *e.rs_args(), transport="nvlink"), ("transport",),
             ("'auto', 'epilogue' or 'copy_engine'",), "fused"),
    BadInput("fused_rs_chunk_cols", lambda e: _fused_rs(e, *e.rs_args(), chunk_cols=-5), ("chunk_cols",),
             (">= 0",), "fused"),
    BadInput("fused_rs_n_not_multiple_of_8", lambda e: _fused_rs(e, e.t(ROWS * e.tp, K // e.tp),
                                                                 e.t(100, K // e.tp)), ("N",), ("multiple of 8",),
             "fused"),
    BadInput("fused_rs_ws_kind", lambda e: _fused_rs(e, *e.rs_args(), ws=_ws(e, "ag")), ("ws",), ("RsWorkspace",),
             "fused", errors=(TypeError,)),
    # ---- the op library's per-call checks (a call of a shape already decided: only the op checks it)
    BadInput("ag_bias_non_contiguous", lambda e: e.ag(e.t(ROWS, K), e.t(N // e.tp, K), _bias_nc(e, N // e.tp)),
             ("bias",), ("contiguous",), "op"),
    BadInput("ag_x_misaligned_decided", lambda e: e.ag(_misaligned(e, ROWS, K), e.t(N // e.tp, K)), ("x",),
             ("16-byte aligned",), "op"),
    BadInput("rs_weight_transposed_view_decided", lambda e: e.rs(e.t(ROWS * e.tp, K // e.tp), e.t(K // e.tp, N).t()),
             ("weight",), ("unit stride",), "op"),
    BadInput("fused_rs_bias_non_contiguous", lambda e: _fused_rs(e, *e.rs_args()[:2], _bias_nc(e, N)), ("bias",),
             ("contiguous",), "op"),
    # ---- layers and their configuration
    BadInput("column_output_indivisible", lambda e: _column(e, N * e.tp + 1), ("output_size",),
             ("not divisible by the tensor-parallel size",), "layer", cpu=True),
    BadInput("row_input_indivisible", lambda e: _row(e, K * e.tp + 1), ("input_size",),
             ("not divisible by the tensor-parallel size",), "layer", cpu=True),
    BadInput("row_sequence_parallel_needs_parallel_input", lambda e: _row(e, K * e.tp, input_is_parallel=False),
             ("input_is_parallel",), ("needs",), "layer", cpu=True, errors=(RuntimeError,)),
    BadInput("column_overlap_type", lambda e: _column(e, N * e.tp, overlap="yes"), ("overlap",),
             ("must be a flux_layers.OverlapConfig",), "layer", cpu=True, errors=(TypeError,)),
    BadInput("overlap_wgrad_input", lambda e: _overlap(wgrad_input="later"), ("wgrad_input",), ("must be one of",),
             "layer", cpu=True),
    BadInput("overlap_backend", lambda e: _overlap(backend="cuda"), ("backend",), ("must be None or one of",),
             "layer", cpu=True),
    BadInput("overlap_fused_but_switched_off", lambda e: _overlap(backend="fused", tp_comm_overlap_ag=False),
             ("tp_comm_overlap_ag",), ("turns them off",), "layer", cpu=True),
)


def applicable(case: BadInput, env: Env) -> bool:
    """Whether ``case`` runs in ``env``: on CPU only the ``cpu`` cases; on GPUs every case this process can build
    (the layers' cases need megatron-core, an install without it skips them; the CPU tests run them)."""
    if case.stage == "layer" and not _megatron_available():
        return False
    if env.device.type == "cpu":
        return case.cpu
    return torch.cuda.device_count() >= case.min_devices and not (
        case.min_devices > 1 and torch.cuda.device_count() > 0 and _shared_gpu())


def _megatron_available() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _shared_gpu() -> bool:
    from flux_layers.devtools.launch import shared_gpu
    return shared_gpu()


def _names(message: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", message) for n in names)


def clear(case: BadInput, exc: BaseException | None) -> bool:
    """Whether ``exc`` answers ``case`` clearly: an expected type, and a message that names the argument and states
    the rule."""
    if exc is None or not isinstance(exc, case.errors):
        return False
    message = str(exc)
    return _names(message, case.names) and any(rule.lower() in message.lower() for rule in case.rules)


def _epochs() -> list[int]:
    from flux_layers.runtime import workspace
    return [w.epoch for ws in list(workspace._cache.values()) for w in (ws, ws.graph_twin) if w is not None]


def valid_calls(env: Env, seed: int) -> tuple[bool, str]:
    """One ag_gemm and one gemm_rs call on valid inputs (identical on every rank), checked: with the oracle on GPUs
    (flux_layers/devtools/oracle.py), against float64 on CPU. (ok, what failed)."""
    from flux_layers.devtools import oracle
    gen = torch.Generator(device=env.device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=env.device).to(env.dtype)
    x, w_ag, b_ag = rand(ROWS * env.tp, K), rand(N // env.tp, K), rand(N // env.tp)
    x_rs, w_rs, b_rs = rand(ROWS * env.tp, K), rand(N, K), rand(N)
    outs = {
        "ag_gemm": (env.ag(x.chunk(env.tp)[env.rank], w_ag, b_ag), (x, w_ag, b_ag), None),
        "gemm_rs": (env.rs(x_rs.chunk(env.tp, dim=1)[env.rank].contiguous(),
                           w_rs.chunk(env.tp, dim=1)[env.rank].contiguous(), b_rs), (x_rs, w_rs, b_rs), env.rank),
    }
    for op, (out, (xi, wi, bi), row_block) in outs.items():
        def part(t):
            return t if row_block is None else t.chunk(env.tp)[row_block]
        if env.device.type == "cuda":
            ok, err, limit = oracle.verdict(out, part(oracle.matmul_fp32(xi, wi, bi, "nt")),
                                            part(oracle.matmul_cublas(xi, wi, bi, "nt")))
        else:
            ref = part(xi.double() @ wi.double().t() + bi.double())
            err, limit = oracle.rel_error(out, ref), 1e-5
            ok = err <= limit
        if not ok:
            return False, f"{op}: relative error {err:.3e} > {limit:.3e}"
    return True, ""


def run_case(case: BadInput, env: Env, seed: int) -> dict:
    """The bad call, then a valid call of each op; every rank runs the same. A row of the record."""
    before = _epochs() if env.device.type == "cuda" else []
    exc = None
    try:
        case.call(env)
    except Exception as e:  # noqa: BLE001 - any exception is recorded; clear() judges it
        exc = e
    after = _epochs() if env.device.type == "cuda" else []
    later_ok, later_error = valid_calls(env, seed)
    return {"case": case.name, "stage": case.stage, "raised": exc is not None,
            "error_type": type(exc).__name__ if exc is not None else None,
            "message": str(exc).split("\nException raised from")[0][:600] if exc is not None else None,
            "clear": clear(case, exc), "epoch_advanced": before != after[:len(before)],
            "later_ok": later_ok, "later_error": later_error}


def run_cases(env: Env, cases: tuple[BadInput, ...] = CASES, progress: Callable[[str], None] | None = None
              ) -> list[dict]:
    """Every applicable case in order (the same on every rank); one row each. The valid calls run once first, so
    that the calls of their shapes are decided and the ``op`` cases reach the op library's checks."""
    ok, error = valid_calls(env, env.seed)
    if not ok:
        raise RuntimeError(f"the valid calls fail before any bad input: {error}")
    rows = []
    for i, case in enumerate(c for c in cases if applicable(c, env)):
        row = run_case(case, env, env.seed + 1 + i)
        rows.append(row)
        if progress is not None:
            progress(f"{case.name}: {'clear' if row['clear'] else 'UNCLEAR'}, later calls "
                     f"{'ok' if row['later_ok'] else 'WRONG'} | {row['error_type']}: {row['message']}")
    return rows
