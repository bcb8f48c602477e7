"""The engine's persistent compilation cache: a second process loads every program the first
one compiled (tiny model, two subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from models.generation.settings import GenerationSettings
from models.model.config import preset
from models.model.llama import random_init
from models.serving import Engine, EngineConfig, Request

config = EngineConfig(page_size=4, num_pages=32, max_running=4, max_prefill_tokens=8,
                      decode_steps=2, min_shared_tokens=4, batch_buckets=(4,),
                      prefill_row_buckets=(4,),
                      prefill_buckets=(8,), level_buckets=(1,), segment_buckets=(1,),
                      page_buckets=(2,), own_page_buckets=(4,))
model = random_init(preset("tiny").replace(max_position_embeddings=16), seed=0)
engine = Engine(model, config=config, settings=GenerationSettings(impl="xla"),
                compile_cache=sys.argv[1])
programs = engine.warmup()
out = engine.generate([Request(list(range(1, 10)), n=2, max_tokens=3, temperature=1.0,
                               top_k=5, seed=3, ignore_eos=True, logprobs=True,
                               top_logprobs=2)])
stats = engine.stats()
print(json.dumps(dict(programs=programs, hits=stats["compile_cache_hits"],
                      requests=stats["compile_cache_requests"],
                      tokens=[s.token_ids for s in out[0].samples],
                      logprobs=[[(lp.logprob, lp.top) for lp in s.logprobs]
                                for s in out[0].samples])))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_engines_programs_from_the_cache(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")

  def run():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

  first, second = run(), run()
  # prefill, decode with and without a level (each with and without top log-probs), copy
  assert first["programs"] == 1 + 2 * 2 + 1
  assert first["requests"] >= first["programs"] and first["hits"] == 0
  assert second["requests"] == first["requests"]
  assert second["hits"] == second["requests"]  # everything loaded, nothing compiled
  assert second["tokens"] == first["tokens"]
  assert second["logprobs"] == first["logprobs"]
