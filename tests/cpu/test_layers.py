"""ColumnParallelLinear / RowParallelLinear against an unsharded fp64 ``F.linear`` and against megatron-core's own
layers, on 2 and 4 gloo processes with the reference backend and fresh random inputs.

Every case checks the output and every gradient (input, weight or ``main_grad``, bias). megatron-core's layers
run on CPU here with one test-only shim: ``torch.cuda.current_device`` returns 'cpu' (megatron allocates its
gather buffers with ``device=torch.cuda.current_device()``). Its gradient-accumulation fusion needs APEX's CUDA
extension, so those cases compare against fp64 only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flux_layers.devtools.launch import run_distributed

TOL = dict(rtol=1e-10, atol=1e-10)
GA_MODES = ("off", "main_grad", "flagged")  # no fusion; main_grad only; main_grad + grad_added_to_main_grad


@dataclass(frozen=True)
class Case:
    kind: str                      # "column" | "row"
    sp: bool
    bias: bool
    skip_bias_add: bool = False
    gather_output: bool = False    # column
    input_is_parallel: bool = True  # row
    ga: str = "off"
    wgrad_input: str = "keep"      # column, SP
    frozen: bool = False


def _column_cases():
    for sp, (bias, skip), gather, ga in itertools.product(
            (False, True), ((False, False), (True, False), (True, True)), (False, True), GA_MODES):
        for wgrad_input in (("keep", "regather") if sp else ("keep",)):
            yield Case("column", sp, bias, skip, gather_output=gather, ga=ga, wgrad_input=wgrad_input)
    yield Case("column", True, True, frozen=True)
    yield Case("column", False, True, frozen=True)


def _row_cases():
    for sp, (bias, skip), ga in itertools.product(
            (False, True), ((False, False), (True, False), (True, True)), GA_MODES):
        for input_is_parallel in ((True,) if sp else (True, False)):
            yield Case("row", sp, bias, skip, input_is_parallel=input_is_parallel, ga=ga)
    yield Case("row", True, True, frozen=True)
    yield Case("row", False, False, input_is_parallel=False, frozen=True)


def megatron_on_cpu(tp: int):
    """parallel_state over the gloo world (TP = world size) and the CPU shim for megatron's layers."""
    from megatron.core import parallel_state
    torch.cuda.current_device = lambda: "cpu"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    return parallel_state.get_tensor_model_parallel_group()


def _config(tp: int, sp: bool, ga: bool = False, **kw):
    from megatron.core import ModelParallelConfig
    return ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                               params_dtype=torch.float64, gradient_accumulation_fusion=ga, **kw)


def _build(case: Case, lib: str, tp: int, group, k: int, n: int):
    from megatron.core import tensor_parallel as mtp

    from flux_layers.layers import ColumnParallelLinear, OverlapConfig, RowParallelLinear
    config = _config(tp, case.sp, ga=case.ga != "off" and lib == "flux")
    kw = dict(config=config, init_method=torch.nn.init.zeros_, bias=case.bias, skip_bias_add=case.skip_bias_add,
              tp_group=group)
    if lib == "flux":
        kw["overlap"] = OverlapConfig(backend="reference", wgrad_input=case.wgrad_input)
    if case.kind == "column":
        cls = ColumnParallelLinear if lib == "flux" else mtp.ColumnParallelLinear
        return cls(k, n, gather_output=case.gather_output, **kw)
    cls = RowParallelLinear if lib == "flux" else mtp.RowParallelLinear
    return cls(k, n, input_is_parallel=case.input_is_parallel, **kw)


def _reference(case: Case, x, w, b, dy):
    """Unsharded fp64: output and gradients of <F.linear(x, w, b), dy>."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = F.linear(x, w, b if not case.skip_bias_add else None)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None and not case.skip_bias_add else None)


def _shard(t, dim, rank, tp):
    return t.chunk(tp, dim=dim)[rank].contiguous()


def _run_case(case: Case, rank: int, tp: int, group, seed: int):
    """Returns (our output, grads) and checks them against fp64 and (where it runs) megatron-core."""
    g = torch.Generator().manual_seed(seed)
    s, bsz, k, n = 2 * tp, 3, 4 * tp + 4, 4 * tp
    x = torch.randn(s, bsz, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64) if case.bias else None
    dy = torch.randn(s, bsz, n, generator=g, dtype=torch.float64)
    main_grad0 = torch.randn(n, k, generator=g, dtype=torch.float64)
    y_ref, dx_ref, dw_ref, db_ref = _reference(case, x, w, b, dy)

    column = case.kind == "column"
    # What this rank holds of each global tensor.
    if column:
        x_local = _shard(x, 0, rank, tp) if case.sp else x
        w_local, b_local = _shard(w, 0, rank, tp), (_shard(b, 0, rank, tp) if b is not None else None)
        y_local = y_ref if case.gather_output else _shard(y_ref, 2, rank, tp)
        dy_local = dy if case.gather_output else _shard(dy, 2, rank, tp)
        dx_local = _shard(dx_ref, 0, rank, tp) if case.sp else dx_ref
        dw_local, db_local = _shard(dw_ref, 0, rank, tp), (_shard(db_ref, 0, rank, tp) if db_ref is not None else None)
        mg_local = _shard(main_grad0, 0, rank, tp)
    else:
        x_local = _shard(x, 2, rank, tp) if case.input_is_parallel else x
        w_local, b_local = _shard(w, 1, rank, tp), b
        y_local = _shard(y_ref, 0, rank, tp) if case.sp else y_ref
        dy_local = _shard(dy, 0, rank, tp) if case.sp else dy
        dx_local = _shard(dx_ref, 2, rank, tp) if case.input_is_parallel else dx_ref
        dw_local, db_local = _shard(dw_ref, 1, rank, tp), db_ref
        mg_local = _shard(main_grad0, 1, rank, tp)

    results = {}
    for lib in ("flux", "megatron"):
        if lib == "megatron" and case.ga != "off":
            continue
        layer = _build(case, lib, tp, group, k, n)
        with torch.no_grad():
            layer.weight.copy_(w_local)
            if case.bias:
                layer.bias.copy_(b_local)
        if case.frozen:
            layer.weight.requires_grad_(False)
        if case.ga != "off":
            layer.weight.main_grad = mg_local.clone()
            if case.ga == "flagged":
                layer.weight.grad_added_to_main_grad = False
        xl = x_local.clone().requires_grad_()
        out, out_bias = layer(xl)
        out.backward(dy_local)
        if case.sp and case.kind == "row" and case.bias and layer.bias.grad is not None:
            assert layer.bias.sequence_parallel is True
            dist.all_reduce(layer.bias.grad, group=group)  # what finalize_model_grads does for SP-tagged params
        results[lib] = (layer, out, out_bias, xl.grad)

    layer, out, out_bias, dx = results["flux"]
    torch.testing.assert_close(out, y_local, **TOL)
    torch.testing.assert_close(dx, dx_local, **TOL)
    assert (out_bias is layer.bias) if case.skip_bias_add else out_bias is None
    if case.frozen:
        assert layer.weight.grad is None
    elif case.ga == "off":
        torch.testing.assert_close(layer.weight.grad, dw_local, **TOL)
    else:
        torch.testing.assert_close(layer.weight.main_grad, mg_local + dw_local, **TOL)
        if case.ga == "flagged":
            assert layer.weight.grad_added_to_main_grad is True
            assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape
        else:
            assert layer.weight.grad is None
    if case.bias and not case.skip_bias_add:
        torch.testing.assert_close(layer.bias.grad, db_local, **TOL)
    elif case.bias:
        assert layer.bias.grad is None

    if "megatron" in results:
        meg, m_out, m_bias, m_dx = results["megatron"]
        torch.testing.assert_close(out, m_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, m_dx, rtol=1e-12, atol=1e-12)
        assert (m_bias is None) == (out_bias is None)
        for name, p in layer.named_parameters():
            mp = dict(meg.named_parameters())[name]
            assert p.shape == mp.shape, name
            # NOTE: with a frozen weight megatron-core (LinearWithFrozenWeight) drops the bias gradient; ours
            # keeps it (checked against fp64 above).
            if not (case.frozen and name == "bias"):
                torch.testing.assert_close(p.grad, mp.grad, rtol=1e-12, atol=1e-12)
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
                         "sequence_parallel"):
                assert hasattr(p, attr) == hasattr(mp, attr), (case, name, attr)
                assert getattr(p, attr, None) == getattr(mp, attr, None), (case, name, attr)


def _check_cases(rank, tp, group, seed):
    for i, case in enumerate(itertools.chain(_column_cases(), _row_cases())):
        try:
            _run_case(case, rank, tp, group, seed + i)
        except Exception as e:
            raise AssertionError(f"{case}: {e}") from e


def _check_init_and_checkpoint(rank, tp, group):
    """Same seed -> same weights as megatron-core; sharded_state_dict keys, shapes and offsets match."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from flux_layers.layers import ColumnParallelLinear, RowParallelLinear
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    init = lambda t: torch.nn.init.normal_(t, std=0.02)  # noqa: E731
    for sp, stride, bias in itertools.product((False, True), (1, 2), (False, True)):
        config = _config(tp, sp)
        pairs = []
        for ours, theirs, kw in (
                (ColumnParallelLinear, mtp.ColumnParallelLinear, {}),
                (RowParallelLinear, mtp.RowParallelLinear, dict(input_is_parallel=True, skip_bias_add=False))):
            layers = []
            for cls in (ours, theirs):
                torch.manual_seed(1234)
                layers.append(cls(6 * tp, 8 * tp, config=config, init_method=init, bias=bias, stride=stride,
                                  keep_master_weight_for_test=True, tp_group=group, **kw))
            pairs.append(layers)
        for a, b in pairs:
            torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
            torch.testing.assert_close(a.master_weight, b.master_weight, rtol=0, atol=0)
            assert a.state_dict().keys() == b.state_dict().keys()
            sa = a.sharded_state_dict(prefix="decoder.layers.0.lin.", metadata=metadata)
            sb = b.sharded_state_dict(prefix="decoder.layers.0.lin.", metadata=metadata)
            assert sa.keys() == sb.keys() and len(sa) == len(b.state_dict())
            for key in sa:
                ta, tb = sa[key], sb[key]
                assert type(ta) is type(tb), key
                if isinstance(ta, ShardedTensor):
                    assert (ta.key, ta.local_shape, ta.global_shape, ta.global_offset, ta.axis_fragmentations,
                            ta.replica_id, ta.dtype) == (tb.key, tb.local_shape, tb.global_shape, tb.global_offset,
                                                         tb.axis_fragmentations, tb.replica_id, tb.dtype), key
                else:
                    assert isinstance(ta, ShardedObject)
                    assert (ta.key, ta.global_shape, ta.global_offset, ta.replica_id) == \
                        (tb.key, tb.global_shape, tb.global_offset, tb.replica_id), key
            # Loading megatron's state dict into ours (and back) round-trips.
            a.load_state_dict(b.state_dict())
            b.load_state_dict(a.state_dict())


def _check_param_attributes(rank, tp, group):
    """The parameters' tensor-parallel and ``allreduce`` attributes are megatron-core's, for expert layers (whose
    ``allreduce`` rule megatron-core 0.19 widened) and without initialisation (where megatron-core before 0.18 sets
    no tensor-parallel attributes and ours are set all the same)."""
    from megatron.core import tensor_parallel as mtp

    from flux_layers.layers import ColumnParallelLinear, RowParallelLinear, _megatron_compat
    tp_attrs = ("tensor_model_parallel", "partition_dim", "partition_stride")
    expected_tp_attrs = {"weight": {ColumnParallelLinear: (True, 0, 1), RowParallelLinear: (True, 1, 1)},
                         "bias": {ColumnParallelLinear: (True, 0, 1)}}
    for is_expert, expert_tp, init in ((False, tp, True), (True, tp, True), (True, 1, True), (False, tp, False)):
        config = _config(tp, False, expert_tensor_parallel_size=expert_tp, perform_initialization=init)
        for ours, theirs, kw in (
                (ColumnParallelLinear, mtp.ColumnParallelLinear, {}),
                (RowParallelLinear, mtp.RowParallelLinear, dict(input_is_parallel=True, skip_bias_add=True))):
            a, b = (cls(4 * tp, 4 * tp, config=config, init_method=torch.nn.init.zeros_, bias=True, tp_group=group,
                        is_expert=is_expert, **kw) for cls in (ours, theirs))
            for name, p in a.named_parameters():
                mp = dict(b.named_parameters())[name]
                where = (ours.__name__, name, is_expert, expert_tp, init)
                assert p.allreduce == mp.allreduce, where
                assert p.allreduce == (not (is_expert and _megatron_compat.EXPERT_DP_WHERE_ETP_DIFFERS
                                            and expert_tp != tp)), where
                assert tuple(getattr(p, t, None) for t in tp_attrs) == \
                    expected_tp_attrs[name].get(ours, (None, None, None)), where
                if init or _megatron_compat.MEGATRON_CORE >= (0, 18) or name == "bias":
                    assert tuple(getattr(p, t, None) for t in tp_attrs) == \
                        tuple(getattr(mp, t, None) for t in tp_attrs), where
                else:
                    assert not hasattr(mp, "tensor_model_parallel"), where


def _check_errors(rank, tp, group):
    """Bad configurations and inputs raise errors that name the argument or config field."""
    from flux_layers import FusedOpsUnavailable
    from flux_layers.layers import ColumnParallelLinear, OverlapConfig, RowParallelLinear
    sp = _config(tp, True)
    ref = OverlapConfig(backend="reference")
    col = lambda k, n, config=sp, **kw: ColumnParallelLinear(  # noqa: E731
        k, n, config=config, init_method=torch.nn.init.zeros_, tp_group=group, **kw)
    row = lambda k, n, config=sp, **kw: RowParallelLinear(  # noqa: E731
        k, n, config=config, init_method=torch.nn.init.zeros_, bias=True, skip_bias_add=False, tp_group=group, **kw)
    with pytest.raises(ValueError, match=r"output_size=5 is not divisible by the tensor-parallel size 2"):
        col(4, 5)
    with pytest.raises(ValueError, match=r"input_size=5 is not divisible"):
        row(5, 4, input_is_parallel=True)
    with pytest.raises(RuntimeError, match=r"sequence_parallel=True needs input_is_parallel=True"):
        row(4, 4, input_is_parallel=False)
    with pytest.raises(ValueError, match=r"sequence dimension .* \(3\) is not divisible by the tensor-parallel"):
        row(8, 4, input_is_parallel=True, overlap=ref)(torch.randn(3, 2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"supplied weight's shape is \(3, 4\), not \(2, 4\)"):
        col(4, 4)(torch.randn(2, 1, 4, dtype=torch.float64), weight=torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"weight was not supplied"):
        col(4, 4, skip_weight_param_allocation=True)(torch.randn(2, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"disagree on K"):
        col(4, 4, overlap=ref)(torch.randn(2, 1, 6, dtype=torch.float64))
    with pytest.raises(FusedOpsUnavailable, match=r"fused backend requested"):
        col(4, 4, overlap=OverlapConfig(backend="fused"))(torch.randn(2, 1, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"gradient_accumulation_fusion=True needs weight.main_grad"):
        col(4, 4, config=_config(tp, True, ga=True), overlap=ref)(torch.randn(2, 1, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"overlap must be a flux_layers.OverlapConfig"):
        col(4, 4, overlap={"backend": "reference"})
    with pytest.raises(ValueError, match=r"is_expert=True .* needs skip_bias_add=True"):
        row(4, 4, config=_config(tp, False), input_is_parallel=True, is_expert=True)
    deferred = _config(tp, False)
    deferred.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match=r"config.defer_embedding_wgrad_compute=True is not supported"):
        col(4, 4, config=deferred)
    from flux_layers.layers import _megatron_compat
    if _megatron_compat.GENERALIZED_TP:  # megatron-core 0.19 on
        with pytest.raises(ValueError, match=r"generalized tensor parallelism \(config.tensor_parallel_num_weight_"
                                             r"shards: weights sharded 2 ways beyond tensor parallelism\)"):
            col(4, 4, config=_config(tp, False, tensor_parallel_num_weight_shards=2 * tp))


def _check_paths(rank, tp, group):
    """``last_paths`` names the path of every GEMM and why; the overlap switches come from the config."""
    from flux_layers import ops
    from flux_layers.layers import ColumnParallelLinear, RowParallelLinear
    from flux_layers.ops import Choice
    x = torch.randn(2, 3, 4, dtype=torch.float64)

    def paths(config, cls=ColumnParallelLinear, **kw):
        kw = dict(kw, input_is_parallel=True, skip_bias_add=False) if cls is RowParallelLinear else kw
        layer = cls(4, 4, config=config, init_method=torch.nn.init.zeros_, bias=False, tp_group=group, **kw)
        layer(x if cls is ColumnParallelLinear else x.repeat(tp, 1, 1)[:, :, :4 // tp])
        assert set(layer.last_paths) == {"fprop", "dgrad", "wgrad"}
        assert all(isinstance(c, Choice) for c in layer.last_paths.values())
        return {k: (c.path, c.reason) for k, c in layer.last_paths.items()}

    off = paths(_config(tp, True))  # megatron's default: tp_comm_overlap=False
    assert off["fprop"] == ("reference", "overlap switch tp_comm_overlap=False")
    under_wgrad = "; NCCL reduce-scatter under the wgrad GEMM"
    assert off["dgrad"] == ("reference", "overlap switch tp_comm_overlap=False" + under_wgrad)
    on = _config(tp, True, tp_comm_overlap=True, tp_comm_overlap_rs=False)
    # With its switch on, a GEMM goes where ops' dispatch sends it ('auto' on CPU: reference, for a named reason).
    auto = ops.plan("ag_gemm", x.reshape(-1, 4), torch.zeros(4 // tp, 4, dtype=torch.float64), group=group)
    assert auto.path == "reference" and auto.reason not in ("requested", "")
    col = paths(on)
    assert col["fprop"] == (auto.path, auto.reason)
    assert col["dgrad"] == ("reference", "overlap switch tp_comm_overlap_rs=False" + under_wgrad)
    # Megatron's tp_comm_overlap_rs_dgrad (default False) is the column dgrad's own switch.
    dgrad_off = paths(_config(tp, True, tp_comm_overlap=True))
    assert dgrad_off["dgrad"] == ("reference", "overlap switch tp_comm_overlap_rs_dgrad=False" + under_wgrad)
    dgrad_on = paths(_config(tp, True, tp_comm_overlap=True, tp_comm_overlap_rs_dgrad=True))
    assert dgrad_on["dgrad"][0] == auto.path and dgrad_on["dgrad"][1].startswith(auto.reason)
    row = paths(on, RowParallelLinear)
    assert row["fprop"] == ("reference", "overlap switch tp_comm_overlap_rs=False")
    assert row["dgrad"] == (auto.path, auto.reason)
    qkv = _config(tp, True, tp_comm_overlap=True, tp_comm_overlap_disable_qkv=True)
    assert paths(qkv, tp_comm_buffer_name="qkv")["fprop"] == ("reference", "overlap switch tp_comm_overlap_ag=False")
    assert paths(qkv, tp_comm_buffer_name="fc1")["fprop"] != ("reference", "overlap switch tp_comm_overlap_ag=False")
    assert {p for p, _ in paths(_config(tp, False)).values()} == {"local"}


def _check_gemm_keys(rank, tp, group):
    """Each sequence-parallel GEMM is decided under its per-rank GEMM (the tuning table's key), the one the op it
    runs is decided under too: ``last_gemms`` and the keys asked of the dispatcher, by the layer and by its ops."""
    from flux_layers.layers import ColumnParallelLinear, RowParallelLinear
    from flux_layers.ops import _dispatch
    config = _config(tp, True, tp_comm_overlap=True, tp_comm_overlap_rs_dgrad=True)
    asked = []
    real = _dispatch.choose

    def choose(op, **kw):
        asked.append((op, kw["mkn"], kw["backend"]))
        return real(op, **kw)
    _dispatch.choose = choose
    try:
        rows, k, n = 3 * 2, 8, 6 * tp  # this rank's sequence shard [3, 2, K]: M = 6 * tp gathered rows
        m = rows * tp
        col = ColumnParallelLinear(k, n, config=config, init_method=torch.nn.init.normal_, bias=False, tp_group=group)
        x = torch.randn(3, 2, k, dtype=torch.float64, requires_grad=True)
        _dispatch.refresh()
        del asked[:]
        y, _ = col(x)
        y.backward(torch.ones_like(y))
        assert col.last_gemms == {"fprop": ("ag_gemm", (m, k, n // tp)), "dgrad": ("gemm_rs", (m, n // tp, k))}
        # The layer asks about both GEMMs (backend None: ops' auto); its fprop op asks again under the same key.
        assert asked == [("ag_gemm", (m, k, n // tp), None), ("gemm_rs", (m, n // tp, k), None),
                         ("ag_gemm", (m, k, n // tp), "reference")], asked
        row = RowParallelLinear(n, k, config=config, init_method=torch.nn.init.normal_, bias=False,
                                input_is_parallel=True, skip_bias_add=False, tp_group=group)
        h = torch.randn(m, n // tp, dtype=torch.float64, requires_grad=True)
        _dispatch.refresh()
        del asked[:]
        z, _ = row(h.view(m // 2, 2, n // tp))
        z.backward(torch.ones_like(z))
        assert row.last_gemms == {"fprop": ("gemm_rs", (m, n // tp, k)), "dgrad": ("ag_gemm", (m, k, n // tp))}
        assert asked == [("gemm_rs", (m, n // tp, k), None), ("ag_gemm", (m, k, n // tp), None),
                         ("gemm_rs", (m, n // tp, k), "reference"), ("ag_gemm", (m, k, n // tp), "reference")], asked
        off = ColumnParallelLinear(k, n, config=_config(tp, True), init_method=torch.nn.init.normal_, bias=False,
                                   tp_group=group)
        off(x)
        assert off.last_gemms == {"fprop": None, "dgrad": None}  # switched off: not decided by the dispatcher
    finally:
        _dispatch.choose = real


def _check_wgrad_input(rank, tp, group):
    """``last_paths['wgrad']`` says where the column wgrad's AG(x) comes from, and that is what runs: 'kept from
    fprop' saves the gathered input for backward and gathers nothing there; 'gathered again' saves the shard and
    gathers it once in backward."""
    import torch.distributed as dist

    from flux_layers.layers import ColumnParallelLinear, OverlapConfig
    gathers = []
    real = dist.all_gather_into_tensor

    def counted(out, inp, *args, **kwargs):
        gathers.append(tuple(out.shape))
        return real(out, inp, *args, **kwargs)
    dist.all_gather_into_tensor = counted
    try:
        for wgrad_input in ("keep", "regather"):
            col = ColumnParallelLinear(8, 4 * tp, config=_config(tp, True), init_method=torch.nn.init.normal_,
                                       bias=False, tp_group=group,
                                       overlap=OverlapConfig(backend="reference", wgrad_input=wgrad_input))
            x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
            y, _ = col(x)
            reason = col.last_paths["wgrad"].reason
            kept = "kept from fprop" in reason
            assert kept != ("gathered again" in reason), reason
            assert kept == (wgrad_input == "keep"), f"{wgrad_input}: {reason}"
            node = y.grad_fn.next_functions[0][0]  # the AllGatherLinear node under the output's view
            saved_x = node.saved_tensors[0]
            assert saved_x.shape[0] == (3 * 2 * tp if kept else 3 * 2), f"{reason}: saved {tuple(saved_x.shape)}"
            del gathers[:]
            y.backward(torch.ones_like(y))
            assert gathers == ([] if kept else [(3 * 2 * tp, 8)]), f"{reason}: all-gathers in backward {gathers}"
    finally:
        dist.all_gather_into_tensor = real


def _check_compile(rank, tp, group, seed):
    """A column + row pair traces into one graph under torch.compile (fullgraph; 'aot_eager' keeps it quick) and
    gives the eager values. With gradient-accumulation fusion the Python side effects on ``weight`` (as in
    megatron-core's own function) break the graph, so that case runs with fullgraph=False."""
    from flux_layers.layers import ColumnParallelLinear, OverlapConfig, RowParallelLinear
    # backend None: ops' 'auto' dispatch (reference on CPU) is decided outside the traced graph.
    for sp, wgrad_input, ga, backend in ((True, "regather", False, None), (True, "keep", False, "reference"),
                                         (False, "keep", False, "reference"), (True, "keep", True, "reference")):
        config = _config(tp, sp, ga=ga)
        overlap = OverlapConfig(backend=backend, wgrad_input=wgrad_input)
        col = ColumnParallelLinear(8, 4 * tp, config=config, init_method=torch.nn.init.normal_, tp_group=group,
                                   overlap=overlap)
        row = RowParallelLinear(4 * tp, 8, config=config, init_method=torch.nn.init.normal_, bias=True,
                                input_is_parallel=True, skip_bias_add=False, tp_group=group, overlap=overlap)

        def block(x):
            return row(torch.relu(col(x)[0]))[0]

        def step(fn):
            for p in (*col.parameters(), *row.parameters()):
                p.grad = None
            for p in (col.weight, row.weight):
                if ga:
                    p.main_grad, p.grad_added_to_main_grad = torch.zeros_like(p), False
            x = torch.randn(2 * tp, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            x = x.chunk(tp)[rank].clone().requires_grad_() if sp else x.requires_grad_()
            y = fn(x)
            y.backward(torch.ones_like(y))
            grads = [p.main_grad if ga else p.grad for p in (col.weight, row.weight)] + [col.bias.grad, row.bias.grad]
            return [t.detach().clone() for t in [y, x.grad] + grads]

        eager = step(block)
        compiled = step(torch.compile(block, backend="aot_eager", fullgraph=not ga))
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _worker(rank, tp, seed, checks):
    group = megatron_on_cpu(tp)
    if "cases" in checks:
        _check_cases(rank, tp, group, seed)
    if "init_checkpoint" in checks:
        _check_init_and_checkpoint(rank, tp, group)
    if "attributes" in checks:
        _check_param_attributes(rank, tp, group)
    if "errors" in checks:
        _check_errors(rank, tp, group)
    if "paths" in checks:
        _check_paths(rank, tp, group)
    if "compile" in checks:
        _check_compile(rank, tp, group, seed)
    if "gemm_keys" in checks:
        _check_gemm_keys(rank, tp, group)
    if "wgrad_input" in checks:
        _check_wgrad_input(rank, tp, group)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_linears(tp):
    """fp64 and megatron-core agreement for every case, the GEMMs' tuning keys and the wgrad input's report at TP 2
    and 4; at TP 2 also init, checkpoint, parameter attributes, errors, path reports and torch.compile (one process
    group per TP size keeps the CPU suite short)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    checks = (("cases", "init_checkpoint", "attributes", "errors", "paths", "compile", "gemm_keys", "wgrad_input")
              if tp == 2 else ("cases", "gemm_keys", "wgrad_input"))
    run_distributed(_worker, tp, seed, checks)
