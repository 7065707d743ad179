// Prints the windows flux::sm90::subtile_window gives on coordinate tensors like the kernel's TMA tensors, beside the
// whole-sub-tile form the epilogue used before (tiles whose width is a multiple of 64), for
// tests/cpu/test_subtile_window.py. Host code only.
#include <cstdio>

#include "../../csrc/kernels/subtile_window.cuh"

using namespace cute;

// One line per (tile_m, tile_n, sub): "TM TN order tm tn sub r c r79 c79 old_r old_c" ((r, c): the window's origin,
// (r79, c79): its element (7, 9); old: local_tile at (tm, tn * TN / 64 + sub), or -1 -1 where TN % 64 != 0).
template <int TM, int TN, class Stride>
void dump(int order, Stride stride) {
  int const rows = 1000, n = 1040;
  auto m = make_coord_tensor(make_layout(make_shape(rows, n), stride));
  auto value = [&](auto c) {
    return order == 0 ? make_tuple(int(get<0>(c)), int(get<1>(c))) : make_tuple(int(get<1>(c)), int(get<0>(c)));
  };
  for (int tm = 0; tm < 3; ++tm)
    for (int tn = 0; tn < 3; ++tn)
      for (int sub = 0; sub < (TN + 63) / 64; ++sub) {
        auto w = flux::sm90::subtile_window<TM, TN, 64>(m, tm, tn, sub);
        static_assert(decltype(size<0>(w))::value == TM && decltype(size<1>(w))::value == 64, "window shape");
        auto o = value(w(0, 0)), e = value(w(7, 9));
        int old_r = -1, old_c = -1;
        if constexpr (TN % 64 == 0) {
          auto v = local_tile(m, Shape<Int<TM>, Int<64>>{}, make_coord(tm, tn * (TN / 64) + sub));
          auto ov = value(v(0, 0));
          old_r = get<0>(ov), old_c = get<1>(ov);
        }
        std::printf("%d %d %d %d %d %d %d %d %d %d %d %d\n", TM, TN, order, tm, tn, sub, get<0>(o), get<1>(o),
                    get<0>(e), get<1>(e), old_r, old_c);
      }
}

int main() {
  // The TMA tensor's coordinate basis in either order (the output's rows are mode 0 of the tensor either way).
  dump<128, 128>(0, make_stride(E<0>{}, E<1>{}));
  dump<128, 256>(0, make_stride(E<0>{}, E<1>{}));
  dump<256, 128>(0, make_stride(E<0>{}, E<1>{}));
  dump<128, 144>(0, make_stride(E<0>{}, E<1>{}));
  dump<128, 128>(1, make_stride(E<1>{}, E<0>{}));
  dump<128, 144>(1, make_stride(E<1>{}, E<0>{}));
  return 0;
}
