"""Prefix-cache snapshots written by the static steps (k3.serve.cache.write_step_end_snapshots): a decode step in
which a sequence completes a 64-token block stays on the static path (an eager step costs a GPU ~70 ms instead of a
~3-8 ms replay, and ~40% of the steps of 32 staggered streams cross a boundary), and
the snapshots it stores equal the eager engine's, so a later prompt that extends a generated text hits them and
decodes exactly as without a cache. On the CPU the static step runs without capture (the function CUDA captures).

Legend: B sequences in a step."""

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.request import SamplingParams

MAX_SEQS, MAX_LEN, PAGE = 4, 512, 64


def _engine(model_tok, graphs: bool, cache: bool = True, spec: int = 0) -> Engine:
    model, tok = model_tok
    eng = Engine(model, tok, ServeConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=256, max_model_len=MAX_LEN,
                                         warmup=False, enable_prefix_caching=cache, cuda_graphs=False,
                                         num_speculative_tokens=spec))
    if graphs:
        eng.runner.enable_static_steps()
    return eng


def _run(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts submitted at once, greedy, stepped to the end -> generated ids per prompt."""
    out = [[] for _ in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(p, params, lambda ev, i=i: out[i].extend(ev.token_ids))
    while eng.has_work():
        eng.step()
    return out


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _spy_snapshot_steps(eng: Engine) -> list[int]:
    """Count the static decode steps that wrote at least one snapshot."""
    hits = []
    real = eng.runner.graphs.step

    def step(seqs):
        out = real(seqs)
        if out is not None and len(seqs[0].tokens) == 1 and any(s.snapshots for s in seqs):
            hits.append(sum(len(s.snapshots) for s in seqs))
        return out

    eng.runner.graphs.step = step
    return hits


def test_decode_snapshots_on_the_fast_path_equal_eager(model_tok):
    prompts = _prompts([50, 100, 120])  # staggered: they complete blocks in different steps
    eager, fast = _engine(model_tok, graphs=False), _engine(model_tok, graphs=True)
    hits = _spy_snapshot_steps(fast)
    out_e, out_f = _run(eager, prompts, 90), _run(fast, prompts, 90)
    assert out_f == out_e
    # 50 + 90, 100 + 90, 120 + 90 tokens: blocks completed while decoding at 64 and 128 / 128 and 192 / 128 and 192
    assert sum(hits) >= 5 and len(hits) >= 3, hits
    stored_e = {h: i for h, i in eager.snaps.entry_of.items() if eager.snaps.valid[i]}
    stored_f = {h: i for h, i in fast.snaps.entry_of.items() if fast.snaps.valid[i]}
    assert stored_f.keys() == stored_e.keys() and len(stored_e) >= 7
    for h, i in stored_e.items():
        j = stored_f[h]
        for layer in range(len(eager.snaps.state)):
            torch.testing.assert_close(fast.snaps.state[layer][j], eager.snaps.state[layer][i], atol=1e-5, rtol=0)
            for a, b in zip(eager.snaps.tails[layer], fast.snaps.tails[layer], strict=True):
                torch.testing.assert_close(b[j], a[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_multi_turn_hits_snapshots_written_while_decoding(model_tok, graphs):
    """Turn 2 = turn 1's prompt + its answer + a new message: the hit reaches past the first prompt (the snapshots
    of blocks completed while decoding) and the answer equals a cache-off engine's."""
    (p1,) = _prompts([40])
    eng, ref = _engine(model_tok, graphs=graphs), _engine(model_tok, graphs=False, cache=False)
    (a1,) = _run(eng, [p1], 100)
    assert a1 == _run(ref, [p1], 100)[0]
    p2 = p1 + a1 + _prompts([9], seed=4)[0]
    before = eng.metrics.get("k3:prefix_cache_hits")
    (a2,) = _run(eng, [p2], 20)
    assert eng.metrics.get("k3:prefix_cache_hits") - before == 128  # blocks 0-1 (positions 0..127) from the cache
    assert a2 == _run(ref, [p2], 20)[0]


@pytest.mark.parametrize("spec", [0, 2], ids=["plain", "speculative"])
def test_mixed_steps_split_and_short_prompts_in_graph_chunks(model_tok, spec):
    """With graphs on, a request joining running decodes does not send the step eager: the decodes take the static
    decode step and the newcomer's prompt comes in 64-token chunks through static chunk steps (prompts <= 512
    tokens). Greedy outputs equal the eager engine's and a cache-off engine's; the snapshots stored are the same.
    With MTP speculation a verify step beside prefill chunks runs as its own call, and the drafter reads the merged
    hidden rows of the split step."""
    prompts = _prompts([100, 300, 40], seed=5)
    engines = {"eager": _engine(model_tok, graphs=False, spec=spec), "split": _engine(model_tok, graphs=True, spec=spec),
               "nocache": _engine(model_tok, graphs=False, cache=False, spec=spec)}
    split = engines["split"]
    split.runner.split_mixed_steps = True  # on a GPU: whenever graphs are captured
    seen, real = [], split.runner._split_step
    split.runner._split_step = lambda seqs: seen.append([len(s.tokens) for s in seqs]) or real(seqs)
    chunks, real_step = [], split.runner.graphs.step
    split.runner.graphs.step = lambda seqs: (len(seqs[0].tokens) > 1 and chunks.append(len(seqs[0].tokens))
                                             ) or real_step(seqs)
    outs = {}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for name, eng in engines.items():
        out = [[] for _ in prompts]
        eng.submit(prompts[0], params, lambda ev, out=out: out[0].extend(ev.token_ids))
        for _ in range(4):  # request 0 prefills, then decodes; the others join while it runs
            eng.step()
        for i in (1, 2):
            eng.submit(prompts[i], params, lambda ev, i=i, out=out: out[i].extend(ev.token_ids))
        while eng.has_work():
            eng.step()
        outs[name] = out
    assert outs["split"] == outs["eager"] == outs["nocache"]
    # request 0's 100 tokens: 64 + 32 + 4; requests 1 (300 = 4 x 64 + 32 + 8 + 4) and 2 (40 = 32 + 8) join decoding
    # request 0: their chunks of unequal lengths run one static call per length beside the decode (or verify) call
    assert chunks == [64, 32, 4, 64, 32, 64, 8, 64, 64, 32, 8, 4], chunks
    if not spec:
        assert any(1 in lens and max(lens) > 1 for lens in seen), seen  # a decode + prefill step was split
    for eng in (split, engines["eager"]):
        eng.stored = {h for h, i in eng.snaps.entry_of.items() if eng.snaps.valid[i]}
    assert split.stored == engines["eager"].stored and len(split.stored) >= 6


def test_prompt_logprobs_prefill_is_not_chunked(model_tok):
    """Prompt logprobs need every position's logits, which the static chunk steps do not return: such a prompt keeps
    its one eager prefill step instead of 64-token chunks that would all run eagerly."""
    eng = _engine(model_tok, graphs=True)
    eng.runner.split_mixed_steps = True
    sizes, real = [], eng.runner.step
    eng.runner.step = lambda seqs: sizes.append([len(s.tokens) for s in seqs]) or real(seqs)
    (prompt,) = _prompts([200], seed=6)
    eng.submit(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1), lambda ev: None)
    eng.submit(prompt[:150], SamplingParams(temperature=0.0, max_tokens=2), lambda ev: None)
    while eng.has_work():
        eng.step()
    # the logprobs prompt in one step; the other prompt (150 tokens) in 64 + 64 + 16 + 4 + 2 beside it
    assert sizes[0] == [200] and [1, 64] in sizes and [16] in sizes and [4] in sizes and [2] in sizes, sizes
