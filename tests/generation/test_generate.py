"""Generation: hydragen == standard == full-forward greedy; sharing trees; one jitted loop; capacity."""

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.generation import cache as cache_lib
from models.generation.loop import PAD_ID, decode, generate, lower_decode, prefill
from models.generation.prompt_tree import PromptTree
from models.model.config import preset
from models.model.llama import random_init

NEW = 12


def seg_width(n: int) -> int:
  """A one-segment level's buffer width for ``n`` tokens on this backend: rounded up to
  ``ops.segment_alignment`` (128 where the Hopper prefix kernel runs natively, else 1)."""
  from jax_shared_attn.ops import segment_alignment
  a = segment_alignment("auto")
  return -(-n // a) * a


@pytest.fixture(scope="module")
def tiny():
  config = preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16)
  return random_init(config, seed=3, std=0.12)


@functools.partial(nnx.jit, static_argnames="skip_attention")
def _last_logits(model, ids, lengths, skip_attention=False):
  # causal: the right padding is never seen by position lengths - 1
  logits = model(ids, skip_attention=skip_attention)
  return logits[jnp.arange(ids.shape[0]), lengths - 1]


def greedy_reference(model, prompt, n, skip_attention=False):
  """Greedy decoding by re-running the plain full forward (no cache) for every token."""
  seq = np.zeros((1, 64), np.int32)
  seq[0, :len(prompt)] = prompt
  length = len(prompt)
  for _ in range(n):
    logits = _last_logits(model, jnp.asarray(seq), jnp.asarray([length]), skip_attention)
    seq[0, length] = int(jnp.argmax(logits[0]))
    length += 1
  return seq[0, len(prompt):length]


def prompt_of(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_package_exports_resolve_to_the_api():
  import models
  sys.modules.pop("models.generate", None)  # imported before: no second warning
  with pytest.warns(DeprecationWarning, match="models.generate moved to models.generation.loop"):
    import models.generate  # the old module path: must not hide the function  # noqa: F401
  assert models.generate is generate and models.PAD_ID == PAD_ID == -1
  assert callable(models.from_pretrained) and models.PromptTree is PromptTree
  assert set(models.__all__) >= {"generate", "prefill", "decode", "from_pretrained", "preset"}


def test_hydragen_and_standard_equal_the_full_forward_greedy(tiny):
  prompt = prompt_of(19, 0)
  ref = greedy_reference(tiny, prompt, NEW)
  for attention, chunk in (("hydragen", None), ("standard", None), ("hydragen", 5)):
    out = np.asarray(generate(tiny, prompt, num_samples=3, max_new_tokens=NEW,
                              attention=attention, prefill_chunk=chunk))
    assert out.shape == (3, NEW) and out.dtype == np.int32
    np.testing.assert_array_equal(out, np.broadcast_to(ref, (3, NEW)), err_msg=attention)


def test_one_token_prompt_has_nothing_to_share(tiny):
  ref = greedy_reference(tiny, [5], 4)
  for attention in ("hydragen", "standard"):
    out = np.asarray(generate(tiny, [5], num_samples=2, max_new_tokens=4, attention=attention))
    np.testing.assert_array_equal(out, np.broadcast_to(ref, (2, 4)), err_msg=attention)


def test_multi_prompt_generation_equals_each_prompt_alone(tiny):
  shared = prompt_of(13, 1)
  prompts = [shared + [7, 9, 11, 2], shared + [5], shared[:6], shared + [7, 9, 11, 2],
             shared + [7, 9, 11, 2, 4, 4, 8]]  # a repeat, a prefix of others, a longer one
  counts = [2, 1, 1, 2, 1]
  out = np.asarray(generate(tiny, prompts, num_samples=counts, max_new_tokens=NEW))
  assert out.shape == (sum(counts), NEW)
  chunked = generate(tiny, prompts, num_samples=counts, max_new_tokens=NEW, prefill_chunk=4)
  np.testing.assert_array_equal(np.asarray(chunked), out)
  starts = np.cumsum([0] + counts)
  for prompt, n, row in zip(prompts, counts, starts):
    alone = greedy_reference(tiny, prompt, NEW)  # the plain forward, one prompt at a time
    np.testing.assert_array_equal(out[row:row + n], np.broadcast_to(alone, (n, NEW)))
  alone = np.asarray(generate(tiny, prompts[4], num_samples=1, max_new_tokens=NEW))
  np.testing.assert_array_equal(out[starts[4]], alone[0])


def test_two_level_tree_stores_each_segment_once(tiny):
  shared = prompt_of(20, 1)  # >= 16 tokens: detected as a segment of its own (models.generation.sharing)
  prompts = [shared + [7, 9, 11, 2], shared + [5, 6], shared + [7, 9, 11, 2]]
  state = prefill(tiny, prompts, num_samples=[4, 3, 2], max_new_tokens=NEW)
  per_token = cache_lib.kv_bytes_per_token(tiny.config)
  level0, level1 = state.cache.levels
  assert len(level0.k) == tiny.config.num_layers
  assert level0.k[0].shape[:2] == (1, seg_width(20))  # the common prefix, once
  assert level1.k[0].shape[:2] == (2, 3)  # two distinct remainders (prompt minus last token)
  np.testing.assert_array_equal(np.asarray(level0.lengths), [20])
  np.testing.assert_array_equal(np.asarray(level1.lengths), [3, 1])
  assert state.cache.shared_nbytes == (seg_width(20) + 2 * 3) * per_token
  assert state.cache.own_nbytes == 9 * NEW * per_token
  # Decode order groups each segment's samples; completions come back in the caller's order.
  nodes = np.asarray(level1.node_of_seq)
  assert list(nodes) == sorted(nodes)


def test_segment_buffers_padded_to_the_alignment_give_the_same_tokens(tiny, monkeypatch):
  """On Hopper one-segment levels are padded to 128-token blocks (the Mosaic prefix kernel
  streams whole blocks) and, where the one-kernel decode path runs, the own cache to 64; levels
  of several segments are not (the segment kernel takes any width: padding is only memory). The
  padding must never act as keys: same tokens."""
  import sys
  gen = sys.modules["models.generation.loop"]  # the module (the package exports a function of its name)
  shared = prompt_of(21, 1)
  prompts = [shared + [7, 9, 11, 2], shared + [5, 6]]
  plain_state = prefill(tiny, prompts, num_samples=[3, 2], max_new_tokens=NEW)
  assert [lv.k[0].shape[1] for lv in plain_state.cache.levels] == [seg_width(21), 3]
  assert plain_state.cache.k[0].shape[1] == NEW
  plain = np.asarray(generate(tiny, prompts, num_samples=[3, 2], max_new_tokens=NEW))
  monkeypatch.setattr(gen, "segment_alignment", lambda impl: 16)
  monkeypatch.setattr(gen, "suffix_alignment", lambda impl, rows_per_seq: 24)
  state = prefill(tiny, prompts, num_samples=[3, 2], max_new_tokens=NEW)
  assert [lv.k[0].shape[1] for lv in state.cache.levels] == [32, 3]
  assert state.cache.k[0].shape[1] == -(-NEW // 24) * 24
  padded = np.asarray(generate(tiny, prompts, num_samples=[3, 2], max_new_tokens=NEW))
  np.testing.assert_array_equal(padded, plain)


def test_alignment_only_where_the_mosaic_kernel_runs_natively():
  """Buffers are padded (segments to 128 tokens, own caches for G >= 8) exactly where the
  Hopper kernel runs natively, on any backend; every other path takes any width."""
  from jax_shared_attn.ops import IMPLS, resolve, segment_alignment, suffix_alignment
  for impl in IMPLS:
    try:
      name = resolve(impl, "test").name
    except ValueError:  # "pallas" needs a GPU or TPU
      name = None
    mosaic = jax.default_backend() == "gpu" and name == "pallas:mosaic_gpu"
    assert segment_alignment(impl) == (128 if mosaic else 1), impl
    assert suffix_alignment(impl, 1) == 1 and (suffix_alignment(impl, 8) > 1) == mosaic, impl


def test_suffix_alignment_on_hopper_only_where_the_one_kernel_runs(monkeypatch):
  """64 (the one kernel's suffix blocks) for G >= 8 on Hopper; 1 for G = 4, where the kernels
  run apart and padding would only cost memory."""
  from jax_shared_attn import ops
  monkeypatch.setattr(ops, "segment_alignment", lambda impl="auto": 128)
  assert [ops.suffix_alignment("auto", g) for g in (1, 4, 8, 16, 64)] == [1, 1, 64, 64, 64]


def test_hydragen_cache_holds_the_prompt_once(tiny):
  prompt, b = prompt_of(40, 2), 16
  per_token = cache_lib.kv_bytes_per_token(tiny.config)
  hyd = prefill(tiny, prompt, num_samples=b, max_new_tokens=NEW)
  std = prefill(tiny, prompt, num_samples=b, max_new_tokens=NEW, attention="standard")
  none = prefill(tiny, prompt, num_samples=b, max_new_tokens=NEW, attention="none")
  # the last token is fed by decode step 0; the buffer is padded to the backend's alignment
  assert hyd.cache.shared_nbytes == seg_width(39) * per_token
  np.testing.assert_array_equal(np.asarray(hyd.cache.levels[0].lengths), [39])
  assert hyd.cache.own_nbytes == b * NEW * per_token
  # standard: each sample's copy of the prompt buffer (its padding included), then the new tokens
  assert std.cache.shared_nbytes == 0
  assert std.cache.own_nbytes == b * (seg_width(39) + NEW) * per_token
  assert none.cache.nbytes == 0


def test_same_seed_same_tokens_on_every_path_and_in_chunks(tiny):
  prompts = [prompt_of(15, 4), prompt_of(15, 4)[:9] + [1, 2, 3]]
  kw = dict(num_samples=[3, 2], max_new_tokens=NEW, temperature=1.0, top_k=50, top_p=0.9)
  hyd = np.asarray(generate(tiny, prompts, seed=5, **kw))
  std = np.asarray(generate(tiny, prompts, seed=5, attention="standard", **kw))
  np.testing.assert_array_equal(hyd, std)
  np.testing.assert_array_equal(hyd, np.asarray(generate(tiny, prompts, seed=5, **kw)))
  assert len({tuple(r) for r in hyd}) > 1  # samples of one prompt differ
  assert not np.array_equal(hyd, np.asarray(generate(tiny, prompts, seed=6, **kw)))
  # Decoding in two calls (one compiled program, a runtime step count) changes nothing.
  sampling = {k: kw[k] for k in ("temperature", "top_k", "top_p")}
  state = prefill(tiny, prompts, num_samples=[3, 2], max_new_tokens=NEW, seed=5)
  state = decode(tiny, state, 5, **sampling)
  assert int(state.step) == 5
  state = decode(tiny, state, **sampling)
  np.testing.assert_array_equal(np.asarray(state.completions()), hyd)


def test_eos_pads_the_rest_and_ends_the_loop_early(tiny):
  prompt = prompt_of(19, 0)
  free = np.asarray(generate(tiny, prompt, num_samples=2, max_new_tokens=NEW))[0]
  eos = int(free[4])
  first = int(np.argmax(free == eos))
  state = prefill(tiny, prompt, num_samples=2, max_new_tokens=NEW)
  state = decode(tiny, state, eos_id=eos)
  out = np.asarray(state.completions())
  np.testing.assert_array_equal(out[:, :first + 1], np.broadcast_to(free[:first + 1], (2, first + 1)))
  assert (out[:, first + 1:] == PAD_ID).all()
  assert int(state.step) == first + 1  # the while loop stopped when every sample was done


def test_pad_id_fills_every_column_after_every_row_finished(tiny):
  """A finished row holds ``pad_id`` after its EOS, also in the columns the loop never ran
  because every row had finished (prefill's PAD_ID must not show through)."""
  prompt = prompt_of(19, 0)
  free = np.asarray(generate(tiny, prompt, num_samples=2, max_new_tokens=NEW))[0]
  eos = int(free[4])
  first = int(np.argmax(free == eos))
  assert first + 1 < NEW  # the loop stops early: some columns are never run
  out = np.asarray(generate(tiny, prompt, num_samples=2, max_new_tokens=NEW, eos_id=eos,
                            pad_id=0))
  np.testing.assert_array_equal(out[:, :first + 1],
                                np.broadcast_to(free[:first + 1], (2, first + 1)))
  assert (out[:, first + 1:] == 0).all(), out


def test_a_token_depends_on_the_sample_not_its_decode_row(tiny):
  """Samples 0-1 continue prompt A and 2-3 prompt B in both trees; listing B's segment first
  moves A's samples from decode rows 0-1 to rows 2-3. Keys drawn from the sample id give
  the same tokens; keys drawn from the decode row would not."""
  a, b = prompt_of(12, 1), prompt_of(12, 2)
  leaves_a_first = PromptTree(segments=((tuple(a[:-1]), tuple(b[:-1])),), parents=((-1, -1),),
                              leaves=((0, 0), (0, 0), (0, 1), (0, 1)),
                              last_tokens=(a[-1], a[-1], b[-1], b[-1]))
  leaves_b_first = PromptTree(segments=((tuple(b[:-1]), tuple(a[:-1])),), parents=((-1, -1),),
                              leaves=((0, 1), (0, 1), (0, 0), (0, 0)),
                              last_tokens=(a[-1], a[-1], b[-1], b[-1]))
  np.testing.assert_array_equal(leaves_a_first.decode_order(), [0, 1, 2, 3])
  np.testing.assert_array_equal(leaves_b_first.decode_order(), [2, 3, 0, 1])
  kw = dict(max_new_tokens=NEW, temperature=1.0, seed=11)
  one = np.asarray(generate(tiny, leaves_a_first, **kw))
  two = np.asarray(generate(tiny, leaves_b_first, **kw))
  assert len({tuple(r) for r in one}) == 4  # sampled: every sample's tokens differ
  np.testing.assert_array_equal(one, two)


def test_no_attention_mode_is_the_model_without_attention(tiny):
  """attention="none" skips every attention sublayer: its greedy tokens are the full forward's
  with ``skip_attention`` (no cache, no K/V)."""
  prompt = prompt_of(19, 0)
  out = np.asarray(generate(tiny, prompt, num_samples=2, max_new_tokens=NEW, attention="none"))
  np.testing.assert_array_equal(out, np.broadcast_to(
      greedy_reference(tiny, prompt, NEW, skip_attention=True), (2, NEW)))
  assert not np.array_equal(out[0], greedy_reference(tiny, prompt, NEW))


def test_capacity_and_argument_errors_name_the_argument(tiny):
  prompt = prompt_of(10, 0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    prefill(tiny, prompt, max_new_tokens=tiny.config.max_position_embeddings)
  with pytest.raises(ValueError, match="own_capacity"):
    prefill(tiny, prompt, max_new_tokens=8, own_capacity=7)
  with pytest.raises(ValueError, match="prompt_ids"):
    prefill(tiny, prompt + [256], max_new_tokens=4)
  with pytest.raises(ValueError, match="attention"):
    prefill(tiny, prompt, max_new_tokens=4, attention="flash")
  with pytest.raises(ValueError, match="num_samples"):
    prefill(tiny, [prompt, prompt], num_samples=[1, 2, 3], max_new_tokens=4)
  with pytest.raises(ValueError, match="top_p"):
    generate(tiny, prompt, num_samples=1, max_new_tokens=2, temperature=1.0, top_p=0.0)
  state = prefill(tiny, prompt, num_samples=2, max_new_tokens=4)
  with pytest.raises(ValueError, match="num_steps"):
    decode(tiny, state, 5)
  cache = cache_lib.empty(tiny.config, 2, 3)
  with pytest.raises(ValueError, match="capacity"):
    cache.write(0, jnp.zeros((2, 4, 2, 16)), jnp.zeros((2, 4, 2, 16)))


# -- the compiled decode program -----------------------------------------------------------------

# Distinct sizes so that the stacked caches [L, B, S, Hkv, D] are recognisable in the HLO.
L, B, NEW_BIG, HKV, D = 4, 7, 41, 1, 48


@pytest.fixture(scope="module")
def odd_model():
  config = preset("tiny").replace(num_layers=L, num_heads=4, num_kv_heads=HKV, head_dim=D)
  return random_init(config, seed=0)


def producers(hlo: str, shape: str) -> set[tuple[str, str]]:
  """(op, instruction name) of every instruction whose result has exactly ``shape``."""
  pattern = rf"%(\S+) = {re.escape(shape)}\{{[^}}]*\}} ([\w-]+)\("
  return {(op, name) for name, op in re.findall(pattern, hlo)}


def only_scattered_into(instructions) -> bool:
  """Buffers of this shape are parameters, loop plumbing or in-place scatters, nothing else."""
  plumbing = {"parameter", "get-tuple-element"}
  return all(op in plumbing or op == "scatter" or (op == "fusion" and "scatter" in name)
             for op, name in instructions)


def test_decode_loop_is_one_program_updating_the_cache_in_place(odd_model):
  state = prefill(odd_model, prompt_of(200, 0), num_samples=B, max_new_tokens=NEW_BIG)
  compiled = lower_decode(odd_model, state).compile()
  hlo = compiled.as_text()
  assert len(re.findall(r" while\(", hlo)) == 1  # every step inside one while loop
  assert "callback" not in hlo  # no host round trip per token
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  assert compiled.memory_analysis().alias_size_in_bytes >= state_bytes  # donated, aliased
  # Each layer's own cache [B, S, Hkv, D] is only ever scattered into in place (no copy,
  # no transpose, no rebuilt buffer); the shared prefix [1, P, Hkv, D] is never rewritten.
  own = producers(hlo, f"f32[{B},{NEW_BIG},{HKV},{D}]")
  assert only_scattered_into(own), own
  assert any(op == "scatter" for op, _ in own)
  shared = producers(hlo, f"f32[1,199,{HKV},{D}]")
  assert {op for op, _ in shared} <= {"parameter", "get-tuple-element"}, shared


def materialized(blocks: dict[str, str], shape: str) -> set[tuple[str, str]]:
  """:func:`producers` of ``shape`` whose result is a buffer: instructions of an unfused
  computation, and the results of fusions (their root, or the elements of a root tuple); inside
  a fusion, e.g. a concatenate of two weights that one matrix-product kernel reads, a value is
  never written to memory."""
  fused = {name for text in blocks.values()
           for name in re.findall(r" fusion\([^\n]*calls=%?([\w.-]+)", text)}
  made = set()
  for name, text in blocks.items():
    root = re.search(r"ROOT %([\w.-]+) = [^\n]*? (\w+)\(([^\n]*)", text)
    results = set()
    if root is not None:
      results.add(root.group(1))
      if root.group(2) == "tuple":
        results.update(re.findall(r"%([\w.-]+)", root.group(3)))
    for op, inst in producers(text, shape):
      if name not in fused or inst in results:
        made.add((op, inst))
  return made


def test_decode_loop_never_copies_a_weight(odd_model):
  """The projections read their weights where they lie: no step transposes one into a new buffer
  (XLA's CPU backend did so for the 3-D head projections, 1.6x the batch-8 step time). Only the
  loop body counts: a copy made once before the loop is not per step."""
  import itertools

  from models.parallel.hlo_collectives import loop_computations
  state = prefill(odd_model, prompt_of(20, 0), num_samples=B, max_new_tokens=NEW_BIG)
  hlo = lower_decode(odd_model, state, temperature=0.7, top_p=0.9).compile().as_text()
  blocks = loop_computations(hlo, condition=False)
  c = odd_model.config
  weights = [(c.num_heads, D, c.hidden_size), (HKV, D, c.hidden_size), (c.hidden_size, c.num_heads, D),
             (c.num_heads * D, c.hidden_size), (HKV * D, c.hidden_size),
             (c.intermediate_size, c.hidden_size), (c.vocab_size, c.hidden_size)]
  shapes = {p for w in weights for p in itertools.permutations(w)}
  made = {(op, name) for shape in shapes
          for op, name in materialized(blocks, "f32[" + ",".join(map(str, shape)) + "]")}
  assert {op for op, _ in made} <= {"parameter", "get-tuple-element", "bitcast"}, made


def test_the_in_place_check_can_fail(odd_model):
  """Without donation the same inspection sees the cache rebuilt as a new buffer."""
  state = prefill(odd_model, prompt_of(200, 0), num_samples=B, max_new_tokens=NEW_BIG)
  compiled = jax.jit(lambda c: [k * 2.0 for k in c.k]).lower(state.cache).compile()
  own = producers(compiled.as_text(), f"f32[{B},{NEW_BIG},{HKV},{D}]")
  assert not only_scattered_into(own), own


def test_progress_is_reported_every_k_steps_from_inside_the_loop(odd_model):
  seen = []
  state = prefill(odd_model, prompt_of(20, 0), num_samples=2, max_new_tokens=NEW_BIG)
  state = decode(odd_model, state, 20, progress=seen.append, progress_every=8)
  jax.block_until_ready(state)
  jax.effects_barrier()
  assert seen == [8, 16, 20]


def test_smollm2_greedy_hydragen_equals_standard_for_64_tokens():
  from models.checkpoints.loading import from_pretrained
  from model_checks import smollm2_gguf

  model, tokenizer, config = from_pretrained(smollm2_gguf())  # float32
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "Tell a short story about a robot who learns to paint."}])
  prompt, b, new = tokenizer.encode(text), 2, 64
  per_token = cache_lib.kv_bytes_per_token(config)
  tokens = {}
  for attention in ("hydragen", "standard"):
    state = prefill(model, prompt, num_samples=b, max_new_tokens=new, attention=attention)
    if attention == "hydragen":  # the prompt's K/V once, not once per sample
      assert state.cache.shared_nbytes == seg_width(len(prompt) - 1) * per_token
      assert state.cache.own_nbytes == b * new * per_token
    else:
      assert state.cache.own_nbytes == b * (seg_width(len(prompt) - 1) + new) * per_token
    tokens[attention] = np.asarray(decode(model, state).completions())
  np.testing.assert_array_equal(tokens["hydragen"], tokens["standard"])
  assert len(set(tokens["hydragen"][0].tolist())) > 16  # a real completion, not a loop
  assert tokenizer.decode(tokens["hydragen"][0]).strip()


class _Compiles:
  """Counts the programs JAX compiles while active (its ``jax_log_compiles`` log lines)."""

  def __init__(self):
    self.names = []

  def __enter__(self):
    import logging

    class Handler(logging.Handler):
      def emit(inner, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
          self.names.append(message.split()[1])

    self._handler, self._logger = Handler(), logging.getLogger("jax")
    self._level = self._logger.level
    self._logger.addHandler(self._handler)
    self._logger.setLevel(logging.DEBUG)
    self._flag = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    return self

  def __exit__(self, *exc):
    jax.config.update("jax_log_compiles", self._flag)
    self._logger.removeHandler(self._handler)
    self._logger.setLevel(self._level)


@pytest.mark.parametrize("attention", ["hydragen", "standard", "none"])
def test_decode_after_prefill_compiles_the_loop_once(tiny, attention):
  """The state ``decode`` returns is typed, shaped and placed as the one ``prefill`` returns:
  the first call compiles the decode loop and nothing else, later calls compile nothing."""
  model = tiny
  state = prefill(model, [[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 3, 5]], num_samples=[2, 1],
                  max_new_tokens=9, attention=attention)
  counts = []
  for _ in range(3):
    with _Compiles() as compiles:
      state = decode(model, state, 2)
    counts.append(compiles.names)
  assert len(counts[0]) == 1 and "_decode_loop" in counts[0][0], counts
  assert counts[1:] == [[], []], counts


@pytest.mark.parametrize("attention", ["hydragen", "none"])
def test_decode_calls_after_the_first_trace_nothing_and_do_not_walk_the_model(
    attention, monkeypatch):
  """A decode call's fixed cost: after the first, a call neither traces a program nor walks the
  model's graph (``nnx.split``; the split is kept per model), and yet sees weights changed in
  place between calls."""
  from models.bench.common import COMPILE, TRACE, counting_compiles

  model = random_init(preset("tiny"), seed=4)
  state = prefill(model, [[3, 1, 4, 1, 5, 9, 2, 6]], num_samples=2, max_new_tokens=9,
                  attention=attention)
  state = decode(model, state, 1)
  splits = []
  real_split = nnx.split
  monkeypatch.setattr(nnx, "split", lambda *a, **k: splits.append(1) or real_split(*a, **k))
  with counting_compiles((COMPILE, TRACE)) as events:
    for _ in range(2):
      state = decode(model, state, 1)
  assert events == [] and splits == [], (events, splits)
  # Weights changed in place: the next call reads them (the same tokens as a fresh model's).
  fresh = random_init(preset("tiny"), seed=5)
  nnx.update(model, nnx.state(fresh))
  copies = [jax.tree.map(jnp.copy, state) for _ in range(2)]  # decode donates its state
  a = decode(model, state, 3)
  b = decode(fresh, copies[0], 3)
  stale = decode(random_init(preset("tiny"), seed=4), copies[1], 3)
  np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
  assert not np.array_equal(np.asarray(stale.out), np.asarray(b.out))  # the check can fail
