"""hydragen bench sharded: the HLO collective count (models.parallel.hlo_collectives), the process
environments, the report.

(The benchmark itself runs on GPUs; a CPU run of its logic at a tiny size is in docs/multihost.md.)
"""

from models.bench import sharded as B
from models.parallel import hlo_collectives as H

# Lines of a compiled decode step on a (2, 2) CPU mesh (jax 0.10.2), one layer; the three
# spellings of replica groups XLA prints.
HLO = """
  %all-reduce.13 = f32[2,1,64]{2,1,0} all-reduce(%gather_select_fusion), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2], device_ids=([2,2]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add.1.clone
  %wrapped_multiply = f32[2,1,64]{2,1,0} fusion(%all-reduce.13), kind=kLoop
  %all-reduce.14 = f32[2,1,64]{2,1,0} all-reduce(%bitcast.55), channel_id=5, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add.2.clone
  %all-reduce.15 = f32[2,1,64]{2,1,0} all-reduce(%bitcast.61), channel_id=6, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add.3.clone
  %all-gather.6 = f32[2,2]{0,1} all-gather(%bitcast.64), channel_id=7, replica_groups=[2,2]<=[4], dimensions={1}, use_global_device_ids=true
  %all-reduce.12 = pred[] all-reduce(%wrapped_reduce.4), channel_id=9, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, use_global_device_ids=true
  %ags = (bf16[8,64]{1,0}, bf16[8,256]{1,0}) all-gather-start(%p), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={1}
  %agd = bf16[8,256]{1,0} all-gather-done(%ags)
"""


def test_collectives_are_counted_with_bytes_and_group_sizes():
  found = {(c["op"], c["type"]): c for c in H.parse_collectives(HLO)}
  assert found[("all-reduce", "f32[2,1,64]")] == dict(op="all-reduce", type="f32[2,1,64]",
                                                      bytes=512, group=2, count=3)
  assert found[("all-gather", "f32[2,2]")]["group"] == 2
  assert found[("all-reduce", "pred[]")]["bytes"] == 1
  start = found[("all-gather", "bf16[8,256]")]  # an async start counts its result, once
  assert (start["bytes"], start["group"], start["count"]) == (8 * 256 * 2, 4, 1)
  assert len(found) == 4
  two_layers = H.parse_collectives(HLO + HLO.split("\n")[3] + "\n" + HLO.split("\n")[4])
  per_layer = H.subtract(two_layers, H.parse_collectives(HLO))
  assert per_layer == [dict(op="all-reduce", type="f32[2,1,64]", bytes=512, group=2, count=2)]


def test_each_process_gets_its_own_devices(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_foo=1")
  env = B._device_env(1, 2)
  assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
  assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]


def test_the_report_compares_layouts_and_throughput():
  tokens = lambda mesh, t: {f"{c} @ {mesh}": [[t]] for c in ("a", "b")}
  row = lambda mesh, d, b, tput, largest=False: dict(
      mesh=mesh, devices=d, batch=b, tokens_per_s=tput, step_ms=1.0, largest=largest,
      init_s=1.0, compile_s=2.0)
  result = dict(
      info=dict(devices=2, device="cpu", date="today", impl="auto", model="tiny",
                dtype="bfloat16", prefix=32, new_tokens=6, wall_s=3.0),
      single=dict(jax="x", tokens={**tokens("none", 1), **tokens("(2, 1)", 1)},
                  throughput=[row(None, 1, 8, 100.0), row([2, 1], 2, 16, 190.0)],
                  collectives=[]),
      processes=dict(count=2, devices_each=1, same_tokens_on_every_process=True,
                     tokens={**tokens("(2, 1)", 1), "b @ (1, 2)": [[2]]},
                     throughput=[row([2, 1], 2, 16, 185.0)]))
  compare = B._compare(result)
  assert [c["same_tokens"] for c in compare if "case" in c] == [True] * 4 + [False]
  assert compare[-1]["within_5_percent"] and abs(compare[-1]["ratio"] - 185 / 190) < 1e-12
  md = B.markdown(dict(result, comparison=compare))
  assert "| 2 processes | (1, 2) | b | NO |" in md and "(within 5%)" in md
  assert "| 1 process | (2, 1) | 2 | 16 | 190 | 1.00 | 0.95 |" in md
