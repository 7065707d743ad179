"""Backend choice, op-library loading and the errors a user sees on a machine without the fused path."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flux_layers
from flux_layers import _env, ops
from flux_layers.ops.backend import choose
from flux_layers.runtime import schedules, topology, tuning


def test_import_without_op_library():
    env = dict(os.environ, FLUX_LAYERS_OPS_LIB="/nonexistent/_C.so")
    code = ("import flux_layers, flux_layers._library as l; assert not flux_layers.fused_ops_available(); "
            "print(l.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "no such file" in out and "nvidia-cutlass" in out


def test_fused_backend_on_cpu_raises_and_auto_falls_back():
    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    with pytest.raises(flux_layers.FusedOpsUnavailable, match="fused backend requested"):
        ops.plan("gemm", x, w, backend="fused")
    choice = ops.plan("gemm", x, w)
    assert choice.path == "reference" and choice.reason
    torch.testing.assert_close(ops.gemm(x, w), x @ w.t())
    with pytest.raises(ValueError, match="backend"):
        choose("gemm", device=x.device, dtype=x.dtype, mkn=(4, 8, 6), group=None, backend="fastest")


def test_env_settings_are_validated(monkeypatch):
    monkeypatch.setenv("FLUX_LAYERS_AG_MODE", "sideways")
    with pytest.raises(ValueError, match="FLUX_LAYERS_AG_MODE"):
        _env.get("AG_MODE")
    monkeypatch.setenv("FLUX_LAYERS_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="not a number"):
        _env.get_float("TIMEOUT_S")
    assert _env.get("RS_TRANSPORT") == "auto"  # its values are checked against the transports (tuning)
    monkeypatch.setenv("FLUX_LAYERS_RS_TRANSPORT", "pigeon")
    with pytest.raises(ValueError, match="FLUX_LAYERS_RS_TRANSPORT must be 'auto', 'epilogue' or 'copy_engine'"):
        tuning.rs_transport(dtype=torch.bfloat16, tp=2, mkn=(256, 64, 64))
    monkeypatch.setenv("FLUX_LAYERS_RS_TRANSPORT", "direct")  # the epilogue transport's former name
    with pytest.raises(ValueError, match="FLUX_LAYERS_RS_TRANSPORT='direct': that transport is called 'epilogue'"):
        tuning.rs_transport(dtype=torch.bfloat16, tp=2, mkn=(256, 64, 64))


def test_gemm_rs_transport_arguments_are_validated_first():
    from flux_layers.ops import fused_gemm_rs
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="transport must be 'auto', 'epilogue' or 'copy_engine'"):
        fused_gemm_rs.gemm_rs(x, x, group=None, transport="pigeon")
    with pytest.raises(ValueError, match="transport='direct': that transport is called 'epilogue'"):
        fused_gemm_rs.gemm_rs(x, x, group=None, transport="direct")
    with pytest.raises(ValueError, match="chunk_cols must be >= 0"):
        fused_gemm_rs.gemm_rs(x, x, group=None, transport="copy_engine", chunk_cols=-1)


def test_topology_override(monkeypatch):
    assert topology.detect_order((0, 1)) == "mesh"
    monkeypatch.setenv("FLUX_LAYERS_AG_ORDER", "ring")
    assert topology.ag_order((0, 1)) == "ring"


def test_dispatch_table_lookup(monkeypatch, tmp_path):
    table = tmp_path / "t.json"
    table.write_text('{"gpu": "cpu", "entries": [{"op": "ag_gemm", "dtype": "bfloat16", "tp": 2, "m": 2048, '
                     '"k": 4096, "n": 4096, "path": "sequential", "source": "test"}]}')
    monkeypatch.setenv("FLUX_LAYERS_TUNING", str(table))
    tuning.reload()
    hit = tuning.dispatch_entry("ag_gemm", dtype=torch.bfloat16, tp=2, mkn=(2048, 4096, 4096))
    assert hit is not None and hit["path"] == "sequential"
    assert tuning.dispatch_entry("ag_gemm", dtype=torch.bfloat16, tp=2, mkn=(16384, 8192, 28672)) is None
    assert tuning.dispatch_entry("gemm_rs", dtype=torch.bfloat16, tp=2, mkn=(2048, 4096, 4096)) is None
    assert tuning.dispatch_entry("ag_gemm", dtype=torch.bfloat16, tp=2, mkn=(0, 4096, 4096)) is None  # M = 0
    tuning.reload()


def test_kernel_choice_defaults_overrides_and_errors(monkeypatch):
    def choose(**kw):
        return tuning.resolve_kernel("gemm_rs", dtype=torch.bfloat16, tp=2, mkn=(8192, 28672, 8192), **kw)
    monkeypatch.delenv("FLUX_LAYERS_STREAM_K", raising=False)
    default = choose()
    assert default == tuning.KernelChoice(1, 16, 75, 0) and tuning.kernel_name(default) == "128x256_swz16_sk"
    assert _env._DEFAULTS["STREAM_K_MAX_FILL"] == str(schedules.DEFAULT_STREAM_K_FILL)
    assert tuning.kernel_name(choose(stream_k=100)) == "128x256_swz16_sk100"
    monkeypatch.setenv("FLUX_LAYERS_STREAM_K_MAX_FILL", "90")
    assert choose().stream_k_fill == 90 and choose(stream_k=False).stream_k_fill == 0
    monkeypatch.setenv("FLUX_LAYERS_STREAM_K", "0")
    assert choose().stream_k is False and choose(stream_k=True).stream_k_fill == 90
    assert choose(stream_k=0).stream_k is False
    for bad in (101, -5):
        with pytest.raises(ValueError, match="fill limit"):
            choose(stream_k=bad)
    assert tuning.kernel_name(choose(tile=0, swizzle=8, sm_count=64)) == "256x128_swz8_dp"
    assert choose(sm_count=64).sm_count == 64
    with pytest.raises(ValueError, match="sm_count"):
        choose(sm_count=-2)


def test_cuda_graph_switches(monkeypatch):
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from flux_layers.layers.linear import cuda_graphs_requested
    from flux_layers.runtime import workspace
    monkeypatch.setattr(workspace, "_cuda_graphs", False)
    monkeypatch.delenv("FLUX_LAYERS_CUDA_GRAPHS", raising=False)
    assert not workspace.cuda_graphs_enabled()
    monkeypatch.setenv("FLUX_LAYERS_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="FLUX_LAYERS_CUDA_GRAPHS"):
        workspace.cuda_graphs_enabled()
    monkeypatch.setenv("FLUX_LAYERS_CUDA_GRAPHS", "1")
    assert workspace.cuda_graphs_enabled()
    monkeypatch.delenv("FLUX_LAYERS_CUDA_GRAPHS")
    workspace.enable_cuda_graphs()
    assert workspace.cuda_graphs_enabled()
    # The layers enable them when megatron's config asks for CUDA graphs.
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    assert cuda_graphs_requested(TransformerConfig(**base, cuda_graph_impl="local"))
    assert not cuda_graphs_requested(TransformerConfig(**base))
    assert cuda_graphs_requested(SimpleNamespace(enable_cuda_graph=True))
    assert not cuda_graphs_requested(SimpleNamespace())


def test_graph_twins_are_made_with_workspaces_and_used_under_capture(monkeypatch):
    """The bookkeeping of runtime/workspace.py's CUDA-graph twins, with stand-in workspaces (no GPU here)."""
    from types import SimpleNamespace

    from flux_layers.runtime import workspace as W
    monkeypatch.setattr(W, "_cache", {})
    monkeypatch.setattr(W, "_retired", [])
    monkeypatch.setattr(W, "_cuda_graphs", False)
    monkeypatch.delenv("FLUX_LAYERS_CUDA_GRAPHS", raising=False)
    made = []

    def make_twin(ws):
        ws.graph_twin = SimpleNamespace(graph_protocol=True)
        made.append(ws)
    monkeypatch.setattr(W, "_make_twin", make_twin)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    group = SimpleNamespace(group_name="tp")

    def make(max_m):
        return SimpleNamespace(max_m=max_m, graph_twin=None, graph_protocol=False, what="ag_gemm")

    ws = W._cached("ag", group, torch.bfloat16, 64, 128, make)
    assert ws.graph_twin is None and W.for_current_stream(ws) is ws
    capturing[0] = True
    with pytest.raises(RuntimeError, match="has no CUDA-graph twin"):
        W.for_current_stream(ws)
    with pytest.raises(RuntimeError, match="cannot be created while a CUDA graph is being captured"):
        W._cached("ag", group, torch.bfloat16, 64, 256, make)  # growing needs a collective
    with pytest.raises(RuntimeError, match="cannot be created while a CUDA graph is being captured"):
        W.prepare_cuda_graphs()
    capturing[0] = False
    W.prepare_cuda_graphs()
    assert made == [ws] and W.cuda_graphs_enabled()
    capturing[0] = True
    assert W.for_current_stream(ws) is ws.graph_twin
    assert W.for_current_stream(ws.graph_twin) is ws.graph_twin
    capturing[0] = False
    grown = W._cached("ag", group, torch.bfloat16, 64, 256, make)  # enabled now: comes with its twin
    assert grown is not ws and grown.max_m == 256 and made[-1] is grown and grown.graph_twin is not None


def test_graph_twin_has_its_workspace_shape(monkeypatch):
    """new_graph_twin builds a workspace of the same shape under the CUDA-graph protocol (constructors stubbed:
    symmetric memory needs GPUs)."""
    from flux_layers.runtime import workspace as W
    built = []

    def fake_init(self, group, dtype, max_m, inner, **kwargs):
        built.append((type(self).__name__, group, dtype, max_m, inner, kwargs))
        self._stage = None
    monkeypatch.setattr(W.AgWorkspace, "__init__", fake_init)
    monkeypatch.setattr(W.RsWorkspace, "__init__", fake_init)
    monkeypatch.setattr(W.RsWorkspace, "stage_buffer", lambda self: built.append("stage"))

    ag = object.__new__(W.AgWorkspace)
    ag.group, ag.dtype, ag.max_m, ag.k, ag.chunk_capacity = "tp", torch.bfloat16, 256, 64, 4
    ag.transport = "copy_engine"
    assert isinstance(ag.new_graph_twin(), W.AgWorkspace)
    assert built[-1] == ("AgWorkspace", "tp", torch.bfloat16, 256, 64, {"chunk_capacity": 4, "graph_protocol": True})
    ag.transport = "nccl"  # captured calls on the NCCL transport are refused: no twin
    assert ag.new_graph_twin() is None and len(built) == 1
    rs = object.__new__(W.RsWorkspace)
    rs.group, rs.dtype, rs.max_m, rs.n, rs.min_tile = "tp", torch.float16, 512, 96, 64
    rs.peer_mapped = True
    assert isinstance(rs.new_graph_twin(), W.RsWorkspace)
    assert built[-2:] == [("RsWorkspace", "tp", torch.float16, 512, 96, {"min_tile": 64, "graph_protocol": True}),
                          "stage"]
    rs.peer_mapped = False  # the reduce-scatter's NCCL transport refuses captured calls too: no twin
    assert rs.new_graph_twin() is None and len(built) == 3


def test_workspace_growth_is_geometric_aligned_capped_and_frees_the_outgrown(monkeypatch):
    """runtime/workspace.py's growth policy, with stand-in workspaces (symmetric memory needs GPUs)."""
    from types import SimpleNamespace

    from flux_layers.runtime import workspace as W
    assert W.grown_max_m(1000, 0, 2) == 1024  # first: the call's M, rounded to 128 rows per rank
    assert W.grown_max_m(1100, 1024, 2) == 1536  # outgrown: 1.5x, rounded
    assert W.grown_max_m(5000, 1024, 2) == 5120  # a jump past 1.5x: the call's M
    monkeypatch.setattr(W, "_cache", {})
    monkeypatch.setattr(W, "_retired", [])
    monkeypatch.setattr(W, "_cuda_graphs", False)
    monkeypatch.setattr(W, "_on_retire", [])
    monkeypatch.delenv("FLUX_LAYERS_CUDA_GRAPHS", raising=False)
    retired = []
    W.on_retire(retired.append)
    W.on_retire(retired.append)  # once per callback
    group = SimpleNamespace(group_name="tp")

    def make(max_m):
        return SimpleNamespace(max_m=max_m, graph_twin=None, graph_protocol=False, retired=False, what="ag_gemm")

    first = W._cached("ag", group, torch.bfloat16, 4096, 1000, make, tp=2)
    assert first.max_m == 1024 and W._cached("ag", group, torch.bfloat16, 4096, 512, make, tp=2) is first
    second = W._cached("ag", group, torch.bfloat16, 4096, 1100, make, tp=2)
    assert second.max_m == 1536 and first.retired and retired == [first]
    assert W._retired == [], "an outgrown workspace without a CUDA-graph twin is not kept"
    monkeypatch.setenv("FLUX_LAYERS_WORKSPACE_MAX_GIB", "0.01")
    with pytest.raises(RuntimeError, match="FLUX_LAYERS_WORKSPACE_MAX_GIB=0.01"):
        W._cached("ag", group, torch.bfloat16, 4096, 8192, make, tp=2)
    assert W._cache[W._Key("tp", "ag", torch.bfloat16, 4096)] is second, "a refused growth keeps the workspace"


def test_every_native_workspace_method_python_calls_is_registered():
    """flux_layers/runtime/workspace.py calls methods of the op library's Workspace class only on GPUs: each name and
    argument count it uses must be one the built library registers (a typo would only show on a GPU machine)."""
    import re

    from flux_layers import _library
    if not _library.load():
        pytest.skip("the op library is not built")
    schemas = {}
    for schema in torch._C._jit_get_custom_class_schemas():
        text = str(schema)
        if "flux_layers.NativeWorkspace _0" in text:
            name, args = text.split("(", 1)
            schemas[name] = args.split(")")[0].count(",")  # arguments besides the object itself
    from flux_layers.runtime import call_plan, workspace
    with open(workspace.__file__) as f:
        source = f.read()
    calls = set(re.findall(r"\.native\.(\w+)\(", source))
    calls |= {plan.native_method for plan in (call_plan.AgCallPlan, call_plan.RsCallPlan)}
    assert calls and calls <= set(schemas), f"not registered: {sorted(calls - set(schemas))}"
    assert schemas["keep_memory"] == 1 and schemas["add_ag_plan"] == 9 and schemas["add_rs_plan"] == 8, schemas
