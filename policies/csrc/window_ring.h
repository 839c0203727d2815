// Pyramid's window ring and its exact total (policies/pyramid.py::_shift_window): the
// fixed-point arithmetic of one slot, shared by the policy's op (state_cpu.cpp, which
// updates a step's rows after the forward) and the CPU decode kernel
// (kvpool/csrc/paged_decode_cpu.cpp, which updates each row as it writes its mass), so
// both leave the same bits.
//
// A query's mass m (>= 0) counts as round(m · 2^shift), an integer; a slot's total is
// the sum of its ring's integers in int64, kept as three float32 digits of 21 bits
// (exact in float32: the state is float32), low digit first, the top one keeping the
// sign. A column's old value leaves the total as the same integer it entered as, so the
// total is the window's whatever the history.
#pragma once

#include <cmath>
#include <cstdint>

namespace window_ring {

constexpr int kDigit = 21;
constexpr int64_t kDigitMask = (int64_t{1} << kDigit) - 1;

// round(x · up), halves to even (the torch form's torch.round of the double product).
inline int64_t fixed(float x, double up) { return std::llrint(static_cast<double>(x) * up); }

// The total whose digits are d0, d0 + t3, d0 + 2 t3.
inline int64_t load(const float* d0, int64_t t3) {
  return static_cast<int64_t>(d0[0]) + (static_cast<int64_t>(d0[t3]) << kDigit) +
         static_cast<int64_t>(d0[2 * t3]) * (int64_t{1} << (2 * kDigit));
}

inline void store(float* d0, int64_t t3, int64_t sum) {
  d0[0] = static_cast<float>(sum & kDigitMask);
  d0[t3] = static_cast<float>((sum >> kDigit) & kDigitMask);
  d0[2 * t3] = static_cast<float>(sum >> (2 * kDigit));
}

// One slot's step: its ring column `col` (one value) becomes m, its total follows.
inline void put(float* col, float* total, int64_t t3, float m, double up) {
  store(total, t3, load(total, t3) + fixed(m, up) - fixed(*col, up));
  *col = m;
}

}  // namespace window_ring
