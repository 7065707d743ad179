"""OverlapConfig: reading Megatron's switches, per-op backends, and errors naming the conflicting fields."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flux_layers.config import OverlapConfig


def test_defaults_are_on_and_follow_the_ops_backend():
    cfg = OverlapConfig()
    assert cfg.ag_enabled and cfg.rs_enabled and cfg.wgrad_input == "keep"
    assert cfg.backend_for("ag_gemm") is None and cfg.backend_for("gemm_rs") is None
    assert OverlapConfig(backend="reference").backend_for("ag_gemm") == "reference"


def test_switches_select_the_reference_path_per_op():
    cfg = OverlapConfig(tp_comm_overlap_rs=False, backend="auto")
    assert cfg.backend_for("ag_gemm") == "auto" and cfg.backend_for("gemm_rs") == "reference"
    off = OverlapConfig(tp_comm_overlap=False, backend="auto")
    assert off.backend_for("ag_gemm") == "reference" and off.backend_for("gemm_rs") == "reference"
    assert cfg.backend_for("gemm_rs_dgrad") == "reference"  # the RS switch covers the column dgrad too
    dgrad_off = OverlapConfig(tp_comm_overlap_rs_dgrad=False, backend="auto")
    assert dgrad_off.backend_for("gemm_rs") == "auto" and dgrad_off.backend_for("gemm_rs_dgrad") == "reference"
    with pytest.raises(ValueError, match="op must be 'ag_gemm', 'gemm_rs' or 'gemm_rs_dgrad'"):
        cfg.backend_for("gemm")


def test_from_megatron_reads_the_config_fields():
    from megatron.core import ModelParallelConfig
    assert not OverlapConfig.from_megatron(ModelParallelConfig()).ag_enabled  # Megatron's default: off
    cfg = OverlapConfig.from_megatron(ModelParallelConfig(tp_comm_overlap=True, tp_comm_overlap_ag=False))
    assert not cfg.ag_enabled and cfg.rs_enabled
    assert not cfg.rs_dgrad_enabled  # Megatron's tp_comm_overlap_rs_dgrad defaults to False
    assert OverlapConfig.from_megatron(ModelParallelConfig(tp_comm_overlap=True,
                                                           tp_comm_overlap_rs_dgrad=True)).rs_dgrad_enabled
    # Attributes a config lacks keep the defaults (on).
    assert OverlapConfig.from_megatron(SimpleNamespace()) == OverlapConfig()
    qkv = SimpleNamespace(tp_comm_overlap=True, tp_comm_overlap_disable_qkv=True)
    assert not OverlapConfig.from_megatron(qkv, tp_comm_buffer_name="qkv").ag_enabled
    assert OverlapConfig.from_megatron(qkv, tp_comm_buffer_name="proj").ag_enabled
    fc1 = SimpleNamespace(tp_comm_overlap_disable_fc1=True)
    assert not OverlapConfig.from_megatron(fc1, tp_comm_buffer_name="fc1").ag_enabled
    assert OverlapConfig.from_megatron(SimpleNamespace(), wgrad_input="regather").wgrad_input == "regather"


def test_bad_values_raise_naming_the_fields():
    with pytest.raises(ValueError, match=r"wgrad_input must be one of \('keep', 'regather'\), got 'later'"):
        OverlapConfig(wgrad_input="later")
    with pytest.raises(ValueError, match=r"backend must be None or one of .* got 'cuda'"):
        OverlapConfig(backend="cuda")
    with pytest.raises(ValueError, match=r"backend='fused' .* tp_comm_overlap_ag=False"):
        OverlapConfig(backend="fused", tp_comm_overlap_ag=False)
    with pytest.raises(ValueError, match=r"backend='fused' .* tp_comm_overlap=False, tp_comm_overlap_rs=False"):
        OverlapConfig.from_megatron(SimpleNamespace(tp_comm_overlap=False, tp_comm_overlap_rs=False),
                                    backend="fused")
