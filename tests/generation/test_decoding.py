"""Decoding behaviour users rely on: EOS per sample, the kernel paths, 16-bit models, prompt trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn.ops import resolve
from jax_shared_attn.testing import check_rows, tolerance
from models.generation.loop import PAD_ID, decode, generate, prefill
from models.model.config import preset
from models.model.llama import random_init
from strategies import count_case, small_jit

NEW = 8


@pytest.fixture(scope="module")
def tiny():
  config = preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16)
  return random_init(config, seed=3, std=0.12)


def tokens(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def runnable(impl):
  try:
    resolve(impl, "test")
    return True
  except ValueError:
    return False


def test_eos_at_different_steps_pads_each_row_after_its_own_eos(tiny):
  """Rows reach EOS at different steps: each row keeps its tokens up to its own EOS, then
  padding, and the loop stops once every row is done (sampled rows); rows come back in the
  caller's order, prompt by prompt, although the tree decodes them grouped by segment."""
  shared = tokens(18, 1)
  prompts = [shared + [4, 5], shared[:7], shared + [9]]
  kw = dict(num_samples=[2, 3, 2], max_new_tokens=NEW, temperature=1.0, seed=11)
  free = np.asarray(generate(tiny, prompts, **kw))
  firsts = {t: [int(np.argmax(r == t)) if (r == t).any() else NEW for r in free]
            for t in np.unique(free)}
  eos = max(firsts, key=lambda t: (len(set(firsts[t])), -max(firsts[t])))
  first = np.array(firsts[eos])
  assert len(set(first.tolist())) >= 3, first  # the rows end at several different steps
  state = decode(tiny, prefill(tiny, prompts, num_samples=kw["num_samples"], max_new_tokens=NEW,
                               seed=11), temperature=1.0, eos_id=int(eos))
  out = np.asarray(state.completions())
  for row, (f, o, n) in enumerate(zip(free, out, first)):
    np.testing.assert_array_equal(o[:n + 1], f[:n + 1], err_msg=f"row {row}")
    assert (o[n + 1:] == PAD_ID).all(), (row, o)
  assert int(state.step) == min(NEW, first.max() + 1)
  # The caller's order, greedy: each prompt's rows equal that prompt decoded alone with the
  # same EOS (taken from prompt 0's tokens, so its rows stop early and others later or never).
  counts = kw["num_samples"]
  eos = int(np.asarray(generate(tiny, prompts[0], max_new_tokens=3))[0, 2])
  out = np.asarray(generate(tiny, prompts, num_samples=counts, max_new_tokens=NEW, eos_id=eos))
  ends, row = set(), 0
  for prompt, n in zip(prompts, counts):
    alone = np.asarray(generate(tiny, prompt, max_new_tokens=NEW, eos_id=eos))[0]
    np.testing.assert_array_equal(out[row:row + n], np.broadcast_to(alone, (n, NEW)))
    ends.add(int(np.argmax(alone == PAD_ID)) if (alone == PAD_ID).any() else NEW)
    row += n
  assert len(ends) >= 2, ends


@pytest.mark.parametrize("impl", ["pallas:triton", "pallas:tpu", "auto"])
def test_generate_on_the_kernel_paths_gives_the_xla_tokens(tiny, impl):
  """Greedy tokens of two prompts sharing a tree of segments, on the kernels (interpreted on
  a CPU, native on their device), equal impl="xla"'s."""
  if not runnable(impl):
    pytest.skip(f"impl={impl!r} does not run on {jax.default_backend()}")
  shared = tokens(17, 2)
  prompts = [shared + [3, 1, 4], shared + [1, 5]]
  kw = dict(num_samples=[2, 1], max_new_tokens=4)
  want = np.asarray(generate(tiny, prompts, impl="xla", **kw))
  got = np.asarray(generate(tiny, prompts, impl=impl, **kw))
  np.testing.assert_array_equal(got, want, err_msg=impl)


def step_logits(model, prompts, counts, feed, attention, impl):
  """Each decode step's logits ``[steps, B, V]`` (float32) with the given tokens fed."""
  state = prefill(model, prompts, num_samples=counts, max_new_tokens=feed.shape[1],
                  attention=attention, impl=impl)
  order = np.asarray(state.sample_ids)  # decode order -> caller's row
  cache, toks, out = state.cache, state.tokens, []
  step = small_jit(lambda m, t, c: m(t[:, None], cache=c, impl=impl))
  for i in range(feed.shape[1]):
    logits, cache = step(model, toks, cache)
    out.append(np.asarray(logits[:, 0], np.float32)[np.argsort(order)])
    toks = jnp.asarray(feed[order, i])
  return np.stack(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_decoding_hydragen_equals_standard_per_step(tiny, dtype, impl):
  """bf16 (the CLI's default) and fp16 (the notebooks' on a T4): every step's logits of the
  hydragen cache against the standard one's, fed the same tokens, per sequence. The paths
  differ only in how attention's rounding falls: each is within the dtype's tolerance of exact
  attention, so they are within twice it of each other."""
  from models.checkpoints.loading import cast
  model = cast(tiny, dtype)
  shared = tokens(21, 3)
  prompts, counts = [shared + [8, 8], shared + [2]], [3, 2]
  feed = np.asarray(generate(model, prompts, num_samples=counts, max_new_tokens=4, impl=impl))
  hyd = step_logits(model, prompts, counts, feed, "hydragen", impl)
  std = step_logits(model, prompts, counts, feed, "standard", impl)
  for i in range(feed.shape[1]):
    check_rows(hyd[i], std[i], 2 * tolerance(dtype), what=f"{dtype} step {i}")
  assert np.abs(hyd - std).max() > 0  # really two computations


@settings(max_examples=4)
@given(data=st.data())
def test_generate_over_random_prompt_trees_equals_each_prompt_alone(tiny, data):
  """Random trees of shared text (a root, branches, leaves; repeats and prompts that are
  prefixes of others): every row equals its prompt decoded alone, in the caller's order."""
  count_case("generate_prompt_tree")
  root = data.draw(st.lists(st.integers(0, 255), min_size=0, max_size=20), label="root")
  branches = [root + data.draw(st.lists(st.integers(0, 255), max_size=18), label="branch")
              for _ in range(data.draw(st.integers(1, 3)))]
  prompts = [data.draw(st.sampled_from(branches)) + data.draw(
      st.lists(st.integers(0, 255), max_size=5), label="leaf") for _ in range(
          data.draw(st.integers(1, 4)))]
  prompts = [p or [7] for p in prompts]
  counts = [data.draw(st.integers(1, 2)) for _ in prompts]
  out = np.asarray(generate(tiny, prompts, num_samples=counts, max_new_tokens=3))
  row = 0
  for prompt, n in zip(prompts, counts):
    alone = np.asarray(generate(tiny, prompt, num_samples=1, max_new_tokens=3, attention="standard"))
    np.testing.assert_array_equal(out[row:row + n], np.broadcast_to(alone, (n, 3)),
                                  err_msg=f"prompts {prompts}")
    row += n
