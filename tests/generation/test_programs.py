"""Stored programs (models.generation.programs): the same tokens, loaded without tracing, never stale."""

import json
import os

import jax
import numpy as np
import pytest

from models.generation import programs as programs_lib
from models.generation.loop import decode, generate, prefill
from models.generation.programs import ProgramStore
from models.model.config import preset
from models.model.llama import random_init

SAMPLED = dict(temperature=0.8, top_p=0.9)
# The store's mechanics on the portable path: on a GPU or TPU impl="auto" runs Pallas kernels,
# whose custom calls jax.export refuses (test_programs_with_custom_kernels_run_without_the_store).
IMPL = "xla"


@pytest.fixture(scope="module")
def tiny():
  return random_init(preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16), seed=3,
                     std=0.12)


def prompt():
  return [int(t) for t in np.random.default_rng(0).integers(0, 256, 21)]


def stored_tokens(model, store, steps=(3, None), **kw):
  """prefill + decode in ``steps`` calls through ``store``."""
  sampling = dict(SAMPLED, **kw)
  state = prefill(model, prompt(), num_samples=3, max_new_tokens=8, seed=1, programs=store, impl=IMPL)
  for n in steps:
    state = decode(model, state, n, programs=store, impl=IMPL, **sampling)
  return np.asarray(state.completions())


def test_stored_programs_give_the_tokens_of_the_plain_path_and_load_in_a_new_process(tiny,
                                                                                     tmp_path):
  plain = np.asarray(generate(tiny, prompt(), num_samples=3, max_new_tokens=8, seed=1, impl=IMPL,
                            **SAMPLED))
  store = ProgramStore(str(tmp_path))
  np.testing.assert_array_equal(stored_tokens(tiny, store), plain)
  assert (store.loaded, store.exported) == (0, 2)  # prefill and decode, each traced once
  assert sorted(f.split("-")[0] for f in os.listdir(tmp_path) if f.endswith(".jaxexport")) == [
      "decode", "prefill"]
  again = ProgramStore(str(tmp_path))  # what a second process sees
  np.testing.assert_array_equal(stored_tokens(tiny, again, steps=(None,)), plain)
  # The decode program followed the prefill: it was read while the prefill ran.
  assert (again.loaded, again.exported, again.preloaded) == (2, 0, 1)
  assert again.summary() == "2 programs loaded (1 read ahead), none traced"


def test_a_missing_damaged_or_stale_read_ahead_costs_nothing_but_the_read(tiny, tmp_path):
  plain = stored_tokens(tiny, ProgramStore(str(tmp_path)))
  index = tmp_path / programs_lib.NEXT_INDEX
  # The decode program's files: its exported program, and its executable where it was compiled
  # here (not taken from XLA's persistent cache).
  decode_files = [f for f in tmp_path.iterdir() if f.name.startswith("decode-")]
  good = {f: f.read_bytes() for f in decode_files}

  def damage():
    for f in decode_files:
      f.write_bytes(b"not a program")

  def remove():
    for f in decode_files:
      f.unlink()

  cases = {"index damaged": lambda: index.write_text("{not json"),
           "index empty": lambda: index.write_text("{}"),
           "index of other types": lambda: index.write_text(json.dumps(
               {k: {"key": [1], "donated": ["a"]} for k in json.loads(index.read_text())})),
           "program files damaged": damage,
           "program files gone": remove}
  for case, spoil in cases.items():
    for f, data in good.items():
      f.write_bytes(data)
    spoil()
    store = ProgramStore(str(tmp_path))
    np.testing.assert_array_equal(stored_tokens(tiny, store), plain, err_msg=case)
    assert store.preloaded == 0, case
    assert store.loaded + store.exported == 2, case
    # Whatever happened, the store knows again what follows the prefill.
    assert list(programs_lib.ProgramStore(str(tmp_path))._index().values())[0]["key"].startswith(
        "decode-"), case


def test_a_named_run_loads_the_executables_of_its_last_run_ahead(tmp_path):
  """begin(name): the programs the last run of that name called load in the background before
  they are called, from their executables (the exported programs are not needed)."""
  # A config of its own (a random rope_theta): programs that no earlier test compiled, so XLA
  # compiles them here (an executable from XLA's persistent cache cannot be written again).
  theta = 1000.0 + float(np.random.default_rng().integers(1, 10**6))
  model = random_init(preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16,
                                             rope_theta=theta), seed=3, std=0.12)
  plain = np.asarray(generate(model, prompt(), num_samples=3, max_new_tokens=8, seed=1,
                              impl=IMPL, **SAMPLED))
  first = ProgramStore(str(tmp_path))
  first.begin("a run")
  np.testing.assert_array_equal(stored_tokens(model, first), plain)
  executables = sorted(f.split("-")[0] for f in os.listdir(tmp_path)
                       if f.endswith(programs_lib.EXECUTABLE_SUFFIX))
  assert executables == ["decode", "prefill"]
  for f in os.listdir(tmp_path):
    if f.endswith(programs_lib.SUFFIX):
      os.remove(tmp_path / f)  # only the executables are left to load
  again = ProgramStore(str(tmp_path))
  again.begin("a run")
  assert len(again._pending) == 2  # both started before any call
  np.testing.assert_array_equal(stored_tokens(model, again, steps=(None,)), plain)
  assert (again.loaded, again.exported, again.preloaded) == (2, 0, 2)
  other = ProgramStore(str(tmp_path))
  other.begin("another run")  # nothing known about it: nothing read ahead
  assert not other._pending
  # A damaged executable: the program is traced again (its exported program is gone too).
  for f in os.listdir(tmp_path):
    if f.startswith("prefill-"):
      (tmp_path / f).write_bytes(b"not an executable")
  damaged = ProgramStore(str(tmp_path))
  np.testing.assert_array_equal(stored_tokens(model, damaged, steps=(None,)), plain)
  assert (damaged.loaded, damaged.exported) == (1, 1)


def test_the_stored_decode_program_donates_the_state(tiny, tmp_path):
  store = ProgramStore(str(tmp_path))
  state = prefill(tiny, prompt(), num_samples=3, max_new_tokens=8, programs=store, impl=IMPL)
  state = jax.device_put(state, jax.devices()[0])
  cache_k = state.cache.k[0]
  out = decode(tiny, state, 2, programs=store, impl=IMPL, **SAMPLED)
  assert cache_k.is_deleted()  # updated in place, as without the store
  assert int(out.step) == 2


def test_a_changed_model_sampler_setting_code_or_flag_is_another_program(tiny, tmp_path, monkeypatch):
  store = ProgramStore(str(tmp_path))
  stored_tokens(tiny, store)
  assert store.exported == 2
  # Same shapes, another config value: new programs, and that model's own tokens.
  other = random_init(tiny.config.replace(rope_theta=500.0), seed=3, std=0.12)
  plain = np.asarray(generate(other, prompt(), num_samples=3, max_new_tokens=8, seed=1,
                              impl=IMPL, **SAMPLED))
  np.testing.assert_array_equal(stored_tokens(other, store), plain)
  assert store.exported == 4
  # Another static sampler setting: a new decode program (the prefill one is reused).
  stored_tokens(tiny, store, top_p=0.5)
  assert store.exported == 5
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".jaxexport")]) == 5
  assert store.loaded == 0
  # Changed code, a changed jax flag, another shape: other keys (so other files).
  args = [np.zeros(2, np.float32)]
  key = store.key("decode", (), args)
  assert key != store.key("decode", (), [np.zeros(3, np.float32)])
  with jax.numpy_rank_promotion("warn"):
    assert key != store.key("decode", (), args)
  monkeypatch.setattr(programs_lib, "code_fingerprint", lambda: "edited")
  assert key != store.key("decode", (), args)


def test_a_damaged_program_file_is_traced_again(tiny, tmp_path):
  stored_tokens(tiny, ProgramStore(str(tmp_path)))
  for name in os.listdir(tmp_path):
    with open(tmp_path / name, "wb") as f:
      f.write(b"not a program")
  store = ProgramStore(str(tmp_path))
  plain = np.asarray(generate(tiny, prompt(), num_samples=3, max_new_tokens=8, seed=1, impl=IMPL,
                            **SAMPLED))
  np.testing.assert_array_equal(stored_tokens(tiny, store), plain)
  assert (store.loaded, store.exported) == (0, 2)


def test_programs_with_custom_kernels_run_without_the_store(tiny, tmp_path, monkeypatch):
  """jax.export refuses custom calls (the GPU kernels): such a program runs as before."""
  def refuse(*a, **k):
    raise ValueError("Cannot serialize code with custom calls whose targets have no guarantees")
  monkeypatch.setattr(jax.export, "export", lambda fn, **k: refuse)
  store = ProgramStore(str(tmp_path))
  plain = np.asarray(generate(tiny, prompt(), num_samples=3, max_new_tokens=8, seed=1, impl=IMPL,
                            **SAMPLED))
  np.testing.assert_array_equal(stored_tokens(tiny, store), plain)
  assert (store.loaded, store.exported, store.unstorable) == (0, 0, 2)
  assert "2 not storable" in store.summary() and not os.listdir(tmp_path)


def test_store_path_errors_name_the_argument():
  with pytest.raises(ValueError, match="path"):
    ProgramStore("")
