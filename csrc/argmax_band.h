// Which columns of a row can hold its maximum of scale * gelu(z), shared by the CPU forward
// (cpu/forward.cpp, best_column_of_row) and the CUDA epilogue's warp per row (cuda/epilogue.cu):
// both evaluate the GELU (an erf) only on a band of columns below the row's largest z where that
// provably gives the bits of evaluating every column and taking torch.max's rule (the first maximum
// wins ties, the first NaN beats everything), and every column otherwise.
//
// The band: z >= t, t = z_max (1 - d) rounded, d = kArgmaxBandWidth = 2^-10; z_max's column is in
// it, so the band's best value W is at least v(z_max) = scale * gelu(z_max) as computed. Take a
// column below the band (z < t): z < z_max (1 - d) (1 + u), u the unit roundoff. For z > 0,
// gelu(z) = z Phi(z) <= z Phi(z_max) < (1 - d + u) gelu(z_max), Phi increasing. Both
// implementations compute gelu(z) * scale as (0.5 z) (1 + erf(z / sqrt 2)) * scale, erf within 2
// ulp (glibc's, CUDA's erff; nvcc fuses none of these operations: the erf ends in its own rounded
// result) and no flush to zero, so gelu of a normal z > 0 has a relative error e of a few u (the
// erf's argument, erf itself, 1 + erf in [1, 2] and the products round once each; nothing
// cancels), and of a subnormal z an absolute error of a few subnormal ulps, far below d
// gelu(z_max) once z_max >= argmax_band_smallest. So the column's computed gelu is below z_max's
// by a relative gap of more than d - u - 2e. Multiplying by scale > 0 rounds monotonically, and
// when the products near W are normal numbers (checked: W finite and >= argmax_band_smallest; v(
// z_max) is within a few u of W) a gap that wide survives the rounding strictly: v(z) < v(z_max)
// <= W, so the column can neither beat nor tie the band's winner. Columns with z <= 0 give gelu
// <= 0 < W. So the band alone decides, when: scale is positive and finite, every z is finite (else
// the first non-finite column's NaN wins), z_max >= argmax_band_smallest (below it, 0.5 z of two
// neighbouring subnormals can be equal), and W is finite and >= argmax_band_smallest (scale *
// gelu overflowing to Inf or underflowing towards 0 makes columns outside the band tie with it).
// Otherwise, and for scale <= 0 (the maximum of a decreasing function of gelu), every column is
// evaluated.
#pragma once

#include <limits>

#if defined(__CUDACC__)
#define FPG_HOST_DEVICE __host__ __device__
#else
#define FPG_HOST_DEVICE
#endif

namespace fused_pool_gelu {

constexpr double kArgmaxBandWidth = 1.0 / 1024;

// sqrt of the smallest normal number: 2^-63 (float), 2^-511 (double), normal with room to spare.
template <typename T>
FPG_HOST_DEVICE constexpr T argmax_band_smallest() {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
  return sizeof(T) == 4 ? T(0x1p-63) : T(0x1p-511);
}

// The band's lower end for a row whose largest z is z_max: z_max (1 - d), rounded in T.
template <typename T>
FPG_HOST_DEVICE constexpr T argmax_band_threshold(T z_max) {
  return z_max * (T(1) - T(kArgmaxBandWidth));
}

// The band may decide the row: positive finite scale, every z finite, z_max not tiny.
template <typename T>
FPG_HOST_DEVICE constexpr bool argmax_band_applies(T scale, bool every_z_finite, T z_max) {
  return scale > T(0) && scale <= std::numeric_limits<T>::max() && every_z_finite &&
         z_max >= argmax_band_smallest<T>();
}

// The band did decide: its best value (scale * gelu) is finite and normal.
template <typename T>
FPG_HOST_DEVICE constexpr bool argmax_band_decided(T best_value) {
  return best_value <= std::numeric_limits<T>::max() && best_value >= argmax_band_smallest<T>();
}

}  // namespace fused_pool_gelu

#undef FPG_HOST_DEVICE
