"""santa-cupy from CuPy: a DecodePlan on an explicit stream, writing into your own buffer, in a CUDA graph.

    python examples/cupy_example.py

Shapes: q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D]; lengths [B] int32; bf16 as uint16 bits.
Prints the santa-vs-dense error and checks that a graph replay equals the eager call of its step.
"""

import cupy as cp
import numpy as np

import santa_cupy

B, H, KVH, D, L_MAX = 4, 32, 8, 128, 4096


def bf16(x):
    """float32 CuPy array -> bf16 bit patterns (uint16), round to nearest even."""
    bits = x.astype(cp.float32).view(cp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)


def as_float(x):
    return (x.astype(cp.uint32) << 16).view(cp.float32) if x.dtype == cp.uint16 else x.astype(cp.float32)


def rel_l2(a, b):
    a, b = as_float(a), as_float(b)
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


def main():
    rng = cp.random.default_rng(0)
    q = bf16(rng.standard_normal((B, H, D), dtype=cp.float32) * 3.0)     # peaked scores
    k_cache = bf16(rng.standard_normal((B, L_MAX, KVH, D), dtype=cp.float32))
    v_cache = bf16(rng.standard_normal((B, L_MAX, KVH, D), dtype=cp.float32))
    lengths = cp.asarray([4096, 3000, 1024, 17], dtype=cp.int32)

    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()                          # the inputs were made on the default stream
    with stream:                                            # the plan's buffers initialised on `stream`
        setting = santa_cupy.AttentionSetting.parse("systematic/global/S=256/min_length=0/seed=7")
        plan = santa_cupy.DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_MAX,
                                     dtype="bfloat16", setting=setting)
    o = cp.empty((B, H, D), cp.uint16)                      # your buffer: o is written here
    dense = cp.empty_like(o)

    plan.run(q, k_cache, v_cache, lengths, out=o, stream=stream)            # step 0
    santa_cupy.decode_attention(q, k_cache, v_cache, lengths, method="dense", out=dense, stream=stream)
    stream.synchronize()
    print(f"santa ({plan.setting}) vs dense: rel. L2 error {rel_l2(o, dense):.4f}, step {int(plan.step.get()[0])}")

    # One decode step as a CUDA graph: run, then advance the device step counter.
    o_graph = cp.empty_like(o)
    with stream:
        stream.begin_capture()
        plan.run(q, k_cache, v_cache, lengths, out=o_graph, validate=False)
        plan.advance()
        graph = stream.end_capture()
    errors = []
    for step in range(3):
        graph.launch(stream)
        eager = santa_cupy.decode_attention(q, k_cache, v_cache, lengths, samples=256, seed=7, step=step,
                                            santa_min_length=0, stream=stream)
        stream.synchronize()
        errors.append(rel_l2(o_graph, eager))
        print(f"graph replay {step}: vs the eager call of step {step}: {errors[-1]:.2e}")
    assert int(plan.step.get()[0]) == 3, plan.step.get()
    assert max(errors) < 1e-2, errors                       # the same samples (fp32 atomics: rounding)
    assert np.isfinite(as_float(o_graph).get()).all()
    print("ok")
    return errors


if __name__ == "__main__":
    main()
