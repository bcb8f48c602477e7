"""The engine's log-probabilities on the tiny model (float32, CPU): every returned log-prob
and top-k equals ``log_softmax`` of the plain model's logits (a full forward over prompt and
generated tokens, no cache, in float64 after the model), for greedy and seeded sampled
requests, alone and among other requests (other rows, shared levels, the other program)."""

import numpy as np
import pytest
from test_engine import SETTINGS, _forward_fn, config, model  # noqa: F401

from models.serving import Engine, EngineConfig, Request, TokenLogprobs

TOL = 3e-6  # float32 at log-probs near -5: the paged cascade against the plain forward


@pytest.fixture(scope="module")
def logits_of(model):
  forward = _forward_fn(model)  # test_engine's oracle: a full causal forward, no cache

  def logits(tokens, first: int):  # [T - first, V] float64: the logits after tokens[first:]
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.stack([np.asarray(forward(padded, p), np.float64)
                     for p in range(first, len(tokens))])

  return logits


def log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check(logits_of, request: Request, output) -> None:
  """``output``'s log-probs against the oracle, sample by sample."""
  for sample in output.samples:
    assert len(sample.logprobs) == len(sample.token_ids)
    tokens = list(request.prompt) + list(sample.token_ids)
    oracle = log_softmax(logits_of(tokens[:-1], len(request.prompt) - 1))
    for j, (tok, lp) in enumerate(zip(sample.token_ids, sample.logprobs)):
      assert isinstance(lp, TokenLogprobs) and isinstance(lp.logprob, float)
      assert abs(lp.logprob - oracle[j, tok]) <= TOL, (j, lp.logprob, oracle[j, tok])
      if request.temperature == 0:  # greedy: the most likely token (up to float32 ties)
        assert oracle[j, tok] >= oracle[j].max() - 2 * TOL
      m = request.top_logprobs
      assert len(lp.top) == m
      if not m:
        continue
      ids, values = np.asarray([t for t, _ in lp.top]), np.asarray([v for _, v in lp.top])
      order = np.argsort(-oracle[j], kind="stable")[:m]  # jax.lax.top_k's order
      np.testing.assert_allclose(values, oracle[j, order], rtol=0, atol=TOL)
      np.testing.assert_allclose(oracle[j, ids], values, rtol=0, atol=TOL)  # each id's own
      gaps = np.diff(np.sort(oracle[j])[::-1][:m + 1])
      if np.all(np.abs(gaps) > 2 * TOL):  # no near-tie: the very ids
        np.testing.assert_array_equal(ids, order)
      assert list(values) == sorted(values, reverse=True)


def requests(rng):
  system = rng.integers(0, 256, 9).tolist()
  question = lambda: system + rng.integers(0, 256, int(rng.integers(1, 5))).tolist()
  seed = lambda: int(rng.integers(0, 2**31))
  return [
      Request(question(), max_tokens=6, logprobs=True, top_logprobs=5),  # greedy
      Request(question(), n=2, max_tokens=5, temperature=0.8, top_p=0.9, seed=seed(),
              logprobs=True, top_logprobs=20),
      Request(rng.integers(0, 256, 7).tolist(), max_tokens=4, temperature=1.0, top_k=40,
              seed=seed(), logprobs=True),  # the sampled token's log-prob only
  ]


def test_logprobs_equal_the_plain_models_alone_and_among_others(model, logits_of):
  rng = np.random.default_rng()
  engine = Engine(model, config=config(), settings=SETTINGS)
  reqs = requests(rng)
  alone = []
  for r in reqs:  # alone: a call with top-k only for the rows that ask
    alone += engine.generate([r])
    check(logits_of, r, alone[-1])
  noise = [Request(list(r.prompt[:9]) + [int(t)], max_tokens=5, temperature=0.7, seed=int(t))
           for r, t in zip(reqs, rng.integers(0, 256, 3))]
  outs = engine.generate(noise + reqs)  # together: shared levels, every row in the top-k call
  assert engine.stats()["cascade_calls"] > 0
  assert all(o.samples[0].logprobs is None for o in outs[:3])
  for r, out, first in zip(reqs, outs[3:], alone):
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in first.samples]
    check(logits_of, r, out)


def test_streamed_logprobs_are_aligned_with_the_tokens(model):
  engine = Engine(model, config=config(), settings=SETTINGS)
  request = Request([3, 1, 4, 1, 5, 9, 2, 6], n=2, max_tokens=7, temperature=1.0, seed=7,
                    logprobs=True, top_logprobs=2)
  handle = engine.submit(request)
  ids, lps = [[], []], [[], []]
  while not handle.done:
    engine.step()
    new = handle.take_logprobs()
    for i, (t, lp) in enumerate(new or ()):
      assert len(t) == len(lp)
      ids[i] += t
      lps[i] += lp
  for i, sample in enumerate(handle.output.samples):
    assert tuple(ids[i]) == sample.token_ids and tuple(lps[i]) == sample.logprobs
    assert all(lp.top[0][1] >= lp.logprob for lp in lps[i])
  plain = engine.submit(Request([3, 1, 4], max_tokens=2))
  engine.step()
  assert all(lp is None for _, lp in plain.take_logprobs())
  assert plain.result().samples[0].logprobs is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=1), "logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_logprob_requests_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"Request: {field}="):
    Request([1, 2], **kwargs)


def test_top_logprobs_beyond_the_engines_max_are_refused(model):
  with pytest.raises(ValueError, match="max_logprobs=21"):
    EngineConfig(max_logprobs=21)
  with pytest.raises(ValueError, match="max_logprobs=-1"):
    EngineConfig(max_logprobs=-1)
  engine = Engine(model, config=config(max_logprobs=0), settings=SETTINGS)
  with pytest.raises(ValueError, match="top_logprobs=1 exceeds EngineConfig.max_logprobs=0"):
    engine.submit(Request([1, 2], logprobs=True, top_logprobs=1))
  (out,) = engine.generate([Request([1, 2], max_tokens=2, logprobs=True)])
  assert [len(lp.top) for lp in out.samples[0].logprobs] == [0, 0]
