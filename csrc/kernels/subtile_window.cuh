// Where an epilogue sub-tile of an output tile lies in the output: the window of a (TMA) coordinate tensor that its
// stores, and a ReduceScatter's partial loads, address. Host-compilable: tests/cpu/test_subtile_window.py checks it.
#pragma once

#include <cute/tensor.hpp>

namespace flux::sm90 {

// The kTileM x kSubCols window of m ([rows, n]) that sub-tile `sub` of tile (tile_m, tile_n) covers, for tiles of
// kTileM x kTileN. Its origin is placed in elements, not in whole sub-tiles, so that it holds for a tile whose width
// is not a multiple of kSubCols too (a 128 x 144 tile placed in whole sub-tiles stored at the wrong columns).
template <int kTileM, int kTileN, int kSubCols, class Tensor>
CUTE_HOST_DEVICE auto subtile_window(Tensor const& m, int tile_m, int tile_n, int sub) {
  using namespace cute;
  return local_tile(domain_offset(make_coord(tile_m * kTileM, tile_n * kTileN + sub * kSubCols), m),
                    Shape<Int<kTileM>, Int<kSubCols>>{}, make_coord(0, 0));
}

}  // namespace flux::sm90
