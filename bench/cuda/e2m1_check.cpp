// Exhaustive check of the NVFP4 kernels' E2M1 encoding (kernels/nvfp4.cu: e2m1_biased,
// the least of three exact float32 roundings, and e2m1_negative) against the bit-level
// encoding the kernels used before, itself checked against the threshold count of
// spec/formats.md, on all 2^32 float32 inputs, on the CPU (IEEE float32 arithmetic and
// fmaf round to nearest even here as on the GPU; CUDA's fminf returns the non-NaN operand,
// emulated explicitly). Also the both kernel's fast-path encoder (e2m1_biased_fast: no
// saturation term, the minimum taken on the bits as unsigned integers) against the same
// reference's magnitude on every float with |y| < 7, the only inputs it is given. And the
// stochastic-rounding code (e2m1_sr_magnitude: bits 22 and up of t * 2^-126 rounded
// toward zero, at most 7) against its definition, code(min(floor(t / step(t)) * step(t),
// 6)), on every float t >= 0 (+Inf included; t cannot be NaN). And the whole
// stochastic-rounding encoder (its uniform from the byte's bits, 2 step(|x|) from the
// exponent bits, no NaN branch) against the definition's (division by the step, NaN
// branch) on every float x, each with a byte taken from a hash of x. Build and run:
//   g++ -O2 -frounding-math -fopenmp bench/cuda/e2m1_check.cpp -o e2m1 && ./e2m1
// Output of 2026-12-03 (the truncating form of the code, evening): "mismatches 0",
// "fast-path mismatches 0 of 2176843776", "stochastic-rounding mismatches 0 of
// 2139095041" and "stochastic-rounding encoder mismatches 0 of 4294967296".
#include <cfenv>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <algorithm>
static inline uint32_t B(float f){uint32_t u; std::memcpy(&u,&f,4); return u;}
static inline float F(uint32_t u){float f; std::memcpy(&f,&u,4); return f;}
static inline float cmin(float a, float b){ if (std::isnan(a)) return b; if (std::isnan(b)) return a; return a < b ? a : b; } // PTX min.f32 (no -0/+0 issue here: all operands >= 2^23)
static inline uint32_t old_e2m1(float x){
  const uint32_t xb=B(x), ab=xb&0x7FFFFFFFu;
  const uint32_t rb=ab+0x1FFFFFu+((ab>>22)&1u);
  const uint32_t big=std::min((rb>>22)-252u,7u);
  const uint32_t small=B(F(ab)+4194304.0f)-0x4A800000u;
  const uint32_t c= ab<0x3F800000u? small: big;
  const uint32_t s= ab<=0x7F800000u? ((xb>>28)&8u):0u;
  return s|c;
}
static inline uint32_t new_e2m1(float y){
  const float a = std::fabs(y);
  const float K0 = 8388608.0f;
  const float f0 = std::fmaf(a, 2.0f, K0);
  const float f1 = a + (K0 + 2.0f);
  const float f2 = std::fmaf(a, 0.5f, K0 + 4.0f);
  const float m = cmin(cmin(f0, f1), cmin(f2, K0 + 7.0f));
  const uint32_t code = B(m) - B(K0);
  const bool neg = (int32_t)B(y) <= (int32_t)0xFF800000u;
  return code | (neg ? 8u : 0u);
}
static inline uint32_t fast_magnitude(float y){
  const float a = std::fabs(y);
  const float K0 = 8388608.0f;
  const uint32_t f0 = B(std::fmaf(a, 2.0f, K0));
  const uint32_t f1 = B(a + (K0 + 2.0f));
  const uint32_t f2 = B(std::fmaf(a, 0.5f, K0 + 4.0f));
  return std::min(std::min(f0, f1), f2) - B(K0);
}
static inline float step(float v){ return v < 2.0f ? 0.5f : (v < 4.0f ? 1.0f : 2.0f); }
// The definition (spec/formats.md 2.4), after t = |x| + u * step(|x|).
static inline uint32_t sr_reference(float t){
  const float s = step(t);
  const float v = std::min(std::floor(t / s) * s, 6.0f);
  return old_e2m1(v) & 7u;
}
// The kernel's form (e2m1_sr_magnitude): t * 2^-126 rounded toward zero, bits 22 up,
// at most 7; the caller has set the rounding mode to toward zero (subnormal results
// kept: no flush to zero here, as on the GPU without -ftz).
static inline uint32_t sr_kernel(float t){
  volatile float p = t * 1.17549435082228751e-38f;
  return std::min(B(p) >> 22, 7u);
}
// The definition's encoder (x, byte r8; nvfp4.rs), in round to nearest.
static inline uint32_t sr_encoder_before(float x, uint32_t r8){
  if (std::isnan(x)) return 7u;
  const float a = std::fabs(x);
  const float t = a + (float)r8 * 0.00390625f * step(a);  // the product is exact
  const float s = step(t);
  const float v = std::min(std::floor(t / s) * s, 6.0f);
  return (std::signbit(x) ? 8u : 0u) | (old_e2m1(v) & 7u);
}
// The kernel's encoder: h = r8 / 512 from the bits, 2 step from the exponent (at least
// 1, unclamped above), t in round to nearest; the product in round toward zero
// (volatile keeps each side of fesetround).
static inline uint32_t sr_encoder_now(float x, uint32_t r8){
  const float h = F(0x46800000u | r8) - 16384.0f;
  const float step2 = F(std::max(B(x) & 0x7F800000u, 0x3F800000u));
  volatile float vt = std::fmaf(h, step2, std::fabs(x));
  std::fesetround(FE_TOWARDZERO);
  volatile float p = vt * 1.17549435082228751e-38f;
  std::fesetround(FE_TONEAREST);
  const uint32_t m = std::min(B(p) >> 22, 7u);
  const bool neg = (int32_t)B(x) <= (int32_t)0xFF800000u;
  return m | (neg ? 8u : 0u);
}
int main(){
  unsigned long long bad=0; uint32_t first=0;
  #pragma omp parallel for reduction(+:bad) schedule(static)
  for(long long i=0;i<(1LL<<32);++i){
    float x=F((uint32_t)i);
    if(old_e2m1(x)!=new_e2m1(x)){ bad++; if(!first) first=(uint32_t)i; }
  }
  printf("mismatches %llu (first %08x)\n", bad, first);
  unsigned long long fbad=0, fn=0;
  #pragma omp parallel for reduction(+:fbad,fn) schedule(static)
  for(long long i=0;i<(1LL<<32);++i){
    float y=F((uint32_t)i);
    if(!(std::fabs(y) < 7.0f)) continue;
    fn++;
    if(fast_magnitude(y)!=(old_e2m1(y)&7u)) fbad++;
  }
  printf("fast-path mismatches %llu of %llu\n", fbad, fn);
  unsigned long long sbad=0, sn=0; uint32_t sfirst=0;
  #pragma omp parallel reduction(+:sbad,sn)
  {
    #pragma omp for schedule(static)
    for(long long i=0;i<=0x7F800000LL;++i){
      const float t=F((uint32_t)i);
      const uint32_t want=sr_reference(t);
      std::fesetround(FE_TOWARDZERO);
      const uint32_t got=sr_kernel(t);
      std::fesetround(FE_TONEAREST);
      sn++;
      if(got!=want){ sbad++; if(!sfirst) sfirst=(uint32_t)i; }
    }
  }
  printf("stochastic-rounding mismatches %llu of %llu (first %08x)\n", sbad, sn, sfirst);
  unsigned long long ebad=0, en=0; uint32_t efirst=0;
  #pragma omp parallel for reduction(+:ebad,en) schedule(static)
  for(long long i=0;i<(1LL<<32);++i){
    const uint32_t xb=(uint32_t)i;
    const uint32_t r8=(xb*2654435761u)>>24;
    const float x=F(xb);
    en++;
    if(sr_encoder_now(x,r8)!=sr_encoder_before(x,r8)){ ebad++; if(!efirst) efirst=xb; }
  }
  printf("stochastic-rounding encoder mismatches %llu of %llu (first %08x)\n", ebad, en, efirst);
}
