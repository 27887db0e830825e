// TurboQuant store: quantize K/V rows and scatter them into the paged cache.
//
// Produces the same bytes as vllm_hybrid/ops/turboquant/reference.py. The
// reductions whose result depends on summation order (key norm, Hadamard
// rotation) are done by the caller with the same torch ops; everything here
// (min/max, one division, round, pack, fp8/fp16 casts) is exact IEEE
// arithmetic. This file is compiled with -ffp-contract=off so no build flag
// can fuse a multiply-add inside the casts and change a rounding.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "turboquant_common.h"

namespace tq {
namespace {


void store_row(const float* key, float norm, const float* value,
               const float* mids, int64_t n_mids, const Layout& L,
               uint8_t* slot, int32_t* codes) {
  const int64_t D = L.head_dim;
  if (L.key_fp8) {
    for (int64_t d = 0; d < D; ++d) {
      const float k = std::min(std::max(key[d], -kFp8Max), kFp8Max);
      slot[d] = c10::Float8_e4m3fn(k).x;
    }
  } else {
    // Code = number of midpoints <= y (torch.searchsorted(right=True)).
    for (int64_t d = 0; d < D; ++d) {
      int32_t c = 0;
      for (int64_t m = 0; m < n_mids; ++m) c += key[d] >= mids[m];
      codes[d] = c;
    }
    pack_codes(codes, D, L.key_bits, slot, L.key_code_bytes());
    put_f16(slot + L.key_code_bytes(), norm);
  }
  float lo = value[0], hi = value[0];
  for (int64_t d = 1; d < D; ++d) {
    lo = std::min(lo, value[d]);
    hi = std::max(hi, value[d]);
  }
  const int32_t levels = (1 << L.value_bits) - 1;
  float scale = (hi - lo) / static_cast<float>(levels);
  scale = scale > kValueMinScale ? scale : kValueMinScale;
  for (int64_t d = 0; d < D; ++d) {
    const float t = (value[d] - lo) / scale + 0.5f;
    codes[d] = std::min(std::max(static_cast<int32_t>(t), 0), levels);
  }
  pack_codes(codes, D, L.value_bits, slot + L.key_bytes, L.value_code_bytes());
  put_f16(slot + L.scale_offset(), scale);
  put_f16(slot + L.scale_offset() + 2, lo);
  const int64_t used = L.scale_offset() + 4;
  std::memset(slot + used, 0, L.slot_bytes - used);
}

}  // namespace

void tq_store(const at::Tensor& key, const at::Tensor& norms,
              const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping, const at::Tensor& midpoints,
              int64_t key_bits, int64_t value_bits, bool key_fp8,
              int64_t key_bytes) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && key.is_contiguous());
  TORCH_CHECK(value.scalar_type() == at::kFloat && value.is_contiguous());
  const CacheStrides strides = cache_strides(kv_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong);
  const int64_t H = kv_cache.size(2);
  const int64_t N = slot_mapping.numel();
  const int64_t D = key.size(-1);
  TORCH_CHECK(key.numel() == N * H * D && value.numel() == N * H * D);
  const Layout L{D, key_bits, value_bits, key_fp8, false, key_bytes,
                 kv_cache.size(3)};
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t block_size = kv_cache.size(1);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const float* nrm = key_fp8 ? nullptr : norms.data_ptr<float>();
  at::Tensor mids_c = midpoints.contiguous();
  const float* mids = mids_c.data_ptr<float>();
  const int64_t n_mids = mids_c.numel();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot out of range");
  }
  at::parallel_for(0, N * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> codes(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tok = r / H, head = r % H;
      const int64_t blk = slots[tok] / block_size, off = slots[tok] % block_size;
      store_row(k + r * D, nrm ? nrm[r] : 0.0f, v + r * D, mids, n_mids, L,
                strides.slot(cache, blk, off, head), codes.data());
    }
  });
}

}  // namespace tq
