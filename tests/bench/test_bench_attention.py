"""`python -m models.bench attention` runs end to end on a CPU (tiny sizes)."""

import json
import os

import jax
import pytest

from models.bench import attention
from jax_shared_attn.iomodel import AttentionShape
from jax_shared_attn.testing import tolerance


@pytest.mark.parametrize("variant", ["none", "alibi", "window:20"])
def test_attention_benchmark_tiny(tmp_path, monkeypatch, variant):
  if jax.default_backend() == "cpu":  # "auto" is the XLA path here: time the kernels instead
    ours = attention.ours
    monkeypatch.setattr(attention, "ours", lambda impl="auto", config=None, variant=None: ours(
        "pallas:triton" if impl == "auto" else impl, config, variant))
  rows = attention.main(["--batch", "2", "--prefix", "40", "--suffix", "8", "--shapes", "paper",
                         "--impls", "ours,xla,cudnn", "--trials", "1", "--out", str(tmp_path),
                         "--ceiling-bytes", str(2**22), "--matmul-n", "128",
                         "--variant", variant])
  assert len(rows) == 1 and isinstance(rows[0]["ours_us"], float)
  assert rows[0]["err_xla"] <= 2 * tolerance("bfloat16")  # two bf16 results of one function
  data = json.load(open(os.path.join(tmp_path, "attention.json")))
  assert data["info"]["variant"] == variant
  assert data["info"]["bandwidth_GBps"] > 0 and data["info"]["matmul_TFLOPs"] > 0
  assert os.path.getsize(os.path.join(tmp_path, "attention.png")) > 0


def test_variant_specs():
  assert attention.parse_variant("softcap:30") == {"softcap": 30.0}
  assert attention.parse_variant("window:128") == {"local_window_size": 128}
  assert attention.parse_variant("none") == {}
  for bad in ("softcap", "window:", "alibi:2", "gelu"):
    with pytest.raises(ValueError, match="--variant"):
      attention.parse_variant(bad)
  with pytest.raises(SystemExit) as e:
    attention.main(["--variant", "softcap"])
  assert e.value.code == 2


def test_io_model_matches_the_paper_floor():
  """B=1024, P=16384, S=128, 8/1 heads, D=128, bf16: FLOPs 69.2 G -> 87 us at ~800 TFLOP/s."""
  s = AttentionShape(1024, 16384, 128, 8, 1, 128)
  assert s.flops() == 4 * 1024 * 8 * (16384 + 128) * 128
  assert abs(s.floor_s(3.0e12, 795e12) * 1e6 - 87.0) < 1.0
  assert s.per_sequence_bytes() > 90 * s.shared_bytes()


def test_compare_variants_rows_and_json(tmp_path, capsys):
  """The development comparison: one row per configuration, every op timed, outputs checked
  against the first op's, the floor where ceilings are given, JSON and a Markdown table."""
  import jax.numpy as jnp

  from jax_shared_attn import shared_prefix_attention
  from models.bench.attention import compare_variants
  ops = {"xla": lambda q, pk, pv, sk, sv: shared_prefix_attention(q, pk, pv, sk, sv, impl="xla"),
         "off": lambda q, pk, pv, sk, sv: jnp.zeros_like(q)}
  path = str(tmp_path / "c.json")
  rows = compare_variants(ops, "paper:2:64:8,llama:1:32:4", trials=1, out_json=path,
                          ceilings=(1e12, 1e14))
  assert [(r["shape"], r["B"], r["P"], r["S"]) for r in rows] == [("paper", 2, 64, 8),
                                                                   ("llama", 1, 32, 4)]
  assert all(isinstance(r["xla"], float) and r["floor_us"] > 0 for r in rows)
  assert all(r["err_off"] == 1.0 for r in rows)  # an all-zero output is 100% off
  assert json.load(open(path))["rows"][1]["shape"] == "llama"
  assert "| shape | B | P | S | xla | off | floor_us |" in capsys.readouterr().out
