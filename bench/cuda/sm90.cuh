// Shared by the kernel-variant harnesses in this folder (not shipped), sm_90 primitives:
// an mbarrier, 1-D bulk asynchronous copies (cp.async.bulk) from global to shared memory,
// and thread block clusters (barrier halves, loads from and asynchronous stores to the
// shared memory of another CTA of the cluster).
#pragma once
#include <cstdint>

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` of bulk-copy completions in the current phase.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT;\n}\n" ::"r"(smem_u32(b)),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global src to shared
// dst, completing on mbarrier b.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(b))
                 : "memory");
}

// Extra dynamic shared memory a kernel using bulk_stage() is launched with.
constexpr int BULK_STAGE_SLACK = 128;

// The kernel's dynamic shared memory, rounded up to 128 bytes (launches add
// BULK_STAGE_SLACK bytes). History: the sanitizer's misaligned 16-byte shared reads at
// 0x808 in the FP8 block pipeline (2026-12-05) were first blamed on the dynamic stage and
// this rounding added; they were Transposed128's (common.cuh), a word array read as uint4
// and placed 8 bytes past a 16-byte boundary behind the pipeline's mbarrier. With that
// struct 16-byte aligned the pipeline ran (H100; its hashes equal to the tile
// kernels'). The rounding stays: 128 bytes buy not having to argue about where the
// dynamic shared memory starts.
__device__ __forceinline__ uint8_t* bulk_stage() {
    extern __shared__ uint8_t smem_raw[];
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~(uintptr_t)127);
}

// ---- thread block clusters ---------------------------------------------------------------

// This CTA's rank in its cluster (its x index within the cluster for 1-D clusters).
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The two halves of a cluster-wide barrier: every thread of every CTA of the cluster
// arrives (release: its shared-memory writes become visible to the cluster) and waits
// (acquire) for all of them. A CTA must not exit while another may still read its shared
// memory, so a read of a peer's shared memory is followed by an arrive, and exit by a
// wait. The relaxed arrive orders nothing (for a barrier that only says "started").
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The address of the shared variable at p (this CTA's) in cluster CTA `rank`.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t rank) {
    uint32_t ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smem_u32(p)), "r"(rank));
    return ra;
}

// The float at p (a __shared__ address of this CTA) in the shared memory of cluster CTA
// `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* p, uint32_t rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}

// The 4-byte word at p (a __shared__ address of this CTA) in the shared memory of cluster
// CTA `rank`.
__device__ __forceinline__ uint32_t ld_cluster_u32(const void* p, uint32_t rank) {
    uint32_t v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}

// v into the float at p in cluster CTA `rank`'s shared memory, completing 4 bytes of the
// transaction count of that CTA's mbarrier at bar (both addresses given as this CTA's).
__device__ __forceinline__ void st_async_f32(const float* p, uint32_t rank, float v, const uint64_t* bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     cluster_addr(p, rank)),
                 "r"(__float_as_uint(v)), "r"(cluster_addr(bar, rank))
                 : "memory");
}
