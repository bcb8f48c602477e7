"""Public attention API: full attention with LSE, shared-prefix and tree attention.

The decomposition (Hydragen, Sec. 3): attention over a context that is the
concatenation of shared segments and a per-sequence suffix equals the LSE
merge of attention over each part. Shared parts are computed once for all
the queries that share them (one matrix product, the segment read once);
the suffix part is per sequence. See :mod:`jax_shared_attn.merge` for the
merge formula.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_shared_attn import _checks, dispatch
from jax_shared_attn import ops as ops_lib

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedLevel:
  """One level of a sharing tree (Hydragen Sec. 3.3).

  Attributes:
    k: ``[N, T, Hkv, D]`` keys of the level's N shared segments (padded to T).
    v: ``[N, T, Hkv, D]`` values, same shape as ``k``.
    lengths: int32 ``[N]``: segment n's first ``lengths[n]`` tokens are valid.
    node_of_seq: int32 ``[B]``: the segment that sequence b continues at this
      level, or ``-1`` if b has no segment at this level.

    all_share: static promise that the level is one segment (N = 1) continued by
      every sequence (``node_of_seq`` all 0), as :meth:`shared_by_all` builds it.
      It lets the kernels treat the segment as a plain shared prefix (on Hopper,
      decoding then runs prefix and suffixes in one kernel).

  Sequence b's context is, level by level, ``k[node_of_seq[b], :lengths[...]]``,
  then its own suffix. Fan-out may differ per segment.
  """

  k: Array
  v: Array
  lengths: Array
  node_of_seq: Array
  all_share: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def shared_by_all(cls, k: Array, v: Array, batch_size: int,
                    length: Optional[Array] = None) -> "SharedLevel":
    """A level with one segment (``k, v [T, Hkv, D]``) shared by all ``batch_size`` sequences."""
    length = k.shape[0] if length is None else length
    return cls(k[None], v[None], jnp.reshape(jnp.asarray(length, jnp.int32), (1,)),
               jnp.zeros((batch_size,), jnp.int32), all_share=True)


def _check_query(fn: str, q: Array) -> tuple[int, int, int, int]:
  _checks.check_rank(fn, "q", q, 4, "[B, Tq, Hq, D]")
  return tuple(q.shape)


def _check_suffix(fn, q, k, v, k_name, v_name, kv_lengths, lengths_name):
  b, tq, hq, d = _check_query(fn, q)
  _checks.check_rank(fn, k_name, k, 4, "[B, S, Hkv, D]")
  _checks.check_kv_pair(fn, k_name, k, v_name, v)
  _checks.check_same(fn, "the batch sizes (axis 0)", **{"q": b, k_name: k.shape[0]})
  _checks.check_same(fn, "the head dims (last axis)", **{"q": d, k_name: k.shape[3]})
  _checks.check_heads(fn, "q", hq, k_name, k.shape[2])
  if kv_lengths is None:
    return jnp.full((b,), k.shape[1], jnp.int32)
  return _checks.lengths_array(fn, lengths_name, kv_lengths, (b,), k.shape[1],
                               f"the capacity {k_name}.shape[1]")


def attention_with_lse(q: Array, k: Array, v: Array, *, kv_lengths: Optional[Array] = None,
                       causal: bool = False, scale: Optional[float] = None,
                       impl: str = "auto", config=None, alibi_slopes: Optional[Array] = None,
                       softcap: Optional[float] = None,
                       local_window_size=None) -> tuple[Array, Array]:
  """Attention that also returns the log-sum-exp of the scores.

  Args:
    q: ``[B, Tq, Hq, D]`` queries.
    k: ``[B, Tk, Hkv, D]`` keys, ``Hq % Hkv == 0`` (GQA/MQA: query head h reads
      key head ``h // (Hq // Hkv)``).
    v: ``[B, Tk, Hkv, D]`` values.
    kv_lengths: int ``[B]`` or None (= Tk): only the first ``kv_lengths[b]``
      keys of sequence b are valid. Concrete values must lie in [0, Tk];
      traced values are clamped into it.
    causal: query i of sequence b sits at position ``kv_lengths[b] - Tq + i``
      and sees keys up to and including that position.
    scale: score scale, default ``D ** -0.5``.
    impl: ``"auto"``, ``"xla"`` or a Pallas family (see :mod:`jax_shared_attn.ops`).
    config: the kernel family's choices, a ``GpuConfig`` or ``TpuConfig`` (hashable: pass it
      as a static argument under jit); None: the defaults. ``"xla"`` takes an ``XlaConfig``
      (its tiles) and ignores the others.
    alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]`` or None: query position i and key position
      j (query i of sequence b at ``kv_lengths[b] - Tq + i``, key j at j) add
      ``-slope * (i - j)`` to the score (BLOOM, FlashInfer). Traced, differentiable.
    softcap: a float > 0 or None (static): scores become ``softcap * tanh(s / softcap)``,
      ``s = scale * q . k``, before the ALiBi bias (Gemma 2).
    local_window_size: None, an int w (= ``(w, w)``) or ``(left, right)`` of ints >= 0
      (static), as in ``jax.nn.dot_product_attention``: query position i sees key j only if
      ``i - left <= j <= i + right`` (and ``causal`` still applies). A Hugging Face
      ``sliding_window`` W (Mistral, Gemma 2: key j visible iff ``i - j < W``) is
      ``(W - 1, 0)`` with ``causal=True``.

    A call with any of the three runs on the XLA path, the Triton or the TPU kernels
    (``impl="auto"`` plans the Triton kernels on a GPU, Hopper included, the TPU kernels on a
    TPU); ``impl="pallas:mosaic_gpu"`` is an error. Their backward is the XLA one.

  Returns:
    ``out [B, Tq, Hq, D]`` in q's dtype and float32 ``lse [B, Tq, Hq]``,
    ``lse = log(sum_j exp(scale * q . k_j))`` (natural log) over visible keys (of the
    modified scores, with variants).
    A row with no visible key gives ``out = 0``, ``lse = -inf``.

  Example:
    >>> out, lse = attention_with_lse(q, k, v, kv_lengths=jnp.array([7, 3]), causal=True)
  """
  return _run(_prepare_full(q, k, v, kv_lengths=kv_lengths, causal=causal, scale=scale,
                            impl=impl, config=config, alibi_slopes=alibi_slopes,
                            softcap=softcap, local_window_size=local_window_size))


@dataclasses.dataclass(frozen=True)
class _Call:
  """A public call with its arguments checked: what :func:`explain` plans and ``_run`` runs."""
  fn: str
  q: Any
  parts: Optional[list]  # None: no shared part (attention_with_lse)
  suffix_k: Any
  suffix_v: Any
  lengths: Any
  causal: bool
  scale: float
  impl: str
  config: Any
  return_lse: bool = True
  page_table: Any = None  # paged_attention: own pages [B, O]; suffix_k/suffix_v are the pools
  mods: Any = None  # the score variants, a ScoreMods (None: none)


def _variants(fn: str, q, alibi_slopes, softcap, local_window_size):
  return _checks.check_variants(fn, alibi_slopes, softcap, local_window_size, q.shape[0],
                                q.shape[2])


def _prepare_full(q, k, v, *, kv_lengths=None, causal=False, scale=None, impl="auto",
                  config=None, alibi_slopes=None, softcap=None, local_window_size=None) -> _Call:
  fn = "attention_with_lse"
  lengths = _check_suffix(fn, q, k, v, "k", "v", kv_lengths, "kv_lengths")
  _checks.check_float_dtypes(fn, q=q, k=k, v=v)
  scale = _checks.check_scale(fn, scale, q.shape[-1])
  mods = _variants(fn, q, alibi_slopes, softcap, local_window_size)
  return _Call(fn, q, None, k, v, lengths, bool(causal), scale, impl, config, mods=mods)


def _plan(call: _Call, **target) -> dispatch.Plan:
  return dispatch.plan(call.fn, call.q, call.parts, call.suffix_k, impl=call.impl,
                       config=call.config, page_table=call.page_table, mods=call.mods, **target)


def _run(call: _Call):
  """Plans ``call`` once (the plan :func:`explain` returns) and executes it."""
  return _execute(_plan(call), call)


def _execute(plan: dispatch.Plan, call: _Call):
  if call.page_table is not None:
    return _execute_paged(plan, call)
  ops = ops_lib.executor(plan, call.config)
  mods = {} if call.mods is None else {"mods": call.mods}
  # need_lse=False (the LSE not returned) tells the backward that it gets no cotangent
  if call.parts is None:
    out, lse = ops.suffix_attention(call.q, call.suffix_k, call.suffix_v, kv_lengths=call.lengths,
                                    causal=call.causal, scale=call.scale,
                                    need_lse=call.return_lse, **mods)
  else:  # the family's whole decomposition (XLA: from the reference primitives)
    out, lse = ops.shared_attention(call.q, call.parts, call.suffix_k, call.suffix_v,
                                    kv_lengths=call.lengths, causal=call.causal, scale=call.scale,
                                    need_lse=call.return_lse, **mods)
  out = out.astype(call.q.dtype)
  return (out, lse) if call.return_lse else out


def _check_level(fn: str, i: int, level: SharedLevel, b: int, hkv: int, d: int,
                 dtype) -> tuple[Array, Array]:
  name = f"levels[{i}]"
  if not isinstance(level, SharedLevel):
    raise TypeError(f"{fn}: {name} must be a SharedLevel; got {type(level).__name__}")
  _checks.check_rank(fn, f"{name}.k", level.k, 4, "[N, T, Hkv, D]")
  _checks.check_kv_pair(fn, f"{name}.k", level.k, f"{name}.v", level.v)
  n, t, lh, ld = level.k.shape
  _checks.check_same(fn, "the key/value heads", **{"suffix_k": hkv, f"{name}.k": lh})
  _checks.check_same(fn, "the head dims", **{"q": d, f"{name}.k": ld})
  _checks.check_float_dtypes(fn, q=jnp.empty((), dtype), **{f"{name}.k": level.k,
                                                         f"{name}.v": level.v})
  if n < 1:
    raise ValueError(f"{fn}: {name}.k must hold at least one segment (N >= 1); got N = 0")
  lengths = _checks.lengths_array(fn, f"{name}.lengths", level.lengths, (n,), t,
                                  f"the capacity {name}.k.shape[1]")
  nodes = _check_level_nodes(fn, name, "node_of_seq", level.node_of_seq, b, n)
  if level.all_share and _checks.is_concrete(nodes) and nodes.size:
    lo, hi = int(np.min(nodes)), int(np.max(nodes))
    if (lo, hi) != (0, 0):
      raise ValueError(f"{fn}: {name}.all_share=True promises every sequence continues segment "
                       f"0, but {name}.node_of_seq holds values in [{lo}, {hi}]")
  if level.all_share and n != 1:
    raise ValueError(f"{fn}: {name}.all_share=True promises one segment shared by every "
                     f"sequence, but {name}.k holds {n} segments")
  return lengths, nodes


def shared_prefix_attention(q: Array, prefix_k: Array, prefix_v: Array, suffix_k: Array,
                            suffix_v: Array, *, prefix_length: Optional[Array] = None,
                            suffix_lengths: Optional[Array] = None, causal: bool = True,
                            scale: Optional[float] = None, impl: str = "auto",
                            return_lse: bool = False, config=None,
                            alibi_slopes: Optional[Array] = None,
                            softcap: Optional[float] = None, local_window_size=None):
  """Exact attention over one shared prefix plus per-sequence suffixes (Hydragen).

  Sequence b's context is ``concat(prefix[:prefix_length], suffix_b[:suffix_lengths[b]])``.
  The prefix part is ONE batched computation: all ``B * Tq * G`` query rows of
  a KV head against the prefix (read once, never copied per sequence); the
  suffix part is per sequence; the two are merged by their LSE.

  Args:
    q: ``[B, Tq, Hq, D]``: the last Tq tokens of each sequence's suffix.
    prefix_k, prefix_v: ``[P, Hkv, D]`` shared by all B sequences.
    suffix_k, suffix_v: ``[B, S, Hkv, D]`` each sequence's own keys/values.
    prefix_length: int scalar or None (= P): valid prefix tokens.
    suffix_lengths: int ``[B]`` or None (= S): valid suffix tokens per sequence.
    causal: causal inside the suffix (query i sits at suffix position
      ``suffix_lengths[b] - Tq + i``); every valid prefix key is visible to
      every query. With ``suffix_lengths[b] >= Tq`` this is exactly causal
      attention over the concatenated context.
    scale: default ``D ** -0.5``.
    impl: ``"auto"``, ``"xla"`` or a Pallas family (:mod:`jax_shared_attn.ops`).
    return_lse: also return the float32 natural-log LSE ``[B, Tq, Hq]``.
    config: a ``GpuConfig`` / ``TpuConfig`` (static under jit) or None, as in
      :func:`attention_with_lse`; :func:`explain` shows the plan it gives.
    alibi_slopes, softcap, local_window_size: score variants, as in
      :func:`attention_with_lse`, with positions counted in each sequence's context
      ``concat(prefix, suffix_b)``: prefix key j at j, suffix key j at ``prefix_length + j``,
      query i at ``prefix_length + suffix_lengths[b] - Tq + i``.

  Returns:
    ``out [B, Tq, Hq, D]`` in q's dtype (and ``lse`` if ``return_lse``).

  Example:
    >>> out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens)
  """
  return _run(_prepare_prefix(q, prefix_k, prefix_v, suffix_k, suffix_v,
                              prefix_length=prefix_length, suffix_lengths=suffix_lengths,
                              causal=causal, scale=scale, impl=impl, return_lse=return_lse,
                              config=config, alibi_slopes=alibi_slopes, softcap=softcap,
                              local_window_size=local_window_size))


def _prepare_prefix(q, prefix_k, prefix_v, suffix_k, suffix_v, *, prefix_length=None,
                    suffix_lengths=None, causal=True, scale=None, impl="auto", return_lse=False,
                    config=None, alibi_slopes=None, softcap=None,
                    local_window_size=None) -> _Call:
  fn = "shared_prefix_attention"
  lengths = _check_suffix(fn, q, suffix_k, suffix_v, "suffix_k", "suffix_v", suffix_lengths,
                          "suffix_lengths")
  _checks.check_rank(fn, "prefix_k", prefix_k, 3, "[P, Hkv, D]")
  _checks.check_kv_pair(fn, "prefix_k", prefix_k, "prefix_v", prefix_v)
  _checks.check_same(fn, "the key/value heads", prefix_k=prefix_k.shape[1],
                     suffix_k=suffix_k.shape[2])
  _checks.check_same(fn, "the head dims", q=q.shape[3], prefix_k=prefix_k.shape[2])
  _checks.check_float_dtypes(fn, q=q, prefix_k=prefix_k, prefix_v=prefix_v, suffix_k=suffix_k,
                             suffix_v=suffix_v)
  p = prefix_k.shape[0]
  plen = (jnp.asarray(p, jnp.int32) if prefix_length is None else _checks.lengths_array(
      fn, "prefix_length", prefix_length, (), p, "the prefix capacity prefix_k.shape[0]"))
  scale = _checks.check_scale(fn, scale, q.shape[-1])
  parts = [("prefix", prefix_k, prefix_v, plen, None)]
  mods = _variants(fn, q, alibi_slopes, softcap, local_window_size)
  return _Call(fn, q, parts, suffix_k, suffix_v, lengths, bool(causal), scale, impl, config,
               return_lse, mods=mods)


def hierarchical_attention(q: Array, levels: Sequence[SharedLevel], suffix_k: Array,
                           suffix_v: Array, *, suffix_lengths: Optional[Array] = None,
                           causal: bool = True, scale: Optional[float] = None,
                           impl: str = "auto", return_lse: bool = False, config=None,
                           alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                           local_window_size=None):
  """Exact attention over a tree of shared segments plus per-sequence suffixes.

  Sequence b's context is, for each level in order, the segment
  ``levels[l].node_of_seq[b]`` (skipped where it is -1), then its own suffix.
  Each segment's attention is batched over the queries of every sequence
  that shares it (Hydragen Sec. 3.3); all parts are merged by LSE.

  Args:
    q: ``[B, Tq, Hq, D]``.
    levels: sequence of :class:`SharedLevel` (may be empty).
    suffix_k, suffix_v: ``[B, S, Hkv, D]``; suffix_lengths: int ``[B]`` or None.
    causal, scale, impl, return_lse, config: as in :func:`shared_prefix_attention`.
    alibi_slopes, softcap, local_window_size: score variants, as in
      :func:`attention_with_lse`, with positions counted in each sequence's context (its
      segments in level order, then its suffix; queries at the context's last Tq positions).
      A level entirely outside a query's window contributes nothing.
  """
  return _run(_prepare_tree(q, levels, suffix_k, suffix_v, suffix_lengths=suffix_lengths,
                            causal=causal, scale=scale, impl=impl, return_lse=return_lse,
                            config=config, alibi_slopes=alibi_slopes, softcap=softcap,
                            local_window_size=local_window_size))


def _prepare_tree(q, levels, suffix_k, suffix_v, *, suffix_lengths=None, causal=True, scale=None,
                  impl="auto", return_lse=False, config=None, alibi_slopes=None, softcap=None,
                  local_window_size=None) -> _Call:
  fn = "hierarchical_attention"
  lengths = _check_suffix(fn, q, suffix_k, suffix_v, "suffix_k", "suffix_v", suffix_lengths,
                          "suffix_lengths")
  _checks.check_float_dtypes(fn, q=q, suffix_k=suffix_k, suffix_v=suffix_v)
  if isinstance(levels, SharedLevel):
    levels = [levels]
  b, _, _, d = q.shape
  parts = []
  for i, level in enumerate(levels):
    seg_lengths, nodes = _check_level(fn, i, level, b, suffix_k.shape[2], d, q.dtype)
    if level.all_share:  # checked above: one segment, every sequence
      parts.append(("prefix", level.k[0], level.v[0], seg_lengths[0], None))
    else:
      parts.append(("segments", level.k, level.v, seg_lengths, nodes))
  scale = _checks.check_scale(fn, scale, d)
  mods = _variants(fn, q, alibi_slopes, softcap, local_window_size)
  return _Call(fn, q, parts, suffix_k, suffix_v, lengths, bool(causal), scale, impl, config,
               return_lse, mods=mods)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLevel:
  """One shared level of :func:`paged_attention`: segments stored in pages of the pools.

  Attributes:
    page_table: int32 ``[S, P]``: segment s's pages in token order (entries past its length
      are ignored; any valid page id, e.g. 0).
    lengths: int32 ``[S]``: segment s holds ``lengths[s] <= P * page_size`` tokens.
    segment_of_seq: int32 ``[B]``: the segment sequence b continues at this level, -1 for none.
  """

  page_table: Array
  lengths: Array
  segment_of_seq: Array


def paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array,
                    kv_lengths: Array, *, levels: Sequence[PagedLevel] = (), causal: bool = True,
                    scale: Optional[float] = None, impl: str = "auto", return_lse: bool = False,
                    config=None, alibi_slopes: Optional[Array] = None,
                    softcap: Optional[float] = None, local_window_size=None):
  """Exact attention over a tree of shared segments plus per-sequence keys, all stored in
  page pools (a serving engine's KV cache), read in place.

  Sequence b's context is, for each level in order, the segment ``levels[l].segment_of_seq[b]``
  (skipped where -1), then its own keys: the first ``kv_lengths[b]`` tokens of its pages
  ``page_table[b]``. Each segment is attended once by the queries of every sequence that
  continues it (:func:`hierarchical_attention`'s decomposition); the parts are merged by LSE.
  On GPUs the segment and suffix kernels read the pages through the tables (no copy); on TPUs
  the suffix kernel reads the own pages in place and each level's pages are gathered once; the
  "xla" path gathers the pages into contiguous buffers first. Forward
  only: ``jax.grad`` of it is an error (differentiate :func:`hierarchical_attention`).

  Args:
    q: ``[B, Tq, Hq, D]``: the last Tq tokens of each sequence's own keys.
    k_pages, v_pages: ``[pages, page_size, Hkv, D]``.
    page_table: int32 ``[B, O]``: sequence b's own pages in token order.
    kv_lengths: int ``[B]``, ``<= O * page_size``: own tokens of sequence b, this call's Tq
      included (causal: query i sits at own position ``kv_lengths[b] - Tq + i``).
    levels: :class:`PagedLevel` per shared level (may be empty).
    causal, scale, impl, return_lse, config: as in :func:`shared_prefix_attention`.
    alibi_slopes, softcap, local_window_size: score variants, as in
      :func:`hierarchical_attention` (positions in each sequence's context: its segments in
      level order, then its own keys); they run on the XLA path, the TPU kernels or the Triton
      kernels.

  Page ids are not range-checked inside a traced program (an id outside ``[0, pages)`` reads
  clamped rows); concrete tables are checked.
  """
  return _run(_prepare_paged(q, k_pages, v_pages, page_table, kv_lengths, levels=levels,
                             causal=causal, scale=scale, impl=impl, return_lse=return_lse,
                             config=config, alibi_slopes=alibi_slopes, softcap=softcap,
                             local_window_size=local_window_size))


def _check_table(fn: str, name: str, table, shape_doc: str, rows: Optional[int],
                 pages: int) -> Array:
  _checks.check_rank(fn, name, table, 2, shape_doc)
  if not jnp.issubdtype(table.dtype, jnp.integer):
    raise TypeError(f"{fn}: {name} must be an integer array {shape_doc}; got {table.dtype}")
  if rows is not None and table.shape[0] != rows:
    raise ValueError(f"{fn}: {name} must have {rows} rows ({shape_doc}); got "
                     f"{_checks.shape_str(table.shape)}")
  if _checks.is_concrete(table) and table.size:
    host = np.asarray(table)
    lo, hi = int(host.min()), int(host.max())
    if lo < 0 or hi >= pages:
      raise ValueError(f"{fn}: {name} holds page ids in [{lo}, {hi}]; the pools have {pages} "
                       f"pages (ids 0..{pages - 1})")
  return jnp.asarray(table, jnp.int32)


def _prepare_paged(q, k_pages, v_pages, page_table, kv_lengths, *, levels=(), causal=True,
                   scale=None, impl="auto", return_lse=False, config=None, alibi_slopes=None,
                   softcap=None, local_window_size=None) -> _Call:
  fn = "paged_attention"
  b, _, hq, d = _check_query(fn, q)
  _checks.check_rank(fn, "k_pages", k_pages, 4, "[pages, page_size, Hkv, D]")
  _checks.check_kv_pair(fn, "k_pages", k_pages, "v_pages", v_pages)
  pages, page_size, hkv, kd = k_pages.shape
  _checks.check_same(fn, "the head dims (last axis)", q=d, k_pages=kd)
  _checks.check_heads(fn, "q", hq, "k_pages", hkv)
  _checks.check_float_dtypes(fn, q=q, k_pages=k_pages, v_pages=v_pages)
  table = _check_table(fn, "page_table", page_table, "[B, O]", b, pages)
  lengths = _checks.lengths_array(fn, "kv_lengths", kv_lengths, (b,), table.shape[1] * page_size,
                                  "page_table.shape[1] * page_size")
  if isinstance(levels, PagedLevel):
    levels = [levels]
  parts = []
  for i, level in enumerate(levels):
    name = f"levels[{i}]"
    if not isinstance(level, PagedLevel):
      raise TypeError(f"{fn}: {name} must be a PagedLevel; got {type(level).__name__}")
    t = _check_table(fn, f"{name}.page_table", level.page_table, "[S, P]", None, pages)
    if t.shape[0] < 1:
      raise ValueError(f"{fn}: {name}.page_table must hold at least one segment (S >= 1)")
    seg_lengths = _checks.lengths_array(fn, f"{name}.lengths", level.lengths, (t.shape[0],),
                                        t.shape[1] * page_size,
                                        f"{name}.page_table.shape[1] * page_size")
    nodes = _check_level_nodes(fn, name, "segment_of_seq", level.segment_of_seq, b, t.shape[0])
    parts.append((t, seg_lengths, nodes))
  scale = _checks.check_scale(fn, scale, d)
  mods = _variants(fn, q, alibi_slopes, softcap, local_window_size)
  return _Call(fn, q, parts, k_pages, v_pages, lengths, bool(causal), scale, impl, config,
               return_lse, page_table=table, mods=mods)


def _check_level_nodes(fn: str, name: str, field: str, nodes, b: int, n: int) -> Array:
  if not hasattr(nodes, "dtype") or not jnp.issubdtype(nodes.dtype, jnp.integer):
    raise TypeError(f"{fn}: {name}.{field} must be an integer array [B]; got "
                    f"{getattr(nodes, 'dtype', type(nodes).__name__)}")
  if tuple(nodes.shape) != (b,):
    raise ValueError(f"{fn}: {name}.{field} must have shape [{b}] (one entry per sequence); "
                     f"got {_checks.shape_str(nodes.shape)}")
  if _checks.is_concrete(nodes) and nodes.size:
    host = np.asarray(nodes)
    lo, hi = int(host.min()), int(host.max())
    if lo < -1 or hi >= n:
      raise ValueError(f"{fn}: {name}.{field} must lie in [-1, {n - 1}] (N = {n} segments); "
                       f"got values in [{lo}, {hi}]")
  return jnp.asarray(nodes, jnp.int32)


def _execute_paged(plan: dispatch.Plan, call: _Call):
  """Runs a paged plan: the family's paged entry (or its primitives on the gathered pages),
  forward only."""
  ops = ops_lib.executor(plan, call.config, forward_only=True)
  paged = ops.paged_attention
  if paged is None:
    paged = functools.partial(ops_lib.gathered_paged_attention, ops=ops)

  @jax.custom_vjp
  def run(q, k_pages, v_pages, parts, table, lengths, mods):
    extra = {} if mods is None else {"mods": mods}
    return paged(q, k_pages, v_pages, parts, table, lengths, causal=call.causal,
                 scale=call.scale, **extra)

  def no_backward(*_):
    raise ValueError("paged_attention is forward only (it serves page pools); differentiate "
                     "hierarchical_attention over contiguous buffers instead")

  run.defvjp(lambda *args: (run(*args), None), no_backward)
  out, lse = run(call.q, call.suffix_k, call.suffix_v, call.parts, call.page_table, call.lengths,
                 call.mods)
  out = out.astype(call.q.dtype)
  return (out, lse) if call.return_lse else out


_PREPARE = types.MappingProxyType({attention_with_lse: _prepare_full,
                                   shared_prefix_attention: _prepare_prefix,
                                   hierarchical_attention: _prepare_tree,
                                   paged_attention: _prepare_paged})


def explain(fn: Callable, *args, platform: Optional[str] = None,
            device_kind: Optional[str] = None, **kwargs) -> dispatch.Plan:
  """The plan ``fn(*args, **kwargs)`` would run, and why, without running it.

  ``fn`` is :func:`attention_with_lse`, :func:`shared_prefix_attention`,
  :func:`hierarchical_attention` or :func:`paged_attention`; the arguments are the call's own (arrays or
  ``jax.ShapeDtypeStruct``s; ``impl=`` and ``config=`` included). ``platform`` ("cpu", "gpu",
  "tpu"; None: the default backend) and ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``,
  ``"TPU v5 lite"``; None: the default device's) let a CPU show what a GPU or TPU would run.

  Example:
    >>> plan = explain(shared_prefix_attention, q, pk, pv, sk, sv, platform="gpu",
    ...                device_kind="NVIDIA H100 80GB HBM3")
    >>> print(plan)  # the kernel path (flat / fused_decode / split), configs and reasons
  """
  if fn not in _PREPARE:
    raise ValueError(f"explain: fn must be attention_with_lse, shared_prefix_attention, "
                     f"hierarchical_attention or paged_attention; got "
                     f"{getattr(fn, '__name__', fn)!r}")
  found = []
  # Array keywords (the lengths, the levels) are traced like the positional arguments.
  def is_array_tree(v):  # an array, or a pytree of arrays such as a list of levels
    leaves = jax.tree.leaves(v)
    return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)

  arrays = {k: v for k, v in kwargs.items() if is_array_tree(v)}
  static = {k: v for k, v in kwargs.items() if k not in arrays}

  def trace(xs, kw):
    call = _PREPARE[fn](*xs, **kw, **static)
    found.append(_plan(call, platform=platform, device_kind=device_kind))
    return 0

  jax.eval_shape(trace, args, arrays)  # shapes only: nothing runs
  return found[0]
