"""The eager engine step reads tensor values on the host only where it must: on a GPU every such read
(`.item()`, `.tolist()`, `bool(t)`, `int(t)`) waits for the whole queue, so a handful per layer used to make an
eager decode step ~100 host waits. Counted here on the CPU by patching those methods, for a plain decode step of 3
greedy sequences: only the sampled tokens (serve/sampling.py, one read for all greedy rows) and the CPU-only value
checks of the conv's cu_seqlens (k3kernels/conv/naive.py skips them for trusted CUDA callers) may read values.
Prefill steps (always eager) are held to the same rule, and the serving code's own op count in a prefill step must
not grow with the block boundaries it crosses (each op is host time on a GPU; counted with a TorchFunctionMode)."""

import sys
from pathlib import Path

from torch.overrides import TorchFunctionMode

import k3.serve.runner
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams

SERVE = Path(k3.serve.runner.__file__).parent
ROOT = SERVE.parent


def test_eager_decode_step_reads_only_sampled_tokens(model_tok, spy_reads):
    model, tok = model_tok
    eng = Engine(model, tok, ServeConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=512,
                                         enable_prefix_caching=False, warmup=False))
    for i in range(3):
        eng.submit(list(range(10, 74 + i)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   lambda ev: None)
    eng.step()  # prefill
    eng.step()  # first decode
    where = spy_reads()
    assert eng.step()
    files = {f for f, _ in where}
    assert files <= {"serve/engine.py", "serve/sampling.py", "conv/naive.py"}, dict(where)
    assert sum(v for (f, _), v in where.items() if f.startswith("serve/")) == 1, dict(where)  # one batched argmax


def _prefill_engine(model, tok) -> Engine:
    return Engine(model, tok, ServeConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512,
                                          enable_prefix_caching=True, warmup=False))


def test_eager_prefill_steps_read_only_sampled_tokens(model_tok, monkeypatch, spy_reads):
    """Prefill steps (prefix caching on) read no tensor value but the sampled tokens: a 200-token miss (chunk kernel,
    three interior snapshots; its varlen layout comes from the host offsets, `cu_seqlens_cpu`), the 8-token tail of a
    prefix hit (the trusted recurrent pool entry) and a step mixing a decode with a new prompt's prefill (only the
    conv's CPU-only offset check, k3kernels/conv/naive.py, may read there). Each step is spied on its own."""
    model, tok = model_tok
    eng = _prefill_engine(model, tok)
    prompt = [(7 * i) % 300 + 10 for i in range(200)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seen = []
    for case, prompts in (("miss", [prompt]), ("hit", [prompt[:192] + [5, 6, 7, 8, 9, 10, 11, 12]]),
                          ("mixed", [prompt[:20], prompt[100:190]])):
        events = []
        eng.submit(prompts[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True) if case == "mixed"
                   else one, events.append)
        if case == "mixed":
            assert eng.step()  # the first prompt's prefill; the spied step decodes it while the second one prefills
            eng.submit(prompts[1], one, events.append)
        with monkeypatch.context() as m:
            where = spy_reads(m)
            assert eng.step()
        if case == "hit":
            assert events[-1].num_cached_tokens == 192, "the tail step must start from the cached blocks"
        files = {f for f, _ in where}
        assert files <= {"serve/engine.py", "serve/sampling.py", "conv/naive.py"}, (case, dict(where))
        assert sum(v for (f, _), v in where.items() if f.startswith("serve/")) == 1, (case, dict(where))
        seen.append(case)
        while eng.has_work():
            eng.step()
    assert seen == ["miss", "hit", "mixed"]


class _ServeOps(TorchFunctionMode):
    """Counts torch calls whose innermost k3 frame is in serve/ (the engine and runner's own tensor work)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and not (f.f_code.co_filename.startswith(str(ROOT)) and "/.venv/" not in
                                     f.f_code.co_filename):
            f = f.f_back
        if f is not None and f.f_code.co_filename.startswith(str(SERVE)):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_eager_prefill_step_ops_do_not_grow_with_block_boundaries(model_tok):
    """The serving code's own tensor ops in a prefill step (prefix caching on) are the same for a prompt crossing 2
    block boundaries and one crossing 7: every KDA layer writes all of a step's snapshots at once (k3.serve.cache).
    Written one boundary at a time they grew by ~30 ops per boundary and layer, on a GPU ~15 us of host time each."""
    model, tok = model_tok
    eng = _prefill_engine(model, tok)
    counts = {}
    for n in (130, 450):  # 2 and 7 boundaries, both interior to the chunk kernel call and not at its end
        eng.reset_prefix_cache()
        eng.submit([(5 * i) % 400 + 10 for i in range(n)], SamplingParams(temperature=0.0, max_tokens=1,
                                                                           ignore_eos=True), lambda ev: None)
        mode = _ServeOps()
        with mode:
            assert eng.step()
        assert not eng.has_work()
        counts[n] = mode.count
    assert counts[130] == counts[450] > 0, counts


def test_a_lone_long_prefill_chunk_runs_the_conv_unpacked(model_tok, monkeypatch):
    """One sequence's 450-token prefill chunk (prefix caching on, interior snapshots) runs the short conv as plain
    rows, not through cu_seqlens: the packed path of k3kernels/conv/naive.py is ~2.5x the ops per conv, and a lone
    512-token chunk took it (~480 more host ops a step, ~13-20 ms of a 2,048-token prefill on the H200)."""
    import k3.model.kda as kda_mod

    model, tok = model_tok
    eng = _prefill_engine(model, tok)
    packed = []
    real = kda_mod.causal_conv1d

    def spy(*args, cu_seqlens=None, **kwargs):
        packed.append(cu_seqlens is not None)
        return real(*args, cu_seqlens=cu_seqlens, **kwargs)

    monkeypatch.setattr(kda_mod, "causal_conv1d", spy)
    eng.submit([(5 * i) % 400 + 10 for i in range(450)], SamplingParams(temperature=0.0, max_tokens=1,
                                                                         ignore_eos=True), lambda ev: None)
    assert eng.step()
    assert packed and not any(packed), packed
