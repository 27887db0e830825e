// Native CPU kernels for the TurboQuant KV cache (store + paged attention).
//
// The byte layout and the arithmetic follow vllm_hybrid/ops/turboquant/
// reference.py, which is the oracle in tests; docs/turboquant.md has the
// specification notes. Store lives in turboquant_store.cpp.
//
// Attention runs one work item per (request, KV head) so every key and value
// is decoded once and reused by all query heads of the GQA group. Hot loops
// are compiled twice (x86-64-v3 with AVX2/FMA and baseline x86-64) and picked
// at load time through GCC target_clones, so the library runs on any x86-64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "turboquant_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TQ_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TQ_CLONES
#endif

namespace tq {
namespace {

// ---------------------------------------------------------------- attention

struct HeadTask {
  const float* q;     // [Q, Hq, D] float32 (rotated for MSE keys)
  float* out;         // [Q, Hq, D] float32
  const uint8_t* cache;
  const int32_t* blocks;  // this request's block table row
  const float* cents;     // centroids (MSE keys)
  CacheStrides strides;
  int64_t block_size, H, Hq, kv_head, q_len, seq_len;
  float scale;
};

// Key of one cached token decoded into kbuf; returns the factor that turns
// dot(q, kbuf) into q . k (norm and norm correction for MSE keys).
inline float decode_key(const uint8_t* slot, const Layout& L,
                           const float* cents, float* kbuf) {
  const int64_t D = L.head_dim;
  if (L.key_fp8) {
    const auto& lut = fp8_table();
    for (int64_t d = 0; d < D; ++d) kbuf[d] = lut[slot[d]];
    return 1.0f;
  }
  unpack_codes(slot, D, L.key_bits, kbuf);
  for (int64_t d = 0; d < D; ++d) kbuf[d] = cents[static_cast<int>(kbuf[d])];
  const float norm = get_f16(slot + L.key_code_bytes());
  if (!L.norm_correction) return norm;
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t d = 0; d < D; ++d) sq += kbuf[d] * kbuf[d];
  return norm / std::sqrt(sq + kNcEps);
}

TQ_CLONES void attend_rows(const HeadTask& t, const Layout& L, int64_t q_begin,
                           int64_t q_end, std::vector<float>& scores,
                           std::vector<float>& buf) {
  const int64_t D = L.head_dim;
  const int64_t G = t.Hq / t.H;
  const int64_t rows = (q_end - q_begin) * G;
  const int64_t ctx0 = t.seq_len - t.q_len;  // position of query 0
  const int64_t last = ctx0 + q_end;         // tokens visible to last query
  scores.assign(rows * last, 0.0f);
  buf.resize(D * (1 + rows));
  float* kv = buf.data();
  float* acc = buf.data() + D;
  std::vector<float> lo_sum(rows, 0.0f), row_max(rows, -INFINITY),
      row_sum(rows, 0.0f);
  auto slot_of = [&](int64_t pos) {
    return t.strides.slot(t.cache, t.blocks[pos / t.block_size],
                          pos % t.block_size, t.kv_head);
  };
  auto q_row = [&](int64_t r) {
    const int64_t qi = q_begin + r / G, h = t.kv_head * G + r % G;
    return t.q + (qi * t.Hq + h) * D;
  };
  // Pass 1: scores, running max.
  for (int64_t s = 0; s < last; ++s) {
    const float f = decode_key(slot_of(s), L, t.cents, kv) * t.scale;
    const int64_t first_q = std::max<int64_t>(s - ctx0, q_begin);
    for (int64_t r = (first_q - q_begin) * G; r < rows; ++r) {
      const float* q = q_row(r);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * kv[d];
      const float sc = dot * f;
      scores[r * last + s] = sc;
      row_max[r] = std::max(row_max[r], sc);
    }
  }
  // Softmax numerators in place.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = ctx0 + q_begin + r / G + 1;
    float* sr = scores.data() + r * last;
    float sum = 0.0f;
    for (int64_t s = 0; s < visible; ++s) {
      sr[s] = std::exp(sr[s] - row_max[r]);
      sum += sr[s];
    }
    row_sum[r] = sum;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  // Pass 2: values. v = code * scale + lo, so accumulate p*scale*code and
  // p*lo separately.
  for (int64_t s = 0; s < last; ++s) {
    const uint8_t* slot = slot_of(s);
    unpack_codes(slot + L.key_bytes, D, L.value_bits, kv);
    const float vscale = get_f16(slot + L.scale_offset());
    const float vlo = get_f16(slot + L.scale_offset() + 2);
    const int64_t first_q = std::max<int64_t>(s - ctx0, q_begin);
    for (int64_t r = (first_q - q_begin) * G; r < rows; ++r) {
      const float p = scores[r * last + s];
      const float w = p * vscale;
      float* a = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * kv[d];
      lo_sum[r] += p * vlo;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = q_begin + r / G, h = t.kv_head * G + r % G;
    float* o = t.out + (qi * t.Hq + h) * D;
    const float inv = 1.0f / row_sum[r];
    const float* a = acc + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = (a[d] + lo_sum[r]) * inv;
  }
}

at::Tensor tq_paged_attention(const at::Tensor& query,
                              const at::Tensor& kv_cache,
                              const at::Tensor& block_table,
                              const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale,
                              const at::Tensor& centroids, int64_t key_bits,
                              int64_t value_bits, bool key_fp8,
                              bool norm_correction, int64_t key_bytes) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.is_contiguous());
  const CacheStrides strides = cache_strides(kv_cache);
  TORCH_CHECK(block_table.scalar_type() == at::kInt);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt);
  const int64_t Hq = query.size(1), D = query.size(2);
  const int64_t H = kv_cache.size(2);
  TORCH_CHECK(Hq % H == 0, "query heads must be a multiple of KV heads");
  const Layout L{D, key_bits, value_bits, key_fp8, norm_correction, key_bytes,
                 kv_cache.size(3)};
  at::Tensor out = at::empty_like(query);
  at::Tensor bt = block_table.contiguous();
  at::Tensor cents = centroids.contiguous();
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1);
  TORCH_CHECK(bt.size(0) >= seq_lens.numel(), "block_table has too few rows");
  at::Tensor qsl_c = query_start_loc.contiguous();
  at::Tensor sl_c = seq_lens.contiguous();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  const int64_t B = seq_lens.numel();
  const int64_t max_blocks = bt.size(1);
  const int64_t block_size = kv_cache.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && qsl[b + 1] <= query.size(0), "bad query_start_loc");
    TORCH_CHECK(sl[b] >= q_len, "seq_len shorter than the query count");
    const int64_t used = (sl[b] + block_size - 1) / block_size;
    TORCH_CHECK(used <= max_blocks, "block_table too short for seq_len");
    // A bad block id would read outside the cache: refuse it.
    const int32_t* row = bt.data_ptr<int32_t>() + b * max_blocks;
    for (int64_t i = 0; i < used; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < kv_cache.size(0),
                  "block id out of range: ", row[i]);
    }
  }
  // Long prefills are cut into query chunks so the score buffer stays small
  // and work spreads over threads even for one request.
  constexpr int64_t kChunk = 32;
  std::vector<std::array<int64_t, 3>> items;  // (request, kv head, chunk)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < q_len; c += kChunk) items.push_back({b, h, c});
  }
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, buf;
    for (int64_t i = begin; i < end; ++i) {
      const auto [b, h, c] = items[i];
      const int64_t q_len = qsl[b + 1] - qsl[b];
      HeadTask t{q + qsl[b] * Hq * D,
                 o + qsl[b] * Hq * D,
                 kv_cache.data_ptr<uint8_t>(),
                 bt.data_ptr<int32_t>() + b * max_blocks,
                 key_fp8 ? nullptr : cents.data_ptr<float>(),
                 strides,
                 block_size,
                 H,
                 Hq,
                 h,
                 q_len,
                 sl[b],
                 static_cast<float>(scale)};
      attend_rows(t, L, c, std::min(c + kChunk, q_len), scores, buf);
    }
  });
  return out;
}

std::string build_info() {
  return std::string("torch=") + TORCH_VERSION;
}

}  // namespace
}  // namespace tq

TORCH_LIBRARY(vllm_hybrid_tq, m) {
  m.def(
      "store(Tensor key, Tensor norms, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor midpoints, int key_bits, int value_bits, "
      "bool key_fp8, int key_bytes) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor "
      "centroids, int key_bits, int value_bits, bool key_fp8, bool "
      "norm_correction, int key_bytes) -> Tensor");
  m.def("build_info() -> str", &tq::build_info);
}

TORCH_LIBRARY_IMPL(vllm_hybrid_tq, CPU, m) {
  m.impl("store", &tq::tq_store);
  m.impl("paged_attention", &tq::tq_paged_attention);
}
