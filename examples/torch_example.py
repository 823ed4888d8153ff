"""santa-cupy from torch: bf16 tensors as uint16 views, torch's current stream, a torch.cuda.CUDAGraph.

    python examples/torch_example.py

santa-cupy never imports torch: tensors go in through __cuda_array_interface__ without copies
(bf16 as ``t.view(torch.uint16)``), outputs are written into a torch tensor with ``out=``, and
``stream=torch.cuda.current_stream().cuda_stream`` puts the kernels on torch's stream, so they
are ordered with torch's work and captured by torch.cuda.graph.
"""

import torch

import santa_cupy
import santa_cupy.interop

B, H, KVH, D, L_MAX = 4, 32, 8, 128, 4096
SEED = 11


def sdpa_reference(q, k_cache, v_cache, lengths):
    """torch SDPA in float32 with a length mask: o [B, H, D]."""
    G = H // KVH
    k = k_cache.float().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)     # [B, H, L, D]
    v = v_cache.float().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    mask = torch.arange(L_MAX, device=q.device)[None, :] < lengths[:, None].long()   # [B, L] True: attend
    o = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None, :], k, v,
                                                         attn_mask=mask[:, None, None, :])
    return o[:, :, 0, :]


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = (torch.randn(B, H, D, device=dev, generator=gen) * 3.0).to(torch.bfloat16)
    k_cache = torch.randn(B, L_MAX, KVH, D, device=dev, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(B, L_MAX, KVH, D, device=dev, generator=gen).to(torch.bfloat16)
    lengths = torch.tensor([4096, 3000, 1024, 17], device=dev, dtype=torch.int32)
    u16 = lambda t: t.view(torch.uint16)     # noqa: E731  bf16 -> its bit patterns, same memory

    dense_plan = santa_cupy.DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_MAX,
                                       dtype="bfloat16", method="dense")
    santa_plan = santa_cupy.DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_MAX,
                                       dtype="bfloat16", samples=256, seed=SEED, santa_min_length=0)
    torch.cuda.synchronize()                 # plan buffers were initialised on CuPy's stream

    # eager, on torch's current stream, into torch tensors
    o_dense = torch.empty(B, H, D, device=dev, dtype=torch.bfloat16)
    o_santa = torch.empty_like(o_dense)
    s = torch.cuda.current_stream().cuda_stream
    dense_plan.run(u16(q), u16(k_cache), u16(v_cache), lengths, out=u16(o_dense), stream=s)
    santa_plan.run(u16(q), u16(k_cache), u16(v_cache), lengths, out=u16(o_santa), stream=s)
    ref = sdpa_reference(q, k_cache, v_cache, lengths)
    err_dense, err_santa = rel_l2(o_dense, ref), rel_l2(o_santa, ref)
    print(f"eager: dense vs torch SDPA {err_dense:.2e}; santa (S=256) vs SDPA {err_santa:.4f}")
    assert err_dense < 1e-2, err_dense

    # CUDA graph: warm up on a side stream (torch's recipe), then capture dense + santa + advance
    # (the tensors viewed as CuPy arrays once, so the captured step is kernel launches only)
    o_dense_g, o_santa_g = torch.empty_like(o_dense), torch.empty_like(o_dense)
    args = santa_cupy.interop.as_arrays(u16(q), u16(k_cache), u16(v_cache), lengths)
    out_dense, out_santa = santa_cupy.interop.as_out(u16(o_dense_g)), santa_cupy.interop.as_out(u16(o_santa_g))

    def step():
        st = torch.cuda.current_stream().cuda_stream
        dense_plan.run(*args, out=out_dense, validate=False, stream=st)
        santa_plan.run(*args, out=out_santa, validate=False, stream=st)
        santa_plan.advance(stream=st)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    results = []
    for i in range(2):
        q.copy_((torch.randn(B, H, D, device=dev, generator=gen) * 3.0).to(torch.bfloat16))  # new query
        torch.cuda.synchronize()
        before = int(santa_plan.step.get()[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = sdpa_reference(q, k_cache, v_cache, lengths)
        eager_t = torch.empty_like(o_dense)
        santa_cupy.decode_attention(u16(q), u16(k_cache), u16(v_cache), lengths, samples=256, seed=SEED,
                                    step=before, santa_min_length=0, out=u16(eager_t),
                                    stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        err_dense, same = rel_l2(o_dense_g, ref), rel_l2(o_santa_g, eager_t)
        results.append((err_dense, same, before))
        print(f"replay {i}: dense vs SDPA {err_dense:.2e}; santa vs the eager call of step {before}: {same:.2e}")
        assert err_dense < 1e-2, err_dense
        assert same < 1e-2, same
        assert int(santa_plan.step.get()[0]) == before + 1
    print("ok")
    return results


if __name__ == "__main__":
    main()
