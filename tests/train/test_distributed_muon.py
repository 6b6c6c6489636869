"""Muon on parameters sharded along dim 0 over 2 gloo processes (k3.train.parallel.muon) equals Muon on the whole
matrices in one process, over 3 steps (momentum included), for every layout: matrices gathered on an owner (even,
uneven and single-row shards, tall and wide, per-head column blocks, head blocks that straddle a shard boundary) and
blocks orthogonalized where they lie (expert stacks with uneven or empty shards, aligned head blocks, packed
gate/up experts), with and without Nesterov. The bytes the two all_to_alls move equal `gathered_bytes`' count.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from k3.train.optim import Muon
from k3.train.parallel.muon import assign_owners, gathered_bytes, local_blocks, shard_rows

ROOT = Path(__file__).resolve().parents[2]
# (shape, num_heads, head_axis, nesterov)
SPECS = [((64, 32), None, 0, True), ((7, 5), None, 0, True), ((1, 6), None, 0, True), ((40, 24), None, 0, False),
         ((24, 40), None, 0, True), ((8, 12), 3, 1, True), ((10, 8), 5, 0, True), ((3, 4, 6), None, 0, True),
         ((1, 4, 6), None, 0, True), ((16, 8), 4, 0, True), ((12, 8), 2, 0, False), ((2, 8, 6), 2, 0, True)]
STEPS, LR, WD = 3, 0.02, 0.1

WORKER = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor
    from k3.train.config import ParallelConfig
    from k3.train.optim import Muon
    from k3.train.parallel.muon import ShardedMuonUpdate
    from k3.train.parallel.runtime import start_distributed, stop_distributed

    specs, steps, lr, wd, out = eval(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    d = start_distributed(ParallelConfig(dp=2), "cpu", "test")
    data = torch.load(out + "/inputs.pt")
    shard = lambda t: distribute_tensor(t.clone(), d.mesh, [Shard(0)], src_data_rank=None)
    params = [nn.Parameter(shard(w)) for w in data["weights"]]
    groups = [{"params": [p], "num_heads": h, "head_axis": a, "nesterov": n} for p, (_, h, a, n) in zip(params, specs)]
    sent = []
    a2a = d.all_to_all
    def counted(o, i, out_splits, in_splits):
        sent.append(sum(n for r, n in enumerate(in_splits) if r != d.rank) * i.element_size())
        a2a(o, i, out_splits, in_splits)
    d.all_to_all = counted
    opt = Muon(groups, lr=lr, weight_decay=wd, sharded_update=ShardedMuonUpdate(d))
    for s in range(steps):
        for p, g in zip(params, data["grads"][s]):
            p.grad = shard(g)
        opt.step()
    result = {"weights": [p.full_tensor() for p in params], "sent": sent,
              "momentum": [opt.state[p]["momentum_buffer"].full_tensor() for p in params]}
    torch.save(result, f"{out}/rank{d.rank}.pt")
    stop_distributed(d)
""")


def _reference(weights, grads):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Muon([{"params": [p], "num_heads": h, "head_axis": a, "nesterov": n}
                for p, (_, h, a, n) in zip(params, SPECS, strict=True)], lr=LR, weight_decay=WD)
    for s in range(STEPS):
        for p, g in zip(params, grads[s], strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]


def test_sharded_muon_equals_whole_matrix_muon(tmp_path):
    weights = [torch.randn(s) for s, *_ in SPECS]
    grads = [[torch.randn(s) for s, *_ in SPECS] for _ in range(STEPS)]
    torch.save({"weights": weights, "grads": grads}, tmp_path / "inputs.pt")
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp_path / "worker.py"), repr(SPECS), str(STEPS), str(LR), str(WD), str(tmp_path)]
    out = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_w, ref_m = _reference(weights, grads)
    for i, (spec, w, m) in enumerate(zip(SPECS, ref_w, ref_m, strict=True)):
        for r in ranks:
            # bit-identical on the development machine; the bound allows another BLAS to block a stack differently
            torch.testing.assert_close(r["weights"][i], w, rtol=1e-6, atol=1e-7, msg=f"weights of {spec}")
            torch.testing.assert_close(r["momentum"][i], m, rtol=0, atol=0, msg=f"momentum of {spec}")
        assert (ranks[0]["weights"][i] - weights[i]).abs().max() > 1e-3  # the update moved it

    counted = gathered_bytes([(torch.Size(s), h, a) for s, h, a, _ in SPECS], 2, 4)  # fp32 on the CPU
    assert all(len(r["sent"]) == 2 * STEPS for r in ranks)  # one gather and one scatter per step
    per_rank_step = [sum(r["sent"][k:k + 2]) for r in ranks for k in range(0, 2 * STEPS, 2)]
    assert sum(per_rank_step) == STEPS * counted["bytes_per_step"] and max(per_rank_step) == counted["bytes_per_rank"]
    assert counted["gathered_matrices"] == sum(not local_blocks(torch.Size(s), h, a, 2) for s, h, a, _ in SPECS) == 7


def test_shard_layout_helpers():
    assert [shard_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [shard_rows(1, 2, r) for r in range(2)] == [(0, 1), (1, 1)]
    assert [shard_rows(9, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 9)]  # torch.chunk: 3 pieces
    assert [len(c) for c in torch.arange(9).chunk(4)] == [3, 3, 3]
    assert local_blocks(torch.Size([3, 4, 6]), None, 0, 2) and local_blocks(torch.Size([16, 8]), 4, 0, 2)
    assert not local_blocks(torch.Size([10, 8]), 5, 0, 2) and not local_blocks(torch.Size([8, 12]), 3, 1, 2)
    assert local_blocks(torch.Size([8, 12]), None, 0, 1)  # one rank holds everything
    assert assign_owners([4, 4, 8], 2) == [1, 1, 0] and assign_owners([5, 1, 1, 1], 3) == [0, 1, 2, 1]
