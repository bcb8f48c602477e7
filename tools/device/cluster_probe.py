"""Can two CTAs of a cluster hand a warpgroup's result tile to each other? (device probe)

  PYTHONPATH=. python3 tools/device/cluster_probe.py [--export]

The one-kernel decode path merges its key splits in a separate kernel (~3 µs at the paper
headline). Inside the kernel, the splits of a row tile would form a cluster: every split but the
first pushes its normalized output tile (bf16, WGMMA layout, 64 x D) and its LSE (float32, as a
64 x 8 tile) into the first split's shared memory with ``plgpu.async_store_smem`` (``st.async``
with ``complete_tx`` on the receiver's barrier), after a cluster barrier says that every
warpgroup of the cluster is done with its K/V slots (the receive buffers alias them). This probe
does exactly that on random data, with 2 and 4 CTAs per cluster, and checks the first CTA's
merge against NumPy. ``--export`` only lowers it (``jax.export`` for CUDA; runs on a CPU).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu.shared_attention_mgpu import load_tile

ROWS, COLS, LSE_COLS = 64, 128, 8


def probe(x, *, cluster: int):
  """``x [n, cluster, 64, 128]`` bf16 (part c's LSE: its rows' maxima + c) -> the LSE merge
  of the cluster's parts per n: ``out [n, 64, 128]`` f32 and ``lse [n, 64]``."""
  n = x.shape[0]
  tiling = plgpu.TilingTransform((8, 64))
  swizzle = plgpu.SwizzleTransform(128)
  lse_t = (plgpu.TilingTransform((8, LSE_COLS)), plgpu.SwizzleTransform(32))

  def body(x_ref, out_ref, olse_ref, x_smem, recv_o, recv_l, bar_in, bar_recv,
           bar_done):
    blk = lax.axis_index("n")
    c = lax.axis_index("c")
    plgpu.copy_gmem_to_smem(x_ref.at[blk, c], x_smem, bar_in)
    plgpu.barrier_wait(bar_in)
    mine = load_tile(x_smem, plgpu.Layout.WGMMA)
    # Each part's "LSE": its rows' maxima plus c (computed here: the probe is about the hand-off).
    my_lse = jnp.max(mine.astype(jnp.float32), axis=1) + c.astype(jnp.float32)
    plgpu.barrier_arrive(bar_done)
    plgpu.barrier_wait(bar_done)

    @pl.when(c > 0)
    def _send():
      plgpu.async_store_smem(mine, recv_o.at[c - 1], bar_recv, cluster_idx=jnp.int32(0),
                             cluster_dim="c")
      plgpu.async_store_smem(lax.broadcast_in_dim(my_lse, (ROWS, LSE_COLS), [0]),
                             recv_l.at[c - 1], bar_recv, cluster_idx=jnp.int32(0),
                             cluster_dim="c")

    @pl.when(c == 0)
    def _merge():
      plgpu.barrier_wait(bar_recv)
      parts = [(mine.astype(jnp.float32), my_lse)]
      for j in range(cluster - 1):
        o = load_tile(recv_o.at[j], plgpu.Layout.WGMMA).astype(jnp.float32)
        l = jnp.max(load_tile(recv_l.at[j], plgpu.Layout.WGMMA), axis=1)
        parts.append((o, l))
      m = functools.reduce(jnp.maximum, [l for _, l in parts])
      ws = [jnp.exp(l - m) for _, l in parts]
      tot = functools.reduce(lambda a, b: a + b, ws)
      acc = functools.reduce(lambda a, b: a + b, [
          o * lax.broadcast_in_dim(w / tot, o.shape, [0]) for (o, _), w in zip(parts, ws)])
      out_ref[blk] = acc
      olse_ref[blk] = m + jnp.log(tot)

  def entry(x_ref, out_ref, olse_ref):
    pl.run_scoped(
        lambda *a: body(x_ref, out_ref, olse_ref, *a),
        plgpu.SMEM((ROWS, COLS), x.dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((cluster - 1, ROWS, COLS), x.dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((cluster - 1, ROWS, LSE_COLS), jnp.float32, transforms=lse_t),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2 * (cluster - 1)),
        plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1),
    )

  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((n, ROWS, COLS), jnp.float32),
                jax.ShapeDtypeStruct((n, ROWS), jnp.float32)),
      grid=(n,), grid_names=("n",), cluster=(cluster,), cluster_names=("c",),
  )(x)


def reference(x):
  x = np.asarray(x, np.float64)
  lse = x.max(-1) + np.arange(x.shape[1])[None, :, None]
  m = lse.max(1)
  w = np.exp(lse - m[:, None])
  tot = w.sum(1)
  out = (x * (w / tot[:, None])[..., None]).sum(1)
  return out, m + np.log(tot)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--export", action="store_true")
  args = ap.parse_args()
  for cluster in (2, 4):
    n = 6
    x = jax.random.normal(jax.random.key(cluster), (n, cluster, ROWS, COLS), jnp.bfloat16)
    fn = jax.jit(functools.partial(probe, cluster=cluster))
    if args.export:
      text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(x).mlir_module()
      print(f"cluster {cluster}: exported, {len(text)} chars")
      continue
    out, olse = fn(x)
    ref_o, ref_l = reference(x)
    err_o = float(np.abs(np.asarray(out) - ref_o).max())
    err_l = float(np.abs(np.asarray(olse) - ref_l).max())
    ok = err_o < 1e-4 and err_l < 1e-4
    print(f"cluster {cluster}: max |out - ref| {err_o:.2e}, max |lse - ref| {err_l:.2e}: "
          f"{'OK' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
  main()
