// pdl.cuh — programmatic dependent launch (sm_90), for the decoder's kernels (gemv.cu, decoder.cu).
//
// A kernel launched with the programmatic-stream-serialization attribute (decoder_ops, when
// programmatic launch is on) may start while the kernel before it in the stream is still running:
// it can issue loads that do not depend on that kernel (gemv's weight rows) and must call
// pdl_wait() before it reads that kernel's outputs or writes anything. Every thread calls it before
// exiting, so the kernel's completion still implies its predecessor's (a chain stays ordered).
// pdl_launch_dependents() lets the next such kernel be scheduled now instead of at this one's end.
// Both are no-ops on a plain launch, and compile to nothing before sm_90.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
