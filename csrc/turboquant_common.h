// Shared pieces of the TurboQuant CPU kernels: slot layout and byte helpers.
// See vllm_hybrid/ops/turboquant/layout.py for the layout description.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>

namespace tq {

constexpr float kFp8Max = 448.0f;
constexpr float kValueMinScale = 1e-8f;
constexpr float kNcEps = 1e-16f;

struct Layout {
  int64_t head_dim;
  int64_t key_bits;
  int64_t value_bits;
  bool key_fp8;
  bool norm_correction;
  int64_t key_bytes;
  int64_t slot_bytes;

  int64_t key_code_bytes() const {
    return key_fp8 ? head_dim : (head_dim * key_bits + 7) / 8;
  }
  int64_t value_code_bytes() const { return (head_dim * value_bits + 7) / 8; }
  int64_t scale_offset() const { return key_bytes + value_code_bytes(); }
};

// ------------------------------------------------------------------ helpers

inline void put_f16(uint8_t* dst, float x) {
  const uint16_t bits = c10::Half(x).x;
  dst[0] = static_cast<uint8_t>(bits & 0xFF);
  dst[1] = static_cast<uint8_t>(bits >> 8);
}

inline float get_f16(const uint8_t* src) {
  c10::Half h;
  h.x = static_cast<uint16_t>(src[0] | (src[1] << 8));
  return static_cast<float>(h);
}

// Little-endian bit stream: code j occupies bits [j*bits, (j+1)*bits).
inline void pack_codes(const int32_t* codes, int64_t n, int64_t bits,
                       uint8_t* dst, int64_t nbytes) {
  std::memset(dst, 0, nbytes);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bit = static_cast<uint32_t>(j * bits);
    const uint32_t c = static_cast<uint32_t>(codes[j]);
    dst[bit >> 3] |= static_cast<uint8_t>(c << (bit & 7));
    if ((bit & 7) + bits > 8) {
      dst[(bit >> 3) + 1] |= static_cast<uint8_t>(c >> (8 - (bit & 7)));
    }
  }
}

// Decodes n codes of 3 or 4 bits into floats.
inline void unpack_codes(const uint8_t* src, int64_t n, int64_t bits,
                         float* out) {
  if (bits == 4) {
    for (int64_t i = 0; i < n / 2; ++i) {
      out[2 * i] = static_cast<float>(src[i] & 0xF);
      out[2 * i + 1] = static_cast<float>(src[i] >> 4);
    }
    return;
  }
  // 3 bits: 8 codes in every 3 bytes (head_dim % 8 == 0 is checked upstream).
  for (int64_t g = 0; g < n / 8; ++g) {
    const uint32_t w = src[3 * g] | (src[3 * g + 1] << 8) |
                       (static_cast<uint32_t>(src[3 * g + 2]) << 16);
    for (int k = 0; k < 8; ++k) {
      out[8 * g + k] = static_cast<float>((w >> (3 * k)) & 7);
    }
  }
}

inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      c10::Float8_e4m3fn f;
      f.x = static_cast<uint8_t>(i);
      t[i] = static_cast<float>(f);
    }
    return t;
  }();
  return table;
}

// Where the slots of a uint8 [blocks, block_size, H, slot] cache live, in
// bytes. vLLM picks one KV cache layout per engine, so the page may be
// token-major (LBNHC: [tokens, heads, slot]) or head-major (LBHNC:
// [heads, tokens, slot]) depending on which other backends share the engine;
// the kernels take both through these strides instead of assuming one order.
struct CacheStrides {
  int64_t block;  // may exceed one page (padded pages, pooled mode's layers)
  int64_t token;
  int64_t head;

  uint8_t* slot(uint8_t* base, int64_t blk, int64_t off, int64_t h) const {
    return base + blk * block + off * token + h * head;
  }
  const uint8_t* slot(const uint8_t* base, int64_t blk, int64_t off,
                      int64_t h) const {
    return base + blk * block + off * token + h * head;
  }
};

// A dimension of size 1 is never stepped over, so its stride is free.
inline bool stride_is(int64_t size, int64_t stride, int64_t want) {
  return size == 1 || stride == want;
}

// Validates the cache and returns its strides. Each page must be dense in
// one of the two orders (so slots neither overlap nor leave holes another
// layer could own) and pages must not overlap; the block stride is free.
inline CacheStrides cache_strides(const at::Tensor& c) {
  TORCH_CHECK(c.scalar_type() == at::kByte && c.dim() == 4,
              "kv_cache must be uint8 [blocks, block_size, H, slot]");
  const int64_t bs = c.size(1), H = c.size(2), slot = c.size(3);
  const int64_t tok = c.stride(1), head = c.stride(2);
  const bool token_major =
      stride_is(bs, tok, H * slot) && stride_is(H, head, slot);
  const bool head_major =
      stride_is(bs, tok, slot) && stride_is(H, head, bs * slot);
  TORCH_CHECK(c.stride(3) == 1 && (token_major || head_major),
              "kv_cache pages must be dense token-major or head-major, got "
              "strides ", c.strides());
  TORCH_CHECK(c.size(0) <= 1 || c.stride(0) >= bs * H * slot,
              "kv_cache blocks overlap: block stride ", c.stride(0),
              " < page ", bs * H * slot);
  return {c.stride(0), tok, head};
}

// Defined in turboquant_store.cpp (compiled without FMA contraction).
void tq_store(const at::Tensor& key, const at::Tensor& norms,
              const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping, const at::Tensor& midpoints,
              int64_t key_bits, int64_t value_bits, bool key_fp8,
              int64_t key_bytes);

}  // namespace tq
