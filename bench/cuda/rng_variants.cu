// Launch-shape and code-shape experiments for the Philox fill kernels (not shipped).
// nvcc -O3 -arch=sm_90 -std=c++17 rng_variants.cu -o rng_variants && ./rng_variants
// Prints GB/s (bytes written, plus read for dropout) and the ratio to cudaMemset.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_bf16.h>
#include "../../crates/rng/kernels/rng.cu"


__device__ __forceinline__ uint4 philox_v(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { k.x += 0x9E3779B9u; k.y += 0xBB67AE85u; }
    uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}
__device__ __forceinline__ uint4 blk(u64 seed, u64 b) {
  return philox_v(make_uint4((uint32_t)b, (uint32_t)(b >> 32), 0, 0), make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}
__device__ __forceinline__ void st_cs(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// store only (ceiling of the launch shape)
__global__ void store_only(uint4* out, u64 nb) {
  for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (u64)gridDim.x * blockDim.x)
    out[b] = make_uint4((uint32_t)b, 1, 2, 3);
}
// current shipped shape: grid-stride, 64-bit indices
__global__ void gs64(uint4* out, u64 nb, u64 seed, u64 first) {
  for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (u64)gridDim.x * blockDim.x)
    out[b] = blk(seed, first + b);
}
__global__ void gs64_cs(uint4* out, u64 nb, u64 seed, u64 first) {
  for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (u64)gridDim.x * blockDim.x)
    st_cs(out + b, blk(seed, first + b));
}
// one block per thread, no loop
__global__ void flat(uint4* out, u64 nb, u64 seed, u64 first) {
  u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (b < nb) out[b] = blk(seed, first + b);
}
// ILP: U blocks per thread per iteration, strided by the grid
template <int U>
__global__ void ilp(uint4* out, u64 nb, u64 seed, u64 first) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (; b + (U - 1) * stride < nb; b += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = blk(seed, first + b + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) out[b + u * stride] = v[u];
  }
  for (; b < nb; b += stride) out[b] = blk(seed, first + b);
}
// uniform conversion
__device__ __forceinline__ uint4 unif(uint4 w) {
  const float s = 5.9604644775390625e-8f;
  return make_uint4(__float_as_uint((float)(w.x >> 8) * s), __float_as_uint((float)(w.y >> 8) * s),
                    __float_as_uint((float)(w.z >> 8) * s), __float_as_uint((float)(w.w >> 8) * s));
}
__global__ void unif_gs(uint4* out, u64 nb, u64 seed, u64 first) {
  for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (u64)gridDim.x * blockDim.x)
    out[b] = unif(blk(seed, first + b));
}
__global__ void unif_flat(uint4* out, u64 nb, u64 seed, u64 first) {
  u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (b < nb) out[b] = unif(blk(seed, first + b));
}
// dropout bf16, 8 elems per step (2 philox blocks)
__global__ void drop_bf16(const uint4* in, uint4* out, uint2* mask, u64 steps, u64 seed, u64 first, float p, float scale) {
  for (u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x; s < steps; s += (u64)gridDim.x * blockDim.x) {
    uint4 x = in[s];
    uint4 w0 = blk(seed, first + 2 * s), w1 = blk(seed, first + 2 * s + 1);
    uint32_t wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    __nv_bfloat16* xe = reinterpret_cast<__nv_bfloat16*>(&x);
    uint8_t m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      bool keep = (float)(wv[i] >> 8) * 5.9604644775390625e-8f >= p;
      m[i] = keep;
      xe[i] = keep ? __float2bfloat16_rn(__bfloat162float(xe[i]) * scale) : __float2bfloat16_rn(0.f);
    }
    out[s] = x;
    mask[s] = make_uint2(m[0] | m[1] << 8 | m[2] << 16 | (uint32_t)m[3] << 24, m[4] | m[5] << 8 | m[6] << 16 | (uint32_t)m[7] << 24);
  }
}
// dropout bf16, 2 steps per iteration, loads first
__global__ void drop_bf16_ilp(const uint4* in, uint4* out, uint2* mask, u64 steps, u64 seed, u64 first, float p, float scale) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x; s < steps; s += 2 * stride) {
    bool two = s + stride < steps;
    uint4 xs[2];
    xs[0] = in[s];
    if (two) xs[1] = in[s + stride];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && !two) break;
      u64 ss = s + u * stride;
      uint4 x = xs[u];
      uint4 w0 = blk(seed, first + 2 * ss), w1 = blk(seed, first + 2 * ss + 1);
      uint32_t wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      __nv_bfloat16* xe = reinterpret_cast<__nv_bfloat16*>(&x);
      uint8_t m[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        bool keep = (float)(wv[i] >> 8) * 5.9604644775390625e-8f >= p;
        m[i] = keep;
        xe[i] = keep ? __float2bfloat16_rn(__bfloat162float(xe[i]) * scale) : __float2bfloat16_rn(0.f);
      }
      out[ss] = x;
      mask[ss] = make_uint2(m[0] | m[1] << 8 | m[2] << 16 | (uint32_t)m[3] << 24, m[4] | m[5] << 8 | m[6] << 16 | (uint32_t)m[7] << 24);
    }
  }
}
__global__ void drop_bf16_flat(const uint4* in, uint4* out, uint2* mask, u64 steps, u64 seed, u64 first, float p, float scale) {
  u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= steps) return;
  uint4 x = in[s];
  uint4 w0 = blk(seed, first + 2 * s), w1 = blk(seed, first + 2 * s + 1);
  uint32_t wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  __nv_bfloat16* xe = reinterpret_cast<__nv_bfloat16*>(&x);
  uint8_t m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    bool keep = (float)(wv[i] >> 8) * 5.9604644775390625e-8f >= p;
    m[i] = keep;
    xe[i] = keep ? __float2bfloat16_rn(__bfloat162float(xe[i]) * scale) : __float2bfloat16_rn(0.f);
  }
  out[s] = x;
  mask[s] = make_uint2(m[0] | m[1] << 8 | m[2] << 16 | (uint32_t)m[3] << 24, m[4] | m[5] << 8 | m[6] << 16 | (uint32_t)m[7] << 24);
}
__global__ void copy_k(const uint4* in, uint4* out, u64 n) {
  for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < n; b += (u64)gridDim.x * blockDim.x) out[b] = in[b];
}

template <int U>
__global__ void copy_u(const uint4* __restrict__ in, uint4* __restrict__ out, u64 n) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (; b + (U - 1) * stride < n; b += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = in[b + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) out[b + u * stride] = v[u];
  }
  for (; b < n; b += stride) out[b] = in[b];
}
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 drop8(uint4 x, u64 s, u64 seed, u64 first, float p, float scale, uint2& mk) {
  uint4 w0 = blk(seed, first + 2 * s), w1 = blk(seed, first + 2 * s + 1);
  uint32_t wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  __nv_bfloat16* xe = reinterpret_cast<__nv_bfloat16*>(&x);
  uint8_t m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    bool keep = (float)(wv[i] >> 8) * 5.9604644775390625e-8f >= p;
    m[i] = keep;
    xe[i] = keep ? __float2bfloat16_rn(__bfloat162float(xe[i]) * scale) : __float2bfloat16_rn(0.f);
  }
  mk = make_uint2(m[0] | m[1] << 8 | m[2] << 16 | (uint32_t)m[3] << 24, m[4] | m[5] << 8 | m[6] << 16 | (uint32_t)m[7] << 24);
  return x;
}
template <int U, bool NC, bool CS>
__global__ void drop_u(const uint4* __restrict__ in, uint4* __restrict__ out, uint2* __restrict__ mask, u64 steps, u64 seed, u64 first, float p, float scale) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (; s + (U - 1) * stride < steps; s += U * stride) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = NC ? ld_nc(in + s + u * stride) : in[s + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint2 mk;
      uint4 y = drop8(x[u], s + u * stride, seed, first, p, scale, mk);
      if (CS) { st_cs(out + s + u * stride, y); __stcs(mask + s + u * stride, mk); }
      else { out[s + u * stride] = y; mask[s + u * stride] = mk; }
    }
  }
  for (; s < steps; s += stride) { uint2 mk; out[s] = drop8(in[s], s, seed, first, p, scale, mk); mask[s] = mk; }
}
template <int U>
__global__ void drop_flat_u(const uint4* __restrict__ in, uint4* __restrict__ out, uint2* __restrict__ mask, u64 steps, u64 seed, u64 first, float p, float scale) {
  const u64 s0 = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * U;
  if (s0 + U > steps) return;
  uint4 x[U];
#pragma unroll
  for (int u = 0; u < U; ++u) x[u] = in[s0 + u];
#pragma unroll
  for (int u = 0; u < U; ++u) { uint2 mk; out[s0 + u] = drop8(x[u], s0 + u, seed, first, p, scale, mk); mask[s0 + u] = mk; }
}
template <class F> float timeit_batch(F f, int iters = 20, int batch = 10) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < batch; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) { cudaEventRecord(a); for (int j = 0; j < batch; ++j) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / batch); }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
template <class F> float timeit(F f, int iters = 30) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms); }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  const size_t bytes = 256ull << 20; const u64 nb = bytes / 16;
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint4 *out, *in; uint2* mask;
  cudaMalloc(&out, bytes); cudaMalloc(&in, bytes); cudaMalloc(&mask, bytes / 2);
  cudaMemset(in, 0x3c, bytes);
  float base = timeit([&] { cudaMemsetAsync(out, 0x5a, bytes); });
  double fill = bytes / base / 1e6;
  printf("%-40s %8.4f ms %7.0f GB/s %6.3f\n", "memset", base, fill, 1.0);
  auto row = [&](const char* name, float ms, double by) { printf("%-40s %8.4f ms %7.0f GB/s %6.3f\n", name, ms, by / ms / 1e6, by / ms / 1e6 / fill); };
  row("copy kernel (r+w)", timeit([&] { copy_k<<<sms * 8, 256>>>(in, out, nb); }), 2.0 * bytes);
  for (int bpsm : {4, 8, 16, 32}) {
    char nm[64];
    snprintf(nm, 64, "store_only persistent %d/SM x256", bpsm); row(nm, timeit([&] { store_only<<<sms * bpsm, 256>>>(out, nb); }), bytes);
    snprintf(nm, 64, "gs64 %d/SM x256", bpsm); row(nm, timeit([&] { gs64<<<sms * bpsm, 256>>>(out, nb, 7, 0); }), bytes);
  }
  row("gs64_cs 8/SM", timeit([&] { gs64_cs<<<sms * 8, 256>>>(out, nb, 7, 0); }), bytes);
  row("flat x256", timeit([&] { flat<<<(nb + 255) / 256, 256>>>(out, nb, 7, 0); }), bytes);
  row("flat x128", timeit([&] { flat<<<(nb + 127) / 128, 128>>>(out, nb, 7, 0); }), bytes);
  row("flat x512", timeit([&] { flat<<<(nb + 511) / 512, 512>>>(out, nb, 7, 0); }), bytes);
  row("ilp2 8/SM", timeit([&] { ilp<2><<<sms * 8, 256>>>(out, nb, 7, 0); }), bytes);
  row("ilp4 8/SM", timeit([&] { ilp<4><<<sms * 8, 256>>>(out, nb, 7, 0); }), bytes);
  row("ilp2 4/SM", timeit([&] { ilp<2><<<sms * 4, 256>>>(out, nb, 7, 0); }), bytes);
  row("unif gs 8/SM", timeit([&] { unif_gs<<<sms * 8, 256>>>(out, nb, 7, 0); }), bytes);
  row("unif flat", timeit([&] { unif_flat<<<(nb + 255) / 256, 256>>>(out, nb, 7, 0); }), bytes);
  const u64 steps = nb;  // 8 bf16 per step
  double dby = 2.0 * bytes + bytes / 2;
  row("dropout bf16 gs 8/SM", timeit([&] { drop_bf16<<<sms * 8, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("dropout bf16 gs 16/SM", timeit([&] { drop_bf16<<<sms * 16, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("dropout bf16 ilp2 8/SM", timeit([&] { drop_bf16_ilp<<<sms * 8, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("dropout bf16 flat", timeit([&] { drop_bf16_flat<<<(steps + 255) / 256, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  printf("-- batched x10\n");
  row("memset", timeit_batch([&] { cudaMemsetAsync(out, 0x5a, bytes); }), bytes);
  row("gs64 32/SM", timeit_batch([&] { gs64<<<sms * 32, 256>>>(out, nb, 7, 0); }), bytes);
  row("shipped u32 32/SM", timeit_batch([&] { tessera_rng_u32<<<sms * 32, 256>>>((uint32_t*)out, nb * 4, 7, 0); }), bytes);
  row("shipped u32 flat", timeit_batch([&] { tessera_rng_u32<<<(nb + 255) / 256, 256>>>((uint32_t*)out, nb * 4, 7, 0); }), bytes);
  row("shipped uniform 32/SM", timeit_batch([&] { tessera_rng_uniform<<<sms * 32, 256>>>((uint32_t*)out, nb * 4, 7, 0); }), bytes);
  row("unif flat", timeit_batch([&] { unif_flat<<<(nb + 255) / 256, 256>>>(out, nb, 7, 0); }), bytes);
  row("shipped dropout bf16 32/SM", timeit_batch([&] { tessera_rng_dropout_bf16<<<sms * 32, 256>>>((const __nv_bfloat16*)in, (__nv_bfloat16*)out, (uint8_t*)mask, nb * 8, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("dropout bf16 flat", timeit_batch([&] { drop_bf16_flat<<<(steps + 255) / 256, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("copy kernel", timeit_batch([&] { copy_k<<<sms * 32, 256>>>(in, out, nb); }), 2.0 * bytes);
  row("copy_u2 32/SM", timeit_batch([&] { copy_u<2><<<sms * 32, 256>>>(in, out, nb); }), 2.0 * bytes);
  row("copy_u4 8/SM", timeit_batch([&] { copy_u<4><<<sms * 8, 256>>>(in, out, nb); }), 2.0 * bytes);
  row("copy_u4 16/SM", timeit_batch([&] { copy_u<4><<<sms * 16, 256>>>(in, out, nb); }), 2.0 * bytes);
  row("cudaMemcpy d2d", timeit_batch([&] { cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice); }), 2.0 * bytes);
  row("drop_u1 32/SM", timeit_batch([&] { drop_u<1, false, false><<<sms * 32, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u2 16/SM", timeit_batch([&] { drop_u<2, false, false><<<sms * 16, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u2 8/SM", timeit_batch([&] { drop_u<2, false, false><<<sms * 8, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u4 8/SM", timeit_batch([&] { drop_u<4, false, false><<<sms * 8, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u2 nc 16/SM", timeit_batch([&] { drop_u<2, true, false><<<sms * 16, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u2 nc cs 16/SM", timeit_batch([&] { drop_u<2, true, true><<<sms * 16, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u1 nc cs 32/SM", timeit_batch([&] { drop_u<1, true, true><<<sms * 32, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop_u4 nc cs 8/SM", timeit_batch([&] { drop_u<4, true, true><<<sms * 8, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  printf("-- random input\n");
  gs64<<<sms * 32, 256>>>(in, nb, 99, 0);
  row("drop flat (random in)", timeit_batch([&] { drop_bf16_flat<<<(steps + 255) / 256, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("shipped dropout flat (random in)", timeit_batch([&] { tessera_rng_dropout_bf16<<<(steps + 256) / 256, 256>>>((const __nv_bfloat16*)in, (__nv_bfloat16*)out, (uint8_t*)mask, nb * 8, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop flat u2 (random in)", timeit_batch([&] { drop_flat_u<2><<<(steps / 2 + 255) / 256, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop flat u2 x128 (random in)", timeit_batch([&] { drop_flat_u<2><<<(steps / 2 + 127) / 128, 128>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop flat u4 (random in)", timeit_batch([&] { drop_flat_u<4><<<(steps / 4 + 255) / 256, 256>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop flat x512 (random in)", timeit_batch([&] { drop_bf16_flat<<<(steps + 511) / 512, 512>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("drop flat x128 (random in)", timeit_batch([&] { drop_bf16_flat<<<(steps + 127) / 128, 128>>>(in, out, mask, steps, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  uint4* big; cudaMalloc(&big, 2 * bytes + bytes / 2);
  gs64<<<sms * 32, 256>>>(big, nb, 99, 0);
  row("shipped dropout flat (contiguous allocs)", timeit_batch([&] { tessera_rng_dropout_bf16<<<(steps + 256) / 256, 256>>>((const __nv_bfloat16*)big, (__nv_bfloat16*)(big + nb), (uint8_t*)(big + 2 * nb), nb * 8, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  row("shipped dropout flat (contiguous, +4KiB)", timeit_batch([&] { tessera_rng_dropout_bf16<<<(steps + 256) / 256, 256>>>((const __nv_bfloat16*)big, (__nv_bfloat16*)(big + nb - 256), (uint8_t*)(big + 2 * nb), nb * 8, 7, 0, 0.1f, 1.f / 0.9f); }), dby);
  cudaError_t e = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(e));
}
