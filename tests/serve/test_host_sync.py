"""The eager engine step reads tensor values on the host only where it must: on a GPU every such read
(`.item()`, `.tolist()`, `bool(t)`, `int(t)`) waits for the whole queue, so a handful per layer used to make an
eager decode step ~100 host waits. Counted here on the CPU by patching those methods, for a plain decode step of 3
greedy sequences: only the sampled tokens (serve/sampling.py, one read for all greedy rows) and the CPU-only value
checks of the conv's cu_seqlens (kernels/conv/naive.py skips them for trusted CUDA callers) may read values."""

import collections
import traceback
from pathlib import Path

import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams

READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")


def test_eager_decode_step_reads_only_sampled_tokens(model_tok, monkeypatch):
    model, tok = model_tok
    eng = Engine(model, tok, ServeConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=512,
                                         enable_prefix_caching=False, warmup=False))
    for i in range(3):
        eng.submit(list(range(10, 74 + i)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   lambda ev: None)
    eng.step()  # prefill
    eng.step()  # first decode
    where = collections.Counter()
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            frame = traceback.extract_stack(limit=2)[0]
            where[(Path(frame.filename).parent.name + "/" + Path(frame.filename).name, _name)] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    assert eng.step()
    files = {f for f, _ in where}
    assert files <= {"serve/engine.py", "serve/sampling.py", "conv/naive.py"}, dict(where)
    assert sum(v for (f, _), v in where.items() if f.startswith("serve/")) == 1, dict(where)  # one batched argmax
