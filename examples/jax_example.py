"""santa-cupy from JAX: decode attention inside jax.jit on bf16 JAX arrays, the RNG step an operand.

    python examples/jax_example.py

santa_cupy.jax.decode_attention lowers to a jax.experimental.buffer_callback: at run time XLA hands
santa-cupy its buffers and its CUDA stream, the kernels write the result buffer in place.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave GPU memory for CuPy's pool

import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402

from santa_cupy import jax as santa_jax   # noqa: E402

B, H, KVH, D, L_MAX = 4, 32, 8, 128, 4096


def reference(q, k_cache, v_cache, lengths):
    """Exact attention in float32 with jnp: o [B, H, D]."""
    G = H // KVH
    k = jnp.repeat(k_cache.astype(jnp.float32), G, axis=2)              # [B, L, H, D]
    v = jnp.repeat(v_cache.astype(jnp.float32), G, axis=2)
    s = jnp.einsum("bhd,blhd->bhl", q.astype(jnp.float32), k) / jnp.sqrt(jnp.float32(D))
    s = jnp.where(jnp.arange(L_MAX)[None, None, :] < lengths[:, None, None], s, -jnp.inf)
    return jnp.einsum("bhl,blhd->bhd", jax.nn.softmax(s, axis=-1), v)


def rel_l2(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@jax.jit
def decode_step(q, k_cache, v_cache, lengths, step):
    """One step: exact and SANTA attention (S=256) of the same inputs."""
    dense = santa_jax.decode_attention(q, k_cache, v_cache, lengths, step, method="dense")
    santa = santa_jax.decode_attention(q, k_cache, v_cache, lengths, step, samples=256, seed=3,
                                       santa_min_length=0)
    return dense, santa


def main():
    assert jax.devices("gpu"), "needs JAX with a CUDA GPU"
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(kq, (B, H, D)) * 3.0).astype(jnp.bfloat16)
    k_cache = jax.random.normal(kk, (B, L_MAX, KVH, D)).astype(jnp.bfloat16)
    v_cache = jax.random.normal(kv, (B, L_MAX, KVH, D)).astype(jnp.bfloat16)
    lengths = jnp.array([4096, 3000, 1024, 17], jnp.int32)

    ref = reference(q, k_cache, v_cache, lengths)
    outs = [decode_step(q, k_cache, v_cache, lengths, jnp.int32(step)) for step in range(3)]
    jax.block_until_ready(outs)
    err_dense = rel_l2(outs[0][0], ref)
    print(f"jit dense vs jnp reference: {err_dense:.2e}; dtype {outs[0][0].dtype}")
    for step, (_, santa) in enumerate(outs):
        print(f"jit santa step {step}: vs reference {rel_l2(santa, ref):.4f}")
    moved = rel_l2(outs[1][1], outs[0][1])
    print(f"santa step 1 vs step 0: {moved:.4f} (different samples)")
    assert outs[0][0].dtype == jnp.bfloat16 and outs[0][0].shape == (B, H, D)
    assert err_dense < 1e-2, err_dense
    assert moved > 0.0, moved                               # not the same samples
    print("ok")
    return err_dense, moved


if __name__ == "__main__":
    main()
