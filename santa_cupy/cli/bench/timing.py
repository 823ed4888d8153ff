"""Timers and ceilings: CUDA-event medians, the streaming-read and device-copy ceilings, captured
CUDA graphs of many launches (CuPy and torch), and single decode steps.
"""

from __future__ import annotations

import statistics


STREAM_READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned int* out) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {          // 4 independent 16-byte loads in flight
        uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc += (a.x ^ b.y) + (c.z ^ d.w) + (a.y ^ b.z) + (c.w ^ d.x) + (a.z ^ b.w) + (c.x ^ d.y) + (a.w ^ b.x) + (c.y ^ d.z);
    }
    for (; i < n; i += stride) { uint4 a = p[i]; acc += a.x ^ a.y ^ a.z ^ a.w; }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);      // keeps every load live
}
"""


def event_median_us(cp, fn, stream, repeats=20, warmup=3, inner=1):
    """Median over ``repeats`` of the µs per call of ``inner`` back-to-back calls of fn between two
    CUDA events on ``stream`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(inner):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / inner)
    return statistics.median(times)


def _device_copy_us(cp, nbytes) -> float:
    """Median µs of a cudaMemcpyAsync device-to-device copy of nbytes (its buffers freed on return)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        src = cp.arange(nbytes // 4, dtype=cp.uint32)
        dst = cp.empty_like(src)
        us = event_median_us(cp, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), stream, repeats=10)
    stream.synchronize()
    return us


STREAM_LAUNCHES = ((1, 1024), (2, 1024), (4, 512), (8, 256), (16, 256))   # (blocks per SM, threads)


def stream_read_us(cp, nbytes, copies, launches=STREAM_LAUNCHES, inner=8, repeats=15) -> dict:
    """µs of one streaming read (stream_read) of nbytes per launch shape (blocks per SM, threads),
    timed as the kernels are: a CUDA graph of `inner` reads rotating over `copies` buffers (so that
    with enough bytes nothing is served from L2), warm-up replays, median of `repeats`."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    kernel = cp.RawKernel(STREAM_READ_SRC, "stream_read")
    bufs = [cp.arange(nbytes // 4, dtype=cp.uint32) + i for i in range(copies)]   # never zeros
    out = cp.zeros((1,), cp.uint32)
    n16 = cp.int64(nbytes // 16)
    times = {}
    for per_sm, threads in launches:
        reads = [lambda b=b: kernel((sms * per_sm,), (threads,), (b, n16, out)) for b in bufs]
        times[(per_sm, threads)] = time_cupy_graph(cp, reads, n_inner=inner, repeats=repeats, warmup=3)[0]
    return times


def measure_ceiling(cp, read_bytes=2 << 30, copy_bytes=2 << 30, buffers=2, launches=8) -> dict:
    """Streaming read (own kernel, 16-byte loads, grid-stride, reduction) and device-to-device copy
    (cudaMemcpyAsync; read + write counted), in TB/s. The read is timed as the kernels are
    (stream_read_us: a graph of `launches` reads over `buffers` rotating buffers of read_bytes);
    best of the launch shapes."""
    times = stream_read_us(cp, read_bytes, buffers, inner=launches)
    (per_sm, threads), us = min(times.items(), key=lambda kv: kv[1])
    cp.get_default_memory_pool().free_all_blocks()                  # the read buffers
    copy_us = _device_copy_us(cp, copy_bytes)
    cp.get_default_memory_pool().free_all_blocks()
    return {"read_tbps": read_bytes / (us * 1e-6) / 1e12, "read_bytes": read_bytes,
            "read_launch": f"{per_sm} blocks/SM x {threads} threads, graph of {launches} over {buffers} buffers",
            "copy_tbps": 2 * copy_bytes / (copy_us * 1e-6) / 1e12, "copy_bytes": copy_bytes}



def time_cupy_graph(cp, fns, n_inner, repeats, warmup=3):
    """Median µs per call of fns[i % len(fns)] (i < n_inner), captured as one CUDA graph on a
    non-default stream and replayed; eager launches timed with events if capture fails.
    -> (µs, "graph" | "eager: <why>")."""
    cp.cuda.Device().synchronize()                       # inputs were made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in fns:                                    # compile, set smem limits, fill pools
            f()
        stream.synchronize()
        mode, graph = "graph", None
        try:
            stream.begin_capture()
            try:
                for i in range(n_inner):
                    fns[i % len(fns)]()
            finally:
                graph = stream.end_capture()
            run = lambda: graph.launch(stream)  # noqa: E731
        except Exception as exc:
            mode = f"eager: capture failed ({type(exc).__name__}: {str(exc)[:80]})"

            def run():
                for i in range(n_inner):
                    fns[i % len(fns)]()
        us = event_median_us(cp, run, stream, repeats=repeats, warmup=warmup) / n_inner
    return us, mode


def time_torch_graph(torch, fns, n_inner, repeats, warmup=3):
    """As time_cupy_graph, with torch.cuda.CUDAGraph and torch.cuda.Event."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n_inner):
                fns[i % len(fns)]()
        run = graph.replay
    except Exception as exc:
        torch.cuda.synchronize()
        mode = f"eager: capture failed ({type(exc).__name__}: {str(exc)[:80]})"

        def run():
            for i in range(n_inner):
                fns[i % len(fns)]()
    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n_inner)
    return statistics.median(times), mode



def time_steps(cp, run, stream, steps, warmup):
    """Median and min ms of single decode steps (each timed with its own events)."""
    for _ in range(warmup):
        run()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(steps):
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), min(times)

