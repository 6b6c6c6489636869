"""train.cuda_graph (k3.train.graphs): the micro-step captured in a CUDA graph trains as the eager loop (losses
and weights to the kernels' run-to-run spread, with gradient accumulation and a changing MTP weight), captures once
per shape, and is refused with a clear error where it cannot run. The CUDA tests run on the GPU (benchmarks/gpu.sh
kernels and train's pretrain part)."""

import json

import pytest
import torch

import k3.train.loop as loop_mod
from k3.model.checkpoint import load_model
from k3.model.config import ConfigError
from k3.train.graphs import GraphedMicroSteps
from k3.train.pretrain import run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")




def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["mtp_loss"], r["grad_norm"]) for r in lines if "loss" in r]


def test_cuda_graph_on_cpu_is_refused_before_anything_is_written(tmp_path, debug_cfg):
    with pytest.raises(ConfigError, match="train.cuda_graph=true needs a CUDA device.*train.cuda_graph=false"):
        run(debug_cfg("train.device=cpu", "train.cuda_graph=true", "train.max_steps=2"), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_cuda_graph_with_compile_is_refused(tmp_path, debug_cfg, monkeypatch):
    from k3.train import pretrain

    monkeypatch.setattr(pretrain, "resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(ConfigError, match="pick one"):
        run(debug_cfg("train.cuda_graph=true", "train.compile=true", "train.max_steps=2"), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_form_is_captured_on_its_second_step():
    steps = GraphedMicroSteps(torch.nn.Linear(2, 2), micro_step=None, grad_accum=1)
    tok = torch.zeros(2, 9, dtype=torch.long)
    a, b = steps.form_of(tok, None, True), steps.form_of(tok, None, False)
    assert a != b and a != steps.form_of(torch.zeros(3, 9, dtype=torch.long), None, True)
    assert [steps.begin_step(f) for f in (a, a, b, a, b)] == [False, True, False, True, True]


def _train(tmp_path, debug_cfg, name, graph, *sets, monkeypatch=None):
    made = []
    if graph:
        class Recording(GraphedMicroSteps):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                made.append(self)

        monkeypatch.setattr(loop_mod, "GraphedMicroSteps", Recording)
    cfg = debug_cfg("train.device=cuda", f"train.cuda_graph={str(graph).lower()}", *sets)
    run(cfg, run_dir=tmp_path / name)
    model, _ = load_model(tmp_path / name / "final")
    return _losses(tmp_path / name), model.state_dict(), made


@cuda
@pytest.mark.parametrize("sets", [("train.max_steps=6",),
                                  ("train.max_steps=6", "train.grad_accum=2", "optim.mtp_lambda_switch=0.5")],
                         ids=["one_micro_batch", "accumulation_and_lambda_switch"])
def test_cuda_graph_trains_as_the_eager_loop(tmp_path, debug_cfg, monkeypatch, sets):
    eager, eager_w, _ = _train(tmp_path, debug_cfg, "eager", False, *sets)
    graphed, graphed_w, made = _train(tmp_path, debug_cfg, "graph", True, *sets, monkeypatch=monkeypatch)
    (steps,) = made
    accum = 2 if "train.grad_accum=2" in sets else 1
    assert steps.captures == 1 and steps.replays == 5 * accum  # step 1 eager, then one graph for the rest
    # the replays run the eager step's kernels, so the runs agree to the GPU kernels' own run-to-run spread (bitwise
    # where they are deterministic); a replay on stale inputs or gradients would be off by far more
    assert graphed[0] == eager[0]  # step 1 is eager in both
    assert torch.allclose(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=0), (graphed, eager)
    assert graphed_w.keys() == eager_w.keys()
    for k in eager_w:
        assert torch.allclose(graphed_w[k], eager_w[k], rtol=1e-4, atol=1e-6), k
