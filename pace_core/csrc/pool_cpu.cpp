// The fused CPU decode step of a state pool (pace_core/pool_cpu.py builds and calls it; pace_core/pool.py's
// reference step is the definition of correct, and tests/test_pool_cpu.py holds this step to it).
//
// One call steps the rows `slots [B]` of one GDN layer's pool by one decode token each, in place, whatever each
// row's position in its schedule. Per row (phase A) it prepares the inputs (and, given the layer's A_log and
// dt_bias, q and k's l2norm and the gates from the raw projections) and reads the row's record count; per (row,
// value head) (phase B, torch's threads):
// - dP >= 2: Ŝᵀ k_t and Ŝᵀ q_t read from the codes where they lie in the pool (4-bit key-axis groups: codes minus
//   zero points summed in registers per group and scaled once), the row's buffered records, u_t and o_t, the record
//   written at the row's own position; the token that fills the buffer folds the records into the head's state in
//   a per-thread [K, V] scratch and requantises it.
// - dP = 1: the plain recurrence step, one block of columns at a time (column j of the new state needs only column
//   j of the old one): each block read once, stepped in the cache and stored (a dense float32 head in place).
// Nothing of the float32 state of the pool's slots is materialised beyond one head per thread. The arithmetic is
// pace_core's (recurrence.step_records / fold_records / gdn_recurrent, quant's rounding): the same formulas in
// another summation order; codes are rounded as quant rounds them (fp32 true division, round half to even, fp16
// scales rounded to nearest even), so they are equal wherever the value is not within float rounding of a rounding
// boundary.
//
// Non-finite inputs or a slot out of range are reported before anything is written. A (row, head) whose new
// state or record cannot be stored (non-finite, or an fp16 scale overflow) writes nothing of its own (a dense
// head: none of its blocks from the failing one on), and the first such one is reported with its unrounded state
// or record (pool_cpu.py then raises the reference's error from them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float EMPTY = 1.0f;                  // pace_core.buffer.EMPTY: the log decay of an empty record slot
constexpr float FP16_TINY = 6.103515625e-05f;  // 2^-14, quant.FP16_TINY
constexpr float FP16_MAX = 65504.0f;           // quant.FP16_MAX
constexpr float L2NORM_EPS = 1e-6f;            // recurrence.L2NORM_EPS
constexpr float ROUND_LIMIT = 4194304.0f;      // 2^22: below it rne() is exact
constexpr int BLOCK = 32;                      // columns kept in registers by the blocked loops
constexpr int NIB = 32;                        // bytes of 4-bit codes read at a time by the checkpoint's dots
// Work per thread at the least (at::parallel_for's grain): a parallel region's wake-up and join cost more than a
// few (row, head) steps, and a small batch runs on the calling thread.
constexpr int64_t GRAIN_ROWS = 64;   // rows (tokens) prepared
constexpr int64_t GRAIN_ITEMS = 16;  // (row, head) decode steps

// Failure kinds reported in info[0] (pace_core/pool_cpu.py names them).
constexpr int64_t FAIL_INPUT = 1;   // non-finite k, v or g
constexpr int64_t FAIL_SLOT = 2;    // a slot index outside the pool
constexpr int64_t FAIL_STATE = 3;   // a head's new state: non-finite, or an fp16 scale overflow
constexpr int64_t FAIL_RECORD = 4;  // a record's delta value: an fp16 scale overflow

// Round half to even of |y| < 2^22 (callers clamp): exact in float32 under the default rounding mode.
inline float rne(float y) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (y + magic) - magic;
}

inline float to_half(float x) { return static_cast<float>(c10::Half(x)); }
inline float to_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }

// quant.fp16_scale: ratio clamped into [2^-14, 65504] and rounded to fp16 where nonzero, else 0.
inline float fp16_scale(float ratio, bool nonzero) {
  return nonzero ? to_half(std::min(std::max(ratio, FP16_TINY), FP16_MAX)) : 0.0f;
}

// Codes are packed densely (quant.pack_codes): a row of n b-bit codes is one little-endian bit stream, code j in bits
// [j b, j b + b), padded with zero bits to a whole byte; 4 bits two per byte (low nibble first), 8 bits one per byte.
inline int packed_len(int bits, int n) { return (n * bits + 7) / 8; }

// Byte offset of column j0 in a packed row (j0 b a whole number of bytes: blocks start at multiples of 8 columns).
inline int packed_offset(int bits, int j0) { return j0 * bits / 8; }

inline int get_code(const uint8_t* row, int bits, int j) {
  if (bits == 8) return row[j];
  if (bits == 4) return (row[j >> 1] >> ((j & 1) * 4)) & 15;
  const int pos = j * bits, b = pos >> 3, sh = pos & 7;
  int v = row[b] >> sh;
  if (sh + bits > 8) v |= row[b + 1] << (8 - sh);
  return v & ((1 << bits) - 1);
}

inline void put_code(uint8_t* row, int bits, int j, int code) {
  if (bits == 8) {
    row[j] = static_cast<uint8_t>(code);
    return;
  }
  const int pos = j * bits, b = pos >> 3, sh = pos & 7, mask = (1 << bits) - 1;
  row[b] = static_cast<uint8_t>((row[b] & ~(mask << sh)) | ((code & mask) << sh));
  if (sh + bits > 8) {
    const int hi = 8 - sh;
    row[b + 1] = static_cast<uint8_t>((row[b + 1] & ~(mask >> hi)) | ((code & mask) >> hi));
  }
}

// Unpacked codes of one row of n codes as floats.
inline void unpack_row(const uint8_t* __restrict row, int bits, int n, float* __restrict out) {
  if (bits == 4) {
    const int pairs = n / 2;
    for (int j = 0; j < pairs; ++j) {
      const uint8_t byte = row[j];
      out[2 * j] = static_cast<float>(byte & 15);
      out[2 * j + 1] = static_cast<float>(byte >> 4);
    }
    if (n & 1) out[n - 1] = static_cast<float>(row[pairs] & 15);
  } else if (bits == 8) {
    for (int j = 0; j < n; ++j) out[j] = static_cast<float>(row[j]);
  } else {  // a bit stream read through a 64-bit window, refilled a byte at a time
    const uint32_t mask = (1u << bits) - 1;
    uint64_t window = 0;
    int have = 0, b = 0;
    for (int j = 0; j < n; ++j) {
      while (have < bits) {
        window |= static_cast<uint64_t>(row[b++]) << have;
        have += 8;
      }
      out[j] = static_cast<float>(static_cast<uint32_t>(window) & mask);
      window >>= bits;
      have -= bits;
    }
  }
}

// Codes [0, n) packed into row[0 .. packed_len(bits, n)) (every byte written; the last one's spare bits zero).
inline void pack_row(const int32_t* __restrict codes, int bits, int n, uint8_t* __restrict row) {
  if (bits == 4) {
    const int pairs = n / 2;
    for (int j = 0; j < pairs; ++j) row[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (n & 1) row[pairs] = static_cast<uint8_t>(codes[n - 1]);
  } else if (bits == 8) {
    for (int j = 0; j < n; ++j) row[j] = static_cast<uint8_t>(codes[j]);
  } else {
    uint64_t window = 0;
    int have = 0, b = 0;
    for (int j = 0; j < n; ++j) {
      window |= static_cast<uint64_t>(codes[j]) << have;
      have += bits;
      while (have >= 8) {
        row[b++] = static_cast<uint8_t>(window);
        window >>= 8;
        have -= 8;
      }
    }
    if (have) row[b] = static_cast<uint8_t>(window);
  }
}

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Whether x[0..n) holds no NaN or inf: an all-ones exponent in none (an integer OR, vectorised).
inline bool all_finite(const float* __restrict x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t e = 0; e < n; ++e) bad |= (bits_of(x[e]) & 0x7F800000u) == 0x7F800000u;
  return bad == 0;
}

// max |x| of finite x[0..n): the largest magnitude bit pattern (integer max, vectorised; finite non-negative floats
// order as their bits do).
inline float max_abs(const float* __restrict x, int n) {
  uint32_t m = 0;
  for (int j = 0; j < n; ++j) m = std::max(m, bits_of(x[j]) & 0x7FFFFFFFu);
  return float_of(m);
}

// x[0..n) rounded to bfloat16 (to nearest even, as c10::BFloat16; NaN kept NaN), vectorised.
inline void to_bf16_row(const float* __restrict x, c10::BFloat16* __restrict out, int64_t n) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t u = bits_of(x[j]);
    const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    o[j] = x[j] != x[j] ? static_cast<uint16_t>(0x7FC0u) : r;
  }
}

// Σ a[i] b[i] in 16 interleaved partial sums (vectorised), added at the end.
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float part[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0f;
  for (int l = 0; l < 16; ++l) sum += part[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Column block of bw columns of a state, rows at B + i * ld: ak[j] += Σ_i B[i][j] xk[i], and the largest magnitude's
// bits into mbits. BLOCK columns at a time in registers.
template <bool MAX = true>
inline void block_read(const float* __restrict B, int64_t ld, int K, int bw, const float* __restrict xk,
                       float* __restrict ak, uint32_t& mbits) {
  if (bw == BLOCK) {
    float acc[BLOCK] = {};
    uint32_t mb[BLOCK] = {};
    for (int i = 0; i < K; ++i) {
      const float* __restrict r = B + i * ld;
      const float a = xk[i];
      for (int j = 0; j < BLOCK; ++j) {
        acc[j] += r[j] * a;
        if (MAX) mb[j] = std::max(mb[j], bits_of(r[j]) & 0x7FFFFFFFu);
      }
    }
    for (int j = 0; j < BLOCK; ++j) {
      ak[j] += acc[j];
      mbits = std::max(mbits, mb[j]);
    }
    return;
  }
  for (int i = 0; i < K; ++i) {
    const float* __restrict r = B + i * ld;
    const float a = xk[i];
    for (int j = 0; j < bw; ++j) {
      ak[j] += r[j] * a;
      if (MAX) mbits = std::max(mbits, bits_of(r[j]) & 0x7FFFFFFFu);
    }
  }
}

// The block's step in place: B[i][j] = α B[i][j] + xk[i] u[j], and ob[j] += Σ_i B[i][j] xq[i] (the new values).
inline void block_update(float* __restrict B, int64_t ld, int K, int bw, float alpha, const float* __restrict xk,
                         const float* __restrict xq, const float* __restrict ub, float* __restrict ob) {
  if (bw == BLOCK) {
    float uu[BLOCK], oo[BLOCK] = {};
    for (int j = 0; j < BLOCK; ++j) uu[j] = ub[j];
    for (int i = 0; i < K; ++i) {
      float* __restrict r = B + i * ld;
      const float a = xk[i], b = xq[i];
      for (int j = 0; j < BLOCK; ++j) {
        const float n = alpha * r[j] + a * uu[j];
        r[j] = n;
        oo[j] += n * b;
      }
    }
    for (int j = 0; j < BLOCK; ++j) ob[j] += oo[j];
    return;
  }
  for (int i = 0; i < K; ++i) {
    float* __restrict r = B + i * ld;
    const float a = xk[i], b = xq[i];
    for (int j = 0; j < bw; ++j) {
      r[j] = alpha * r[j] + a * ub[j];
      ob[j] += r[j] * b;
    }
  }
}

// S (rows of stride ld, K rows, n columns) = e S + Σ_r ks[r][i] us[r][j] over `records` records (keys ks[r] of K, values
// us[r] of stride usld from the block's first column): recurrence.fold_records' writes, row by row with BLOCK columns
// held in registers over the records.
inline void fold_rows(float* S, int64_t ld, int K, int n, float e, const float* ks, const float* us, int records,
                      int64_t usld = -1) {
  if (usld < 0) usld = n;
  for (int i = 0; i < K; ++i) {
    float* __restrict Sr = S + i * ld;
    int j0 = 0;
    for (; j0 + BLOCK <= n; j0 += BLOCK) {
      float acc[BLOCK];
      for (int j = 0; j < BLOCK; ++j) acc[j] = Sr[j0 + j] * e;
      for (int r = 0; r < records; ++r) {
        const float a = ks[static_cast<int64_t>(r) * K + i];
        const float* __restrict ur = us + r * usld + j0;
        for (int j = 0; j < BLOCK; ++j) acc[j] += a * ur[j];
      }
      for (int j = 0; j < BLOCK; ++j) Sr[j0 + j] = acc[j];
    }
    for (int j = j0; j < n; ++j) {
      float acc = Sr[j] * e;
      for (int r = 0; r < records; ++r) acc += ks[static_cast<int64_t>(r) * K + i] * us[r * usld + j];
      Sr[j] = acc;
    }
  }
}

// A signed integer that orders as the finite float x does (its bits, the magnitude negated below zero).
inline int32_t ordered(float x) {
  const int32_t b = static_cast<int32_t>(bits_of(x));
  return b < 0 ? static_cast<int32_t>(0x80000000u) - b : b;
}

inline float from_ordered(int32_t o) {
  return float_of(static_cast<uint32_t>(o < 0 ? static_cast<int32_t>(0x80000000u) - o : o));
}

// min(min x, 0) and max(max x, 0) of finite x[0..n) (integer min / max, vectorised).
inline void range_with_zero(const float* __restrict x, int n, float& lo, float& hi) {
  int32_t a = 0, b = 0;
  for (int j = 0; j < n; ++j) {
    const int32_t o = ordered(x[j]);
    a = std::min(a, o);
    b = std::max(b, o);
  }
  lo = from_ordered(a);
  hi = from_ordered(b);
}

// A tensor's data as bytes with the stride of its first (slot) axis; the rest contiguous.
struct Slab {
  uint8_t* p = nullptr;
  int64_t slot = 0;  // bytes between slots
  uint8_t* at(int64_t s) const { return p + s * slot; }
};

Slab slab(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  return {static_cast<uint8_t*>(t.data_ptr()), t.stride(0) * static_cast<int64_t>(t.element_size())};
}

// A quantiser of one group layout: bits, symmetric, group size.
struct Quant {
  int bits = 0, sym = 1, group = 0;
  int qmax() const { return (1 << (bits - 1)) - 1; }
  int levels() const { return (1 << bits) - 1; }
};

// One group's scale (and zero point) from its contiguous values x[0..n), as quant._quantize_codes: false on an
// fp16 overflow or a non-finite value (nothing written then).
inline bool group_scale(const Quant& q, const float* x, int n, float& scale, float& zero) {
  if (!all_finite(x, n)) return false;
  if (q.sym) {
    const float amax = max_abs(x, n);
    const float ratio = amax / static_cast<float>(q.qmax());
    if (!(ratio <= FP16_MAX)) return false;
    scale = fp16_scale(ratio, amax > 0.0f);
    zero = static_cast<float>(q.qmax() + 1);
    return true;
  }
  float lo, hi;
  range_with_zero(x, n, lo, hi);
  const float ratio = (hi - lo) / static_cast<float>(q.levels());
  if (!(ratio <= FP16_MAX)) return false;
  scale = fp16_scale(ratio, hi > lo);
  const float safe = scale == 0.0f ? 1.0f : scale;
  zero = std::min(std::max(rne(-lo / safe), 0.0f), static_cast<float>(q.levels()));
  return true;
}

// Groups' scales (and zero points) from their ranges, as quant._quantize_codes: symmetric from hi[c] = max |x|,
// zero point from lo[c] = min(min x, 0) and hi[c] = max(max x, 0); false on an fp16 scale overflow.
inline bool finish_scales(const Quant& q, const float* lo, const float* hi, int n, float* sc, float* z) {
  bool ok = true;
  for (int c = 0; c < n; ++c) {
    if (q.sym) {
      const float ratio = hi[c] / static_cast<float>(q.qmax());
      ok &= ratio <= FP16_MAX;
      sc[c] = fp16_scale(ratio, hi[c] > 0.0f);
      z[c] = static_cast<float>(q.qmax() + 1);
    } else {
      const float ratio = (hi[c] - lo[c]) / static_cast<float>(q.levels());
      ok &= ratio <= FP16_MAX;
      sc[c] = fp16_scale(ratio, hi[c] > lo[c]);
      const float safe = sc[c] == 0.0f ? 1.0f : sc[c];
      z[c] = std::min(std::max(rne(-lo[c] / safe), 0.0f), static_cast<float>(q.levels()));
    }
  }
  return ok;
}

// Codes of x[0..n) under per-entry steps (a zero scale given as 1) and zero points (symmetric: the offset
// qmax + 1), as quant._quantize_codes rounds them: x / step (a true division), half to even, + z, clamped.
// Returns how many saturated (counted only when `count`).
inline int64_t codes_of(const Quant& q, const float* __restrict x, const float* __restrict step,
                        const float* __restrict z, int n, int32_t* __restrict codes, bool count) {
  const float lo = q.sym ? -static_cast<float>(q.qmax()) : 0.0f;
  const float hi = q.sym ? static_cast<float>(q.qmax()) : static_cast<float>(q.levels());
  const float add = q.sym ? 0.0f : 1.0f;  // the zero point enters before the clamp, the symmetric offset after
  int64_t saturated = 0;
  for (int j = 0; j < n; ++j) {
    const float y = std::min(std::max(x[j] / step[j], -ROUND_LIMIT), ROUND_LIMIT);
    const float r = rne(y) + add * z[j];
    if (count) saturated += (r < lo) | (r > hi);
    const float c = std::min(std::max(r, lo), hi) + (1.0f - add) * z[j];
    codes[j] = static_cast<int32_t>(c);
  }
  return saturated;
}

// The code of x under a group's scale and zero point (symmetric: the offset qmax + 1); counts a saturated value.
inline int code_of(const Quant& q, float x, float scale, float zero, int64_t& saturated) {
  const float step = scale == 0.0f ? 1.0f : scale;
  float y = x / step;
  y = std::min(std::max(y, -ROUND_LIMIT), ROUND_LIMIT);
  float r = rne(y);
  float lo, hi;
  if (q.sym) {
    lo = -static_cast<float>(q.qmax());
    hi = static_cast<float>(q.qmax());
  } else {
    r += zero;
    lo = 0.0f;
    hi = static_cast<float>(q.levels());
  }
  saturated += (r < lo) | (r > hi);
  r = std::min(std::max(r, lo), hi);
  return static_cast<int>(q.sym ? r + zero : r);
}

// ------------------------------------------------------------------------------------------------------------
// The decode buffer's vectors (keys per key head, delta values per value head): float32 / bfloat16 data, or
// integer codes in value-axis groups along the vector (buffer.BufferFormat.spec) with fp16 scales and zero points.

struct VecStore {
  int kind = -1;  // 0 float32, 1 bfloat16, 2 integer codes
  int n = 0, heads = 0, dP = 0;
  Quant q;
  int ngroups = 0, cbytes = 0, zbytes = 0;
  Slab data, scale, zero;

  int64_t vec_index(int r, int head) const { return static_cast<int64_t>(r) * heads + head; }

  // Record r of `head` in slot s, dequantised into out[n] (as buffer._VectorStore.read).
  void read(int64_t s, int r, int head, float* out) const {
    const int64_t v = vec_index(r, head);
    if (kind == 0) {
      std::memcpy(out, data.at(s) + v * n * 4, n * sizeof(float));
      return;
    }
    if (kind == 1) {
      const c10::BFloat16* p = reinterpret_cast<const c10::BFloat16*>(data.at(s)) + v * n;
      for (int j = 0; j < n; ++j) out[j] = static_cast<float>(p[j]);
      return;
    }
    const uint8_t* codes = data.at(s) + v * cbytes;
    const c10::Half* sc = reinterpret_cast<const c10::Half*>(scale.at(s)) + v * ngroups;
    const uint8_t* zp = q.sym ? nullptr : zero.at(s) + v * zbytes;
    unpack_row(codes, q.bits, n, out);
    for (int gi = 0; gi < ngroups; ++gi) {
      const float step = static_cast<float>(sc[gi]);
      const float z = q.sym ? static_cast<float>(q.qmax() + 1)
                            : static_cast<float>(get_code(zp, q.bits, gi));
      for (int j = gi * q.group; j < (gi + 1) * q.group; ++j) out[j] = (out[j] - z) * step;
    }
  }

  // x[n] as stored and read back (deq[n]), its stored form staged in `staged` (write() copies it into a
  // record); false on an fp16 scale overflow (buffer vectors are finite: the inputs were checked).
  struct Staged {
    std::vector<uint8_t> codes, zero;
    std::vector<c10::Half> scale;
    std::vector<float> data;
    std::vector<int32_t> unpacked;
    std::vector<float> step, zf;
  };

  bool round(const float* x, float* deq, Staged& st) const {
    if (kind == 0) {
      std::memcpy(deq, x, n * sizeof(float));
      st.data.assign(x, x + n);
      return true;
    }
    if (kind == 1) {
      st.data.resize(n);
      for (int j = 0; j < n; ++j) deq[j] = st.data[j] = to_bf16(x[j]);
      return true;
    }
    st.codes.assign(cbytes, 0);
    st.scale.resize(ngroups);
    st.zero.assign(zbytes, 0);
    st.unpacked.resize(n);
    st.step.resize(n);
    st.zf.resize(n);
    for (int gi = 0; gi < ngroups; ++gi) {
      float sc = 0.0f, z = 0.0f;
      if (!group_scale(q, x + gi * q.group, q.group, sc, z)) return false;
      st.scale[gi] = c10::Half(sc);
      if (!q.sym) {
        put_code(st.zero.data(), q.bits, gi, static_cast<int>(z));
      }
      std::fill(st.step.begin() + gi * q.group, st.step.begin() + (gi + 1) * q.group, sc == 0.0f ? 1.0f : sc);
      std::fill(st.zf.begin() + gi * q.group, st.zf.begin() + (gi + 1) * q.group, z);
    }
    int32_t* codes = st.unpacked.data();
    codes_of(q, x, st.step.data(), st.zf.data(), n, codes, false);
    for (int j = 0; j < n; ++j) deq[j] = (static_cast<float>(codes[j]) - st.zf[j]) * st.step[j];
    pack_row(codes, q.bits, n, st.codes.data());
    return true;
  }

  void write(int64_t s, int r, int head, const Staged& st) const {
    const int64_t v = vec_index(r, head);
    if (kind == 0) {
      std::memcpy(data.at(s) + v * n * 4, st.data.data(), n * sizeof(float));
    } else if (kind == 1) {
      to_bf16_row(st.data.data(), reinterpret_cast<c10::BFloat16*>(data.at(s)) + v * n, n);
    } else {
      std::memcpy(data.at(s) + v * cbytes, st.codes.data(), cbytes);
      std::memcpy(reinterpret_cast<c10::Half*>(scale.at(s)) + v * ngroups, st.scale.data(),
                  ngroups * sizeof(c10::Half));
      if (!q.sym) std::memcpy(zero.at(s) + v * zbytes, st.zero.data(), zbytes);
    }
  }
};

// Per-thread buffers of one (row, head) step.
struct Work {
  std::vector<float> S, blk, row, sc, z, ssc, sz, lo, hi, step, zc, acc, rec, t;
  std::vector<int32_t> codes;
  std::vector<uint8_t> staged;
  VecStore::Staged key, value;
};

// ------------------------------------------------------------------------------------------------------------
// The checkpoint of one head: dense float32 / bfloat16, or packed groups (quant.PackedTensor; per head width a
// part, pace_core.quant.MixedPackedState), with per-checkpoint scales or the layer's static scales. Stored by
// blocks of columns (stage_block, then commit): a packed head's codes and scales are staged whole and written
// only once every block could be stored; a dense head's blocks are written as they are checked.

struct Part {
  Quant q;
  Slab codes, scale, zero;         // per-checkpoint: codes, fp16 scales, zero points
  const float* sscale = nullptr;   // static: [hv_p, sK, sV] float32 (the layer's)
  const float* szero = nullptr;    // static zero points (float, integer-valued) or null
  int vb = 0, sK = 0, sV = 0, zb = 0;  // packed codes per row, scale dims, zero bytes per scale row
};

struct Ckpt {
  int kind = 0;  // 0 dense float32, 1 dense bfloat16, 2 packed, 3 packed with static scales
  int axis = 0;  // 0 key-axis groups, 1 value-axis groups
  int K = 0, V = 0;
  Slab dense;
  std::vector<Part> parts;
  std::vector<int> head_part, head_index;

  const Part& part(int h) const { return parts[head_part[h]]; }

  // Scales and zero points of scale row `sr`, scale columns [c0, c0 + n) of head h in slot s, as floats.
  void scales(int64_t s, int h, int sr, int c0, int n, float* sc, float* z) const {
    const Part& p = part(h);
    const int64_t at = (static_cast<int64_t>(head_index[h]) * p.sK + sr) * p.sV + c0;
    const float off = static_cast<float>(p.q.qmax() + 1);
    if (kind == 3) {
      std::memcpy(sc, p.sscale + at, n * sizeof(float));
      if (p.q.sym) {
        std::fill(z, z + n, off);
      } else {
        std::memcpy(z, p.szero + at, n * sizeof(float));
      }
      return;
    }
    const c10::Half* a = reinterpret_cast<const c10::Half*>(p.scale.at(s)) + at;
    for (int c = 0; c < n; ++c) sc[c] = static_cast<float>(a[c]);
    if (p.q.sym) {
      std::fill(z, z + n, off);
    } else {
      const uint8_t* zr = p.zero.at(s) + (static_cast<int64_t>(head_index[h]) * p.sK + sr) * p.zb;
      for (int c = 0; c < n; ++c) {
        z[c] = static_cast<float>(get_code(zr, p.q.bits, c0 + c));
      }
    }
  }

  const uint8_t* code_row(int64_t s, int h, int i) const {
    const Part& p = part(h);
    return p.codes.at(s) + (static_cast<int64_t>(head_index[h]) * K + i) * p.vb;
  }

  // Columns [j0, j0 + bw) of head h's dequantised checkpoint, all rows, into out[K][ld] (quant.dequantize).
  void load_block(int64_t s, int h, int j0, int bw, float* __restrict out, int ld, Work& w) const {
    const int64_t base = static_cast<int64_t>(h) * K * V;
    if (kind == 0) {
      const float* S = reinterpret_cast<const float*>(dense.at(s)) + base;
      for (int i = 0; i < K; ++i) std::memcpy(out + static_cast<int64_t>(i) * ld, S + static_cast<int64_t>(i) * V + j0, bw * sizeof(float));
      return;
    }
    if (kind == 1) {
      const c10::BFloat16* S = reinterpret_cast<const c10::BFloat16*>(dense.at(s)) + base;
      for (int i = 0; i < K; ++i) {
        for (int j = 0; j < bw; ++j) out[static_cast<int64_t>(i) * ld + j] = static_cast<float>(S[static_cast<int64_t>(i) * V + j0 + j]);
      }
      return;
    }
    const Part& p = part(h);
    const int g = p.q.group;
    w.sc.resize(V);
    w.z.resize(V);
    float* __restrict sc = w.sc.data();
    float* __restrict z = w.z.data();
    const int byte0 = packed_offset(p.q.bits, j0);
    for (int i = 0; i < K; ++i) {
      float* __restrict r = out + static_cast<int64_t>(i) * ld;
      unpack_row(code_row(s, h, i) + byte0, p.q.bits, bw, r);
      if (axis == 0) {
        if (i % g == 0) scales(s, h, i / g, j0, bw, sc, z);
        for (int j = 0; j < bw; ++j) r[j] = (r[j] - z[j]) * sc[j];
      } else {
        scales(s, h, i, j0 / g, bw / g, sc, z);
        for (int c = 0; c < bw / g; ++c) {
          const float a = sc[c], b = z[c];
          for (int j = c * g; j < (c + 1) * g; ++j) r[j] = (r[j] - b) * a;
        }
      }
    }
  }

  // The width of the column blocks a head is stored in: whole value-axis groups, at least BLOCK columns where V
  // allows (else the whole row).
  int block_width() const {
    if (kind >= 2 && axis == 1) {
      const int g = parts[0].q.group;
      const int bw = g >= BLOCK ? g : BLOCK;
      return V % bw == 0 && bw % g == 0 ? bw : V;
    }
    return V % BLOCK == 0 ? BLOCK : V;
  }

  // Ŝᵀ xk and Ŝᵀ xq of head h in slot s added into acc_k, acc_q [V]; with S, the dequantised checkpoint kept there
  // too (to be folded). Packed key-axis groups without S: each group's codes minus zero points summed against
  // xk and xq in registers, scaled once per group and column.
  void dots(int64_t s, int h, const float* __restrict xk, const float* __restrict xq, float* __restrict acc_k,
            float* __restrict acc_q, float* S, Work& w) const {
    if (S != nullptr) {
      load_block(s, h, 0, V, S, V, w);
    }
    if (S == nullptr && kind >= 2 && axis == 0) {
      const Part& p = part(h);
      const int g = p.q.group;
      w.t.resize(2 * V);
      w.row.resize(V);
      w.sc.resize(V);
      w.z.resize(V);
      float* __restrict tk = w.t.data();
      float* __restrict tq = tk + V;
      float* __restrict c = w.row.data();
      const float* __restrict sc = w.sc.data();
      const float* __restrict z = w.z.data();
      for (int r = 0; r < K / g; ++r) {
        scales(s, h, r, 0, V, w.sc.data(), w.z.data());
        std::fill(tk, tk + 2 * V, 0.0f);
        if (p.q.bits == 4 && V % (2 * NIB) == 0) {
          // NIB bytes (2 NIB columns) at a time: low nibbles are the even columns, high nibbles the odd ones, each
          // summed in its own registers and interleaved once per group
          for (int b0 = 0; b0 < V / 2; b0 += NIB) {
            float ke[NIB] = {}, ko[NIB] = {}, qe[NIB] = {}, qo[NIB] = {}, ze[NIB], zo[NIB];
            for (int j = 0; j < NIB; ++j) {
              ze[j] = z[2 * (b0 + j)];
              zo[j] = z[2 * (b0 + j) + 1];
            }
            for (int i = r * g; i < (r + 1) * g; ++i) {
              const uint8_t* __restrict row8 = code_row(s, h, i) + b0;
              const float a = xk[i], b = xq[i];
              for (int j = 0; j < NIB; ++j) {
                const float d0 = static_cast<float>(row8[j] & 15) - ze[j];
                const float d1 = static_cast<float>(row8[j] >> 4) - zo[j];
                ke[j] += d0 * a;
                ko[j] += d1 * a;
                qe[j] += d0 * b;
                qo[j] += d1 * b;
              }
            }
            for (int j = 0; j < NIB; ++j) {
              tk[2 * (b0 + j)] = ke[j];
              tk[2 * (b0 + j) + 1] = ko[j];
              tq[2 * (b0 + j)] = qe[j];
              tq[2 * (b0 + j) + 1] = qo[j];
            }
          }
        } else {
          for (int i = r * g; i < (r + 1) * g; ++i) {
            unpack_row(code_row(s, h, i), p.q.bits, V, c);
            const float a = xk[i], b = xq[i];
            for (int j = 0; j < V; ++j) {
              const float d = c[j] - z[j];
              tk[j] += d * a;
              tq[j] += d * b;
            }
          }
        }
        for (int j = 0; j < V; ++j) {
          acc_k[j] += sc[j] * tk[j];
          acc_q[j] += sc[j] * tq[j];
        }
      }
      return;
    }
    const int bw = block_width();
    w.blk.resize(static_cast<size_t>(K) * bw);
    for (int j0 = 0; j0 < V; j0 += bw) {
      const float* B = S;
      int ld = V;
      if (S != nullptr) {
        B = S + j0;
      } else if (kind == 0) {
        B = reinterpret_cast<const float*>(dense.at(s)) + static_cast<int64_t>(h) * K * V + j0;
      } else {
        load_block(s, h, j0, bw, w.blk.data(), bw, w);
        B = w.blk.data();
        ld = bw;
      }
      for (int i = 0; i < K; ++i) {
        const float* __restrict r = B + static_cast<int64_t>(i) * ld;
        const float a = xk[i], b = xq[i];
        for (int j = 0; j < bw; ++j) {
          acc_k[j0 + j] += r[j] * a;
          acc_q[j0 + j] += r[j] * b;
        }
      }
    }
  }

  // Store columns [j0, j0 + bw) of the new state (Sb, rows of stride ld): a dense head's written at once, a packed
  // head's codes and scales staged (commit() writes them). False when a value is non-finite or an fp16 scale
  // overflows (nothing of the block written). Adds the values saturated under static scales to `saturated`.
  bool stage_block(int64_t s, int h, const float* Sb, int ld, int j0, int bw, Work& w, int64_t& saturated) const {
    for (int i = 0; i < K; ++i) {
      if (!all_finite(Sb + static_cast<int64_t>(i) * ld, bw)) return false;
    }
    const int64_t base = static_cast<int64_t>(h) * K * V;
    if (kind == 0) {
      float* S = reinterpret_cast<float*>(dense.at(s)) + base;
      for (int i = 0; i < K; ++i) std::memcpy(S + static_cast<int64_t>(i) * V + j0, Sb + static_cast<int64_t>(i) * ld, bw * sizeof(float));
      return true;
    }
    if (kind == 1) {
      c10::BFloat16* S = reinterpret_cast<c10::BFloat16*>(dense.at(s)) + base;
      for (int i = 0; i < K; ++i) to_bf16_row(Sb + static_cast<int64_t>(i) * ld, S + static_cast<int64_t>(i) * V + j0, bw);
      return true;
    }
    const Part& p = part(h);
    const int g = p.q.group, nsc = p.sK * p.sV;
    w.ssc.resize(nsc);
    w.sz.resize(nsc);
    w.staged.resize(static_cast<size_t>(K) * p.vb);
    float* sc = w.ssc.data();
    float* z = w.sz.data();
    // this block's scales: key axis [sK][j0 .. j0 + bw), value axis [K][j0/g .. (j0 + bw)/g)
    const int c0 = axis == 0 ? j0 : j0 / g, nc = axis == 0 ? bw : bw / g;
    if (kind == 3) {
      for (int r = 0; r < p.sK; ++r) scales(s, h, r, c0, nc, sc + r * p.sV + c0, z + r * p.sV + c0);
    } else if (axis == 0) {
      w.lo.resize(bw);
      w.hi.resize(bw);
      float* lo = w.lo.data();
      float* hi = w.hi.data();
      for (int r = 0; r < p.sK; ++r) {
        std::fill(lo, lo + bw, 0.0f);
        std::fill(hi, hi + bw, 0.0f);
        for (int i = r * g; i < (r + 1) * g; ++i) {
          const float* __restrict x = Sb + static_cast<int64_t>(i) * ld;
          if (p.q.sym) {
            for (int j = 0; j < bw; ++j) hi[j] = std::max(hi[j], std::fabs(x[j]));
          } else {
            for (int j = 0; j < bw; ++j) {
              lo[j] = std::min(lo[j], x[j]);
              hi[j] = std::max(hi[j], x[j]);
            }
          }
        }
        if (!finish_scales(p.q, lo, hi, bw, sc + r * p.sV + c0, z + r * p.sV + c0)) return false;
      }
    } else {
      float lo[1024], hi[1024];
      for (int i = 0; i < K; ++i) {
        const float* __restrict x = Sb + static_cast<int64_t>(i) * ld;
        for (int c = 0; c < nc; ++c) {
          if (p.q.sym) {
            lo[c] = 0.0f;
            hi[c] = max_abs(x + c * g, g);
          } else {
            range_with_zero(x + c * g, g, lo[c], hi[c]);
          }
        }
        if (!finish_scales(p.q, lo, hi, nc, sc + i * p.sV + c0, z + i * p.sV + c0)) return false;
      }
    }
    w.step.resize(bw);
    w.zc.resize(bw);
    w.codes.resize(bw);
    const int byte0 = packed_offset(p.q.bits, j0);
    for (int i = 0; i < K; ++i) {
      const float* rs = sc + (axis == 0 ? i / g : i) * p.sV + c0;
      const float* rz = z + (axis == 0 ? i / g : i) * p.sV + c0;
      if (axis == 1 || i % g == 0) {
        for (int j = 0; j < bw; ++j) {
          const int c = axis == 0 ? j : j / g;
          w.step[j] = rs[c] == 0.0f ? 1.0f : rs[c];
          w.zc[j] = rz[c];
        }
      }
      saturated += codes_of(p.q, Sb + static_cast<int64_t>(i) * ld, w.step.data(), w.zc.data(), bw, w.codes.data(),
                            kind == 3);
      pack_row(w.codes.data(), p.q.bits, bw, w.staged.data() + static_cast<int64_t>(i) * p.vb + byte0);
    }
    return true;
  }

  // The block stored and loaded again (a segment's end inside a prompt): rounded as the format stores it, in place,
  // nothing written to the pool; false when it cannot be stored.
  bool round_block(int64_t s, int h, float* Sb, int ld, int j0, int bw, Work& w, int64_t& saturated) const {
    if (kind <= 1) {
      for (int i = 0; i < K; ++i) {
        float* r = Sb + static_cast<int64_t>(i) * ld;
        if (!all_finite(r, bw)) return false;
        if (kind == 1) {
          for (int j = 0; j < bw; ++j) r[j] = to_bf16(r[j]);
        }
      }
      return true;
    }
    if (!stage_block(s, h, Sb, ld, j0, bw, w, saturated)) return false;
    const Part& p = part(h);
    const int g = p.q.group;
    const int byte0 = packed_offset(p.q.bits, j0);
    for (int i = 0; i < K; ++i) {
      float* __restrict r = Sb + static_cast<int64_t>(i) * ld;
      unpack_row(w.staged.data() + static_cast<int64_t>(i) * p.vb + byte0, p.q.bits, bw, r);
      const float* sc = w.ssc.data() + (axis == 0 ? i / g : i) * p.sV;
      const float* z = w.sz.data() + (axis == 0 ? i / g : i) * p.sV;
      for (int j = 0; j < bw; ++j) {
        const int c = axis == 0 ? j0 + j : (j0 + j) / g;
        r[j] = (r[j] - z[c]) * sc[c];
      }
    }
    return true;
  }

  // Write a packed head's staged codes, scales and zero points (nothing for a dense head: its blocks are written).
  void commit(int64_t s, int h, Work& w) const {
    if (kind <= 1) return;
    const Part& p = part(h);
    const int64_t hi = head_index[h];
    const int nsc = p.sK * p.sV;
    std::memcpy(p.codes.at(s) + hi * K * p.vb, w.staged.data(), static_cast<size_t>(K) * p.vb);
    if (kind == 3) return;
    c10::Half* out = reinterpret_cast<c10::Half*>(p.scale.at(s)) + hi * nsc;
    for (int e = 0; e < nsc; ++e) out[e] = c10::Half(w.ssc[e]);
    if (!p.q.sym) {
      uint8_t* zo = p.zero.at(s) + hi * p.sK * p.zb;
      for (int r = 0; r < p.sK; ++r) {
        uint8_t* zr = zo + static_cast<int64_t>(r) * p.zb;
        for (int c = 0; c < p.sV; ++c) {
          const int zc = static_cast<int>(w.sz[r * p.sV + c]);
          put_code(zr, p.q.bits, c, zc);
        }
      }
    }
  }

  // Store a whole head S[K][V] (head h, slot s): false (nothing written) when a value is non-finite or a scale
  // overflows.
  bool store(int64_t s, int h, const float* S, Work& w, int64_t& saturated) const {
    if (!all_finite(S, static_cast<int64_t>(K) * V)) return false;
    const int bw = block_width();
    int64_t sat = 0;
    if (kind >= 2) {  // staged whole: check every block before anything is written
      for (int j0 = 0; j0 < V; j0 += bw) {
        if (!stage_block(s, h, S + j0, V, j0, bw, w, sat)) return false;
      }
      commit(s, h, w);
    } else {
      for (int j0 = 0; j0 < V; j0 += bw) stage_block(s, h, S + j0, V, j0, bw, w, sat);
    }
    saturated += sat;
    return true;
  }
};

// The orthonormal Sylvester Hadamard transform of x[n] (n a power of two), in place: outliers.hadamard.
void hadamard(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += 2 * len) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

template <typename T>
inline void load(const void* p, int n, float* out) {
  const T* t = static_cast<const T*>(p);
  for (int j = 0; j < n; ++j) out[j] = static_cast<float>(t[j]);
}

void load_any(const at::Tensor& t, const uint8_t* p, int n, float* out) {
  switch (t.scalar_type()) {
    case at::kFloat: load<float>(p, n, out); break;
    case at::kBFloat16: load<c10::BFloat16>(p, n, out); break;
    case at::kHalf: load<c10::Half>(p, n, out); break;
    default: TORCH_CHECK(false, "pace_cpu: inputs must be float32, bfloat16 or float16");
  }
}

// One value of a [B, heads] (or [B, heads, n]) input tensor's row b, head h as a float.
struct In {
  const at::Tensor* t;
  const uint8_t* p;
  int64_t sb, sh;  // byte strides of the row and head axes
  const uint8_t* at(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

In input(const at::Tensor& t) {
  const int64_t es = t.element_size();
  return {&t, static_cast<const uint8_t*>(t.data_ptr()), t.stride(0) * es, t.dim() > 1 ? t.stride(1) * es : 0};
}

thread_local Work scratch;

// The pool of one layer as pace_core/pool_cpu.py describes it (FusedDecode: meta, state, consts).
constexpr int META_HEADS = 23;  // where the head map starts in meta

struct Layout {
  int H, HV, K, V, dP, gamma, period;
  bool rotate, carry;
  int64_t N;
  Ckpt ck;
  VecStore keys, values;
  Slab decays;

  Layout(at::IntArrayRef meta, at::TensorList state, at::TensorList consts) {
    H = meta[0];
    HV = meta[1];
    K = meta[2];
    V = meta[3];
    dP = meta[4];
    gamma = HV / H;
    rotate = meta[12] != 0;
    period = meta[21];
    carry = meta[22] != 0;
    N = meta[META_HEADS + 2 * HV];
    ck.kind = meta[5];
    ck.axis = meta[6];
    ck.K = K;
    ck.V = V;
    size_t ti = 0;
    if (ck.kind <= 1) {
      ck.dense = slab(state[ti++]);
    } else {
      for (int pi = 0; pi < meta[9]; ++pi) {
        Part p;
        p.q = {static_cast<int>(meta[10 + pi]), static_cast<int>(meta[8]), static_cast<int>(meta[7])};
        p.vb = packed_len(p.q.bits, V);
        p.sK = ck.axis == 0 ? K / p.q.group : K;
        p.sV = ck.axis == 0 ? V : V / p.q.group;
        p.zb = packed_len(p.q.bits, p.sV);
        p.codes = slab(state[ti++]);
        if (ck.kind == 2) {
          p.scale = slab(state[ti++]);
          p.zero = slab(state[ti++]);
        } else {
          p.sscale = consts[2 * pi].data_ptr<float>();
          p.szero = consts[2 * pi + 1].numel() ? consts[2 * pi + 1].data_ptr<float>() : nullptr;
        }
        ck.parts.push_back(p);
      }
    }
    ck.head_part.assign(meta.begin() + META_HEADS, meta.begin() + META_HEADS + HV);
    ck.head_index.assign(meta.begin() + META_HEADS + HV, meta.begin() + META_HEADS + 2 * HV);
    if (dP > 1) {
      VecStore* stores[2] = {&keys, &values};
      for (int part = 0; part < 2; ++part) {
        VecStore& st = *stores[part];
        st.kind = meta[13 + 4 * part];
        st.n = part == 0 ? K : V;
        st.heads = part == 0 ? H : HV;
        st.dP = dP;
        st.q = {static_cast<int>(meta[14 + 4 * part]), static_cast<int>(meta[16 + 4 * part]),
                static_cast<int>(meta[15 + 4 * part])};
        st.data = slab(state[ti]);
        st.scale = slab(state[ti + 1]);
        st.zero = slab(state[ti + 2]);
        ti += 3;
        if (st.kind == 2) {
          st.ngroups = st.n / st.q.group;
          st.cbytes = packed_len(st.q.bits, st.n);
          st.zbytes = st.q.sym ? 0 : packed_len(st.q.bits, st.ngroups);
        }
      }
      decays = slab(state[ti++]);
    }
  }

  // The records slot s holds (buffer.records_held: head 0's log decays <= 0).
  int count(int64_t s) const {
    if (dP == 1) return 0;
    const float* d = reinterpret_cast<const float*>(decays.at(s));
    int c = 0;
    for (int r = 0; r < dP; ++r) c += d[r * HV] <= 0.0f;
    return c;
  }

  void empty_buffer(int64_t s, int h) const {
    if (dP == 1) return;
    float* d = reinterpret_cast<float*>(decays.at(s));
    for (int r = 0; r < dP; ++r) d[r * HV + h] = EMPTY;
  }
};

// The prepared inputs of tokens (phase A): per token q, k [H][K] (prepared), v [HV][V], g, beta [HV], and with a
// key rotation q, k in the rotated basis.
struct Tokens {
  int H, HV, K, V;
  bool rotate;
  int64_t stride;
  std::vector<float> data;

  Tokens(const Layout& L, int64_t n) : H(L.H), HV(L.HV), K(L.K), V(L.V), rotate(L.rotate) {
    stride = 2 * H * K + (rotate ? 2 * H * K : 0) + HV * V + 2 * HV;
    data.resize(n * stride);
  }
  float* row(int64_t t) { return data.data() + t * stride; }
  const float* q(int64_t t, int kh) const { return data.data() + t * stride + kh * K; }
  const float* k(int64_t t, int kh) const { return q(t, kh) + H * K; }
  const float* v(int64_t t, int h) const { return data.data() + t * stride + 2 * H * K + h * V; }
  float g(int64_t t, int h) const { return data[t * stride + 2 * H * K + HV * V + h]; }
  float beta(int64_t t, int h) const { return data[t * stride + 2 * H * K + HV * V + HV + h]; }
  // q and k in the checkpoint's basis (rotated with a key rotation)
  const float* xq(int64_t t, int kh) const { return rotate ? data.data() + t * stride + 2 * H * K + HV * V + 2 * HV + kh * K : q(t, kh); }
  const float* xk(int64_t t, int kh) const { return rotate ? xq(t, kh) + H * K : k(t, kh); }

  // Token t from row t of the inputs (raw: recurrence.prepare_qk and recurrence.gdn_gates from the projections and
  // the layer's A_log, dt_bias); false when its k, v or g is not finite (pool.StatePool.decode's check).
  bool prepare(int64_t t, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& g_,
               const at::Tensor& b_, const float* alog, const float* dtb) {
    const In iq = input(q_), ik = input(k_), iv = input(v_), ig = input(g_), ib = input(b_);
    float* r = row(t);
    float *pq = r, *pk = r + H * K, *pv = r + 2 * H * K, *pg = pv + HV * V, *pb = pg + HV;
    const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
    for (int kh = 0; kh < H; ++kh) {
      load_any(q_, iq.at(t, kh), K, pq + kh * K);
      load_any(k_, ik.at(t, kh), K, pk + kh * K);
      if (alog != nullptr) {  // transformers' l2norm: x * rsqrt(sum(x^2) + eps), q scaled by K^-1/2
        for (float* x : {pq + kh * K, pk + kh * K}) {
          const float inv = 1.0f / std::sqrt(dot(x, x, K) + L2NORM_EPS);
          for (int i = 0; i < K; ++i) x[i] *= inv;
        }
        for (int i = 0; i < K; ++i) pq[kh * K + i] *= qscale;
      }
    }
    for (int h = 0; h < HV; ++h) load_any(v_, iv.at(t, h), V, pv + h * V);
    for (int h = 0; h < HV; ++h) {
      float gv, bv;
      load_any(g_, ig.at(t, h), 1, &gv);
      load_any(b_, ib.at(t, h), 1, &bv);
      if (alog != nullptr) {  // g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b) in b's dtype
        const float x = gv + dtb[h];
        const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
        gv = -std::exp(alog[h]) * sp;
        const float sg = 1.0f / (1.0f + std::exp(-bv));
        bv = b_.scalar_type() == at::kBFloat16 ? to_bf16(sg) : b_.scalar_type() == at::kHalf ? to_half(sg) : sg;
      }
      pg[h] = gv;
      pb[h] = bv;
    }
    if (rotate) {
      float* rq = pb + HV;
      std::memcpy(rq, pq, 2 * H * K * sizeof(float));  // q then k
      for (int x = 0; x < 2 * H; ++x) hadamard(rq + x * K, K);
    }
    return all_finite(pk, H * K) && all_finite(pv, HV * V + HV);
  }
};

std::vector<int64_t> indices(const at::Tensor& t) {
  std::vector<int64_t> out(t.numel());
  if (t.scalar_type() == at::kInt) {
    std::copy(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel(), out.begin());
  } else {
    std::copy(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel(), out.begin());
  }
  return out;
}

std::vector<float> params(const std::optional<at::Tensor>& t, int n) {
  std::vector<float> out;
  if (t.has_value()) {
    out.resize(n);
    load_any(*t, static_cast<const uint8_t*>(t->data_ptr()), n, out.data());
  }
  return out;
}

// Writes o [V] (floats) into out's row t, head h, in out's dtype.
inline void write_out(const at::Tensor& out, int64_t t, int h, const float* o, int j0, int n) {
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr()) + (t * out.stride(0) + h * out.stride(1)) * out.element_size();
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(reinterpret_cast<float*>(op) + j0, o, n * sizeof(float));
  } else {
    to_bf16_row(o, reinterpret_cast<c10::BFloat16*>(op) + j0, n);
  }
}

// The first failure of a step, reported once (info, fail: pace_core/pool_cpu.py's Failure).
struct Report {
  int64_t* info;
  float* fail;
  int64_t KV;
  std::atomic<bool> failed{false};
  void first(int64_t kind, int64_t row, int64_t head, int64_t count, const float* S, const float* u, int V) {
    bool expected = false;
    if (!failed.compare_exchange_strong(expected, true)) return;
    info[0] = kind;
    info[1] = row;
    info[2] = head;
    info[3] = count;
    if (S != nullptr) std::memcpy(fail, S, KV * sizeof(float));
    if (u != nullptr) std::memcpy(fail + KV, u, V * sizeof(float));
  }
};

void decode(const at::Tensor& slots, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
            const std::optional<at::Tensor>& dt_bias, const at::Tensor& out, at::TensorList state,
            at::TensorList consts, at::IntArrayRef meta, const at::Tensor& info, const at::Tensor& fail) {
  const Layout L(meta, state, consts);
  const Ckpt& ck = L.ck;
  const VecStore &keys = L.keys, &values = L.values;
  const int H = L.H, HV = L.HV, K = L.K, V = L.V, dP = L.dP, gamma = L.gamma;
  const bool rotate = L.rotate;
  const int64_t B = slots.size(0);
  const int64_t KV = static_cast<int64_t>(K) * V;
  int64_t* report = info.data_ptr<int64_t>();
  std::fill(report, report + 6, 0);
  Report rep{report, fail.data_ptr<float>(), KV};

  // Phase A, per row: the slot, its record count and its prepared inputs, checked before anything is written.
  const std::vector<int64_t> sl = indices(slots);
  const std::vector<float> alog = params(A_log, HV), dtb = params(dt_bias, HV);
  Tokens tok(L, B);
  std::vector<int> counts(B);
  std::atomic<int64_t> bad_input{-1}, bad_slot{-1};
  at::parallel_for(0, B, GRAIN_ROWS, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (sl[b] < 0 || sl[b] >= L.N) {
        bad_slot.store(b);
        continue;
      }
      if (!tok.prepare(b, q, k, v, g, beta, alog.empty() ? nullptr : alog.data(), dtb.data())) bad_input.store(b);
      counts[b] = L.count(sl[b]);
    }
  });
  if (bad_slot.load() >= 0 || bad_input.load() >= 0) {
    const bool slot_bad = bad_slot.load() >= 0;
    report[0] = slot_bad ? FAIL_SLOT : FAIL_INPUT;
    report[1] = slot_bad ? bad_slot.load() : bad_input.load();
    return;
  }

  // Phase B, per (row, value head).
  std::atomic<int64_t> saturated{0}, stored{0};
  at::parallel_for(0, B * HV, GRAIN_ITEMS, [&](int64_t i0, int64_t i1) {
    Work& w = scratch;
    w.acc.resize(4 * V);
    w.rec.resize(2 * K + 3 * V + dP * (K + V));
    int64_t sat = 0, heads_stored = 0;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / HV;
      const int h = static_cast<int>(item % HV), kh = h / gamma;
      const int64_t s = sl[b];
      const int c = counts[b];
      const float* qt = tok.q(b, kh);
      const float* kt = tok.k(b, kh);
      const float* vt = tok.v(b, h);
      const float gt = tok.g(b, h), bt = tok.beta(b, h);
      const float* xq = tok.xq(b, kh);
      const float* xk = tok.xk(b, kh);
      float* acc_k = w.acc.data();
      float* acc_q = acc_k + V;
      float* u = acc_q + V;
      float* o = u + V;
      std::fill(acc_k, acc_k + 2 * V, 0.0f);
      const bool flush = dP == 1 || c + 1 == dP;
      const float alpha = std::exp(gt);
      const float kq = dot(kt, qt, K);
      float* kdeq = w.rec.data();           // k̂_t as stored
      float* udeq = kdeq + K;               // û_t as stored
      float* kr = udeq + V;                 // a record's key (rotated for the fold)
      float* ur = kr + K;                   // a record's value
      float* gsum = ur + V;                 // the records' log decays
      bool ok = true;
      if (dP == 1) {
        // recurrence.gdn_recurrent: S = α Ŝ; u = β (v − Sᵀ k); S += k uᵀ; o = Sᵀ q. Column j of the new state needs
        // only column j of the old one, so each block of columns is read once, stepped in the cache and stored.
        const int bw = ck.block_width();
        w.blk.resize(static_cast<size_t>(K) * bw);
        float* Sb = w.blk.data();
        std::fill(o, o + V, 0.0f);
        int failed_at = -1;
        const float kmax = max_abs(xk, K);
        for (int j0 = 0; j0 < V; j0 += bw) {
          if (ck.kind == 0) {  // dense float32: stepped in place where the new values cannot overflow
            float* Bp = reinterpret_cast<float*>(ck.dense.at(s)) + static_cast<int64_t>(h) * KV + j0;
            uint32_t mbits = 0;
            block_read(Bp, V, K, bw, xk, acc_k + j0, mbits);
            for (int j = j0; j < j0 + bw; ++j) u[j] = bt * (vt[j] - alpha * acc_k[j]);
            // |α S + k u| <= α max|S| + max|k| max|u|: below float32's range with a margin, nothing can overflow
            if (alpha * float_of(mbits) + kmax * max_abs(u + j0, bw) <= 1e37f) {
              block_update(Bp, V, K, bw, alpha, xk, xq, u + j0, o + j0);
              continue;
            }
            std::fill(acc_k + j0, acc_k + j0 + bw, 0.0f);  // at the range's edge: the checked path below
          }
          ck.load_block(s, h, j0, bw, Sb, bw, w);
          uint32_t unused = 0;
          block_read<false>(Sb, bw, K, bw, xk, acc_k + j0, unused);
          for (int j = j0; j < j0 + bw; ++j) u[j] = bt * (vt[j] - alpha * acc_k[j]);
          block_update(Sb, bw, K, bw, alpha, xk, xq, u + j0, o + j0);
          if (!ck.stage_block(s, h, Sb, bw, j0, bw, w, sat)) {
            failed_at = j0;
            break;
          }
        }
        if (failed_at < 0) {
          ck.commit(s, h, w);
          heads_stored += 1;
        } else {  // the new state in the scratch, for the report (a dense head's earlier blocks are stored already)
          ok = false;
          w.S.resize(KV);
          for (int j0 = 0; j0 < V; j0 += bw) {
            float* Bp = w.S.data() + j0;
            ck.load_block(s, h, j0, bw, Bp, V, w);
            if (ck.kind >= 2 || j0 >= failed_at) {
              float read[1024] = {};
              for (int i = 0; i < K; ++i) {
                for (int j = 0; j < bw; ++j) read[j] += Bp[static_cast<int64_t>(i) * V + j] * xk[i];
              }
              for (int i = 0; i < K; ++i) {
                for (int j = 0; j < bw; ++j) {
                  Bp[static_cast<int64_t>(i) * V + j] =
                      alpha * Bp[static_cast<int64_t>(i) * V + j] + xk[i] * (bt * (vt[j0 + j] - alpha * read[j]));
                }
              }
            }
          }
          rep.first(FAIL_STATE, b, h, c, w.S.data(), nullptr, V);
        }
      } else {
        // recurrence.step_records: Ŝᵀ [k_t, q_t] (the checkpoint kept in the scratch when it is to be folded), the
        // records' part of S_{t−1}ᵀ [k_t, q_t], u_t, o_t (the exact current token).
        if (flush) w.S.resize(KV);
        ck.dots(s, h, xk, xq, acc_k, acc_q, flush ? w.S.data() : nullptr, w);
        float G = 0.0f;
        const float* d = reinterpret_cast<const float*>(L.decays.at(s));
        for (int r = 0; r < c; ++r) gsum[r] = d[r * HV + h];
        for (int r = 0; r < c; ++r) G += gsum[r];
        const float eG = std::exp(G);
        for (int j = 0; j < V; ++j) {
          acc_k[j] *= eG;
          acc_q[j] *= eG;
        }
        float after = 0.0f;  // Σ_{r<j<c} g_j, from the last record back
        for (int r = c - 1; r >= 0; --r) {
          keys.read(s, r, kh, kr);
          values.read(s, r, h, ur);
          const float dk = dot(kr, kt, K), dq = dot(kr, qt, K);
          const float wgt = std::exp(after);
          const float wk = wgt * dk, wq = wgt * dq;
          for (int j = 0; j < V; ++j) {
            acc_k[j] += wk * ur[j];
            acc_q[j] += wq * ur[j];
          }
          after += gsum[r];
        }
        for (int j = 0; j < V; ++j) u[j] = bt * (vt[j] - alpha * acc_k[j]);
        for (int j = 0; j < V; ++j) o[j] = alpha * acc_q[j] + kq * u[j];
        // The record (k_t, u_t, g_t) as the buffer stores it.
        if (!keys.round(kt, kdeq, w.key) || !values.round(u, udeq, w.value)) {
          ok = false;
          rep.first(FAIL_RECORD, b, h, c, nullptr, u, V);
        } else if (flush) {
          // recurrence.fold_records over the c + 1 records: S = e^{G'} Ŝ + Σ_r e^{G'−G_r} k̂_r û_rᵀ.
          float* S = w.S.data();
          const int n = c + 1;
          w.t.resize(static_cast<size_t>(n) * (K + V));
          float* ks = w.t.data();                        // the records' keys [n][K] (rotated with the checkpoint)
          float* us = ks + static_cast<int64_t>(n) * K;  // their delta values [n][V], weighted e^{G'−G_r}
          float after1 = 0.0f;  // Σ_{r<j<=c} g_j
          for (int r = c; r >= 0; --r) {
            float* kr_ = ks + static_cast<int64_t>(r) * K;
            float* ur_ = us + static_cast<int64_t>(r) * V;
            if (r == c) {
              std::memcpy(kr_, kdeq, K * sizeof(float));
              std::memcpy(ur_, udeq, V * sizeof(float));
            } else {
              keys.read(s, r, kh, kr_);
              values.read(s, r, h, ur_);
            }
            if (rotate) hadamard(kr_, K);
            const float wgt = std::exp(after1);
            for (int j = 0; j < V; ++j) ur_[j] *= wgt;
            after1 += r == c ? gt : gsum[r];
          }
          fold_rows(S, V, K, V, std::exp(G + gt), ks, us, n);
          ok = ck.store(s, h, S, w, sat);
          if (!ok) rep.first(FAIL_STATE, b, h, c, S, nullptr, V);
          heads_stored += ok;
        }
        if (ok) {  // the record at its row's position; a flushed row's buffer emptied (as the reference leaves it)
          if (h % gamma == 0) keys.write(s, c, kh, w.key);
          values.write(s, c, h, w.value);
          float* dd = reinterpret_cast<float*>(L.decays.at(s));
          if (flush) {
            L.empty_buffer(s, h);
          } else {
            dd[c * HV + h] = gt;
          }
        }
      }
      write_out(out, b, h, o, 0, V);
    }
    saturated.fetch_add(sat);
    stored.fetch_add(heads_stored);
  });
  report[4] = saturated.load();
  report[5] = stored.load();
}

// Prompts in slots `slots [n]`, their tokens rows starts[p] .. starts[p + 1] of the inputs, each from its slot's
// stored state (initial[p]) or from zero: pace_core.schedule.PeriodicState.prefill on every prompt and value head
// at once. The state runs token by token (the plain recurrence: the chunked form's function), one block of columns at
// a time over all of a segment's tokens while the block sits in the cache; each P-token segment's end stores it (the
// block rounded as its format stores and loads it, the last one staged and written). A prompt continued from a
// buffer holding records starts from the folded buffer, rounded first ("flush") or not ("carry"), and leaves the
// buffer empty.
void prefill(const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& initial, const at::Tensor& q,
             const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
             const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias, const at::Tensor& out,
             at::TensorList state, at::TensorList consts, at::IntArrayRef meta, const at::Tensor& info,
             const at::Tensor& fail) {
  const Layout L(meta, state, consts);
  const Ckpt& ck = L.ck;
  const int HV = L.HV, K = L.K, V = L.V, gamma = L.gamma;
  const int64_t KV = static_cast<int64_t>(K) * V;
  int64_t* report = info.data_ptr<int64_t>();
  std::fill(report, report + 6, 0);
  Report rep{report, fail.data_ptr<float>(), KV};
  const std::vector<int64_t> sl = indices(slots), st = indices(starts);
  const int64_t n = slots.size(0), T = st[n];
  const bool* init = initial.data_ptr<bool>();
  for (int64_t p = 0; p < n; ++p) {
    if (sl[p] < 0 || sl[p] >= L.N) {
      report[0] = FAIL_SLOT;
      report[1] = p;
      return;
    }
  }
  const std::vector<float> alog = params(A_log, HV), dtb = params(dt_bias, HV);
  Tokens tok(L, T);
  at::parallel_for(0, T, GRAIN_ROWS, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tok.prepare(t, q, k, v, g, beta, alog.empty() ? nullptr : alog.data(), dtb.data());
  });
  std::vector<int> counts(n);
  for (int64_t p = 0; p < n; ++p) counts[p] = init[p] ? L.count(sl[p]) : 0;

  std::atomic<int64_t> saturated{0}, stored{0};
  at::parallel_for(0, n * HV, 1, [&](int64_t i0, int64_t i1) {
    Work& w = scratch;
    int64_t sat = 0, heads_stored = 0;
    const int bw = ck.block_width();
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t p = item / HV;
      const int h = static_cast<int>(item % HV), kh = h / gamma;
      const int64_t s = sl[p], t0 = st[p], Tp = st[p + 1] - st[p];
      const int c = counts[p];
      // the buffered records (keys rotated with the checkpoint, values weighted e^{G−G_r}) and e^G
      w.t.resize(static_cast<size_t>(std::max(c, 1)) * (K + V));
      float* ks = w.t.data();
      float* us = ks + static_cast<int64_t>(std::max(c, 1)) * K;
      float G = 0.0f;
      if (c > 0) {
        const float* d = reinterpret_cast<const float*>(L.decays.at(s));
        float after = 0.0f;
        for (int r = c - 1; r >= 0; --r) {
          L.keys.read(s, r, kh, ks + static_cast<int64_t>(r) * K);
          L.values.read(s, r, h, us + static_cast<int64_t>(r) * V);
          if (L.rotate) hadamard(ks + static_cast<int64_t>(r) * K, K);
          const float wgt = std::exp(after);
          for (int j = 0; j < V; ++j) us[static_cast<int64_t>(r) * V + j] *= wgt;
          after += d[r * HV + h];
        }
        G = after;
      }
      w.blk.resize(static_cast<size_t>(K) * bw);
      w.acc.resize(3 * static_cast<size_t>(bw));
      float* Sb = w.blk.data();
      float* read = w.acc.data();
      float* u = read + bw;
      float* o = u + bw;
      bool ok = true;
      for (int j0 = 0; j0 < V && ok; j0 += bw) {
        if (init[p]) {
          ck.load_block(s, h, j0, bw, Sb, bw, w);
        } else {
          std::fill(Sb, Sb + static_cast<int64_t>(K) * bw, 0.0f);
        }
        if (c > 0) {  // the folded buffer; "flush" stores it (one rounding) before the prompt
          fold_rows(Sb, bw, K, bw, std::exp(G), ks, us + j0, c, V);
          if (!L.carry && !ck.round_block(s, h, Sb, bw, j0, bw, w, sat)) ok = false;
        }
        for (int64_t a = 0; a < Tp && ok; a += L.period) {
          const int64_t e = std::min<int64_t>(Tp, a + L.period);
          for (int64_t t = t0 + a; t < t0 + e; ++t) {  // gdn_recurrent's token, on this block's columns
            const float* xk = tok.xk(t, kh);
            const float alpha = std::exp(tok.g(t, h)), bt = tok.beta(t, h);
            const float* vt = tok.v(t, h) + j0;
            std::fill(read, read + bw, 0.0f);
            uint32_t unused = 0;
            block_read<false>(Sb, bw, K, bw, xk, read, unused);
            for (int j = 0; j < bw; ++j) u[j] = bt * (vt[j] - alpha * read[j]);
            std::fill(o, o + bw, 0.0f);
            block_update(Sb, bw, K, bw, alpha, xk, tok.xq(t, kh), u, o);
            write_out(out, t, h, o, j0, bw);
          }
          if (e < Tp) {  // a segment's end inside the prompt: stored and loaded again
            ok = ck.round_block(s, h, Sb, bw, j0, bw, w, sat);
          } else {
            ok = ck.stage_block(s, h, Sb, bw, j0, bw, w, sat);
          }
        }
        if (!ok) {
          w.S.assign(KV, 0.0f);
          for (int i = 0; i < K; ++i) std::memcpy(w.S.data() + static_cast<int64_t>(i) * V + j0, Sb + static_cast<int64_t>(i) * bw, bw * sizeof(float));
          rep.first(FAIL_STATE, p, h, c, w.S.data(), nullptr, V);
        }
      }
      if (ok) {
        ck.commit(s, h, w);
        L.empty_buffer(s, h);
        heads_stored += 1 + (Tp - 1) / L.period + (c > 0 && !L.carry);
      }
    }
    saturated.fetch_add(sat);
    stored.fetch_add(heads_stored);
  });
  report[4] = saturated.load();
  report[5] = stored.load();
}

}  // namespace

TORCH_LIBRARY(pace_cpu, m) {
  m.def(
      "decode(Tensor slots, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!) out, Tensor(b!)[] state, Tensor[] consts, int[] meta, Tensor(c!) info, Tensor(d!) fail) -> ()");
  m.def(
      "prefill(Tensor slots, Tensor starts, Tensor initial, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor? A_log, Tensor? dt_bias, Tensor(a!) out, Tensor(b!)[] state, Tensor[] consts, int[] meta, "
      "Tensor(c!) info, Tensor(d!) fail) -> ()");
  m.impl("decode", c10::DispatchKey::CPU, &decode);
  m.impl("prefill", c10::DispatchKey::CPU, &prefill);
}
