"""The epilogue's sub-tile windows (csrc/kernels/subtile_window.cuh), built for the host with nvcc and CUTLASS's
headers: each sub-tile of a tile lies at the tile's origin plus 64 columns per sub-tile, also where a tile's width is
not a multiple of 64 (128 x 144), and for the other tiles the window is the one the whole-sub-tile form gave."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _cutlass_include() -> str | None:
    try:
        import cutlass_library
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return inc if os.path.isdir(os.path.join(inc, "cute")) else None


@pytest.fixture(scope="module")
def windows(tmp_path_factory) -> list[tuple[int, ...]]:
    nvcc, inc = shutil.which("nvcc"), _cutlass_include()
    if nvcc is None or inc is None:
        pytest.skip("needs nvcc and CUTLASS's headers (nvidia-cutlass) to build the window dump")
    exe = tmp_path_factory.mktemp("subtile_window") / "subtile_window_dump"
    subprocess.run([nvcc, "-std=c++17", "-I", inc, "-o", str(exe), os.path.join(HERE, "subtile_window_dump.cu")],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [tuple(int(v) for v in line.split()) for line in out.splitlines()]


def test_every_tile_shape_and_basis_order_is_dumped(windows):
    assert {(tm, tn, order) for tm, tn, order, *_ in windows} == {
        (128, 128, 0), (128, 256, 0), (256, 128, 0), (128, 144, 0), (128, 128, 1), (128, 144, 1)}
    assert len(windows) == 9 * (2 + 4 + 2 + 3 + 2 + 3)  # 3 x 3 tiles, each of its sub-tiles (144 columns: 3)


def test_windows_start_at_the_tile_origin_plus_whole_sub_tiles(windows):
    for tile_m, tile_n, _, tm, tn, sub, r, c, r79, c79, _, _ in windows:
        assert (r, c) == (tm * tile_m, tn * tile_n + sub * 64), (tile_m, tile_n, tm, tn, sub)
        assert (r79, c79) == (r + 7, c + 9)


def test_windows_of_64_column_multiples_are_the_former_whole_sub_tile_ones(windows):
    checked = 0
    for tile_m, tile_n, _, tm, tn, sub, r, c, _, _, old_r, old_c in windows:
        if tile_n % 64 == 0:
            assert (r, c) == (old_r, old_c), (tile_m, tile_n, tm, tn, sub)
            checked += 1
        else:
            assert (old_r, old_c) == (-1, -1)
    assert checked == 9 * (2 + 4 + 2 + 2)
