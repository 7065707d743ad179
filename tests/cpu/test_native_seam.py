"""The seam between Python and the op library (csrc/bindings/ops.cpp): the call plans Python fills by name match the
native registration's arguments, the native workspace is made with the arguments it declares, every name Python
passes is one the library exports, the workspace sizes come from the library's layout, and no Python copy of a
layout or code comes back. Needs the built op library (it loads without a GPU) except for the last test."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re

import pytest
import torch

from flux_layers import _library

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
needs_library = pytest.mark.skipif(not _library.load(), reason="the op library is not built")


def _workspace_schemas() -> dict[str, list[str]]:
    """The native workspace's methods: name -> argument names (without the object)."""
    schemas = {}
    for schema in torch._C._jit_get_custom_class_schemas():
        if "flux_layers.NativeWorkspace _0" in str(schema):
            schemas[schema.name] = [a.name for a in schema.arguments][1:]
    return schemas


@needs_library
def test_call_plans_mirror_the_native_registration():
    from flux_layers.runtime.call_plan import AgCallPlan, RsCallPlan
    schemas = _workspace_schemas()
    for plan in (AgCallPlan, RsCallPlan):
        assert [f.name for f in dataclasses.fields(plan)] == schemas[plan.native_method], plan.__name__
    ag = AgCallPlan(tile=1, swizzle=16, stream_k_fill=75, sm_count=0, mode="external", order="mesh",
                    rows_per_chunk=128, shard_order=(1, 0))
    assert ag.native_fields()["shard_order"] == [1, 0]  # the native int[]
    assert set(ag.native_fields()) == set(schemas["add_ag_plan"])


@needs_library
def test_the_native_workspace_is_made_with_the_arguments_it_declares():
    from flux_layers.runtime import workspace
    with open(workspace.__file__) as f:
        tree = ast.parse(f.read())
    made = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
        "torch.classes.flux_layers.NativeWorkspace")]
    assert len(made) == 1 and not made[0].args, "made once, every argument by name"
    assert [kw.arg for kw in made[0].keywords] == _workspace_schemas()["__init__"]


@needs_library
def test_the_native_state_is_freed_by_a_method_not_by_the_destructor():
    """The state's free synchronizes with the device; a torch class's method runs with the GIL released, its
    destructor run from Python holds it (and would stall a Python thread the GPU waits on: the stand-in)."""
    from flux_layers.runtime import workspace
    assert _workspace_schemas()["close"] == []
    assert "weakref.finalize(self, self.native.close)" in inspect.getsource(workspace.Workspace.__init__)
    assert "ws.close()" in inspect.getsource(workspace.reset)


@needs_library
def test_an_external_call_ends_after_its_transfers():
    """The NCCL and hybrid transports end each call (its completion word; a two-level reduce-scatter's freed slots)
    through the native workspace, by the names it declares, once the transfer stream joined the compute stream: with
    one hardware queue, a stream write that waits for the GEMM and is enqueued before the transfers holds them."""
    from flux_layers.ops import _opcalls, fused_ag_gemm, fused_gemm_rs
    assert _workspace_schemas()["end_external_call"] == ["plan", "epoch"]
    assert "ws.native.end_external_call(plan=plan, epoch=epoch)" in inspect.getsource(_opcalls.end_external_call)
    for op in (fused_ag_gemm, fused_gemm_rs):
        source = inspect.getsource(op.run_nccl)
        assert source.count("_opcalls.end_external_call(ws, call.index, epoch)") == 1, op.__name__
        assert source.index("compute.wait_stream(stream)") < source.index("_opcalls.end_external_call("), op.__name__


@needs_library
def test_every_name_python_passes_is_exported():
    from flux_layers.ops import fused_ag_gemm
    from flux_layers.ops._checks import FUSED_DTYPES
    from flux_layers.runtime import tuning
    from flux_layers.runtime.workspace import dtype_name
    codes = _library.codes()
    assert set(fused_ag_gemm.DIRECTIONS) | {"external"} == set(codes["ag_mode"])
    assert set(fused_ag_gemm.ORDERS) == set(codes["ag_order"])
    assert set(tuning.RS_TRANSPORTS) | {"external", "hybrid"} == set(codes["rs_transport"])
    assert set(codes["workspace_kind"]) == {"ag_gemm", "gemm_rs"}
    assert {dtype_name(d) for d in FUSED_DTYPES} | {"float8_e4m3fn", "float8_e5m2"} == set(codes["dtype"])
    assert all(getattr(torch, name).is_floating_point for name in codes["dtype"]), "torch's names"
    assert len({codes["dtype"][name] for name in codes["dtype"]}) == len(codes["dtype"])


@needs_library
def test_workspace_sizes_come_from_the_library():
    ag = torch.ops.flux_layers.ag_workspace_layout(tp=4, max_m=1024, k=512, chunk_capacity=16, dtype="bfloat16")
    assert ag["data_bytes"] == 1024 * 512 * 2 and ag["capacity"] == 16
    assert ag["handshake_words"] == 4 and ag["handshake_begin"] + ag["handshake_words"] < ag["flag_words"]
    fp8 = torch.ops.flux_layers.ag_workspace_layout(tp=4, max_m=1024, k=512, chunk_capacity=16,
                                                    dtype="float8_e4m3fn")
    # FP8 rows: half the bytes, then the gathered scales (two halves of max_m floats, one per epoch parity) past a
    # 256-byte aligned offset.
    assert fp8["scale_offset"] * 2 == ag["data_bytes"] and ag["scale_offset"] == 0
    assert fp8["data_bytes"] == fp8["scale_offset"] + 2 * 1024 * 4 and fp8["flag_words"] == ag["flag_words"]
    rs = torch.ops.flux_layers.rs_workspace_layout(tp=4, max_m=1024, n=768, min_tile=128, dtype="float16")
    assert rs["slot_rows"] == 256 and rs["data_bytes"] == 4 * 256 * 768 * 2 and rs["stage_bytes"] == 3 * 256 * 768 * 2
    assert rs["capacity"] >= 2 * 6, "a flag per 128 x 128 tile of a slot"
    assert rs["handshake_words"] == 4 and rs["handshake_begin"] + rs["handshake_words"] < rs["flag_words"]
    for bad in (dict(tp=1), dict(max_m=1023), dict(dtype="float32")):
        with pytest.raises(ValueError):
            torch.ops.flux_layers.ag_workspace_layout(**{**dict(tp=4, max_m=1024, k=512, chunk_capacity=16,
                                                                 dtype="bfloat16"), **bad})


# What a Python copy of the op library's layouts or codes looked like: name tables of codes, a dtype -> code map,
# an error tag parsed back, flag indices computed from the capacities, positional call plans.
COPIES = {
    "a table of codes": re.compile(r"^\s*\w*(MODE|ORDER|EXTERNAL|KIND|TRANSPORT|DTYPE)\w*\s*=\s*"
                                   r"(\{\s*[\"']\w+[\"']\s*:\s*\d|\d)", re.M),
    "a dtype -> code map": re.compile(r"torch\.(bfloat16|float16|float8_\w+)\s*:\s*\d+\s*[,}]"),
    "an error tag": re.compile(r"\[flux_layers\.\w+\]|workspace_error\(|_ERROR_TAG"),
    "flag arithmetic": re.compile(r"[*+]\s*(self\.|ws\.)?(chunk_capacity|flags_per_source|capacity)\b"
                                  r"|(chunk_capacity|flags_per_source|capacity)\s*[*+]\s*\w|SIGNATURE_WORDS"),
    "a positional plan": re.compile(r"plan_index\(\(|\.add_plan\("),
}


def test_patterns_find_the_copies_they_name():
    samples = {"a table of codes": '_MODES = {"pull": 0, "push": 1}\n_EXTERNAL = 2',
               "a dtype -> code map": "_DTYPE_CODE = {torch.bfloat16: 0}",
               "an error tag": 'tag = "[flux_layers.WorkspaceError] "',
               "flag arithmetic": "write_flag(flags, g * capacity + c, epoch)",
               "a positional plan": "ws.plan_index((kc.tile, 0, 0, False, 0, ()))"}
    for name, pattern in COPIES.items():
        assert pattern.search(samples[name]), name
    assert len(COPIES["a table of codes"].findall(samples["a table of codes"])) == 2
    for innocent in ('ORDERS = ("mesh", "ring")', "FLOOR = {torch.bfloat16: 2.0**-10}", "chunks = ws.chunk_count"):
        assert not any(pattern.search(innocent) for pattern in COPIES.values()), innocent


def test_no_python_copy_of_a_native_layout_or_code_comes_back():
    """The Python tree (the package and the benchmarks) keeps no copy of what csrc/ owns: it reads the op library's
    exports (codes, ag/rs_workspace_layout, the workspace's flag_index) instead."""
    found = []
    for top in ("flux_layers", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                if os.path.relpath(path, ROOT) == os.path.join("flux_layers", "runtime", "schedules.py"):
                    text = text.replace("SIGNATURE_WORDS = 3", "")  # the compared mirror of gemm_params.h
                found += [f"{os.path.relpath(path, ROOT)}: {what}: {m.group(0)!r}"
                          for what, pattern in COPIES.items() for m in pattern.finditer(text)]
    assert not found, found
