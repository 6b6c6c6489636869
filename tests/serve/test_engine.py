"""Engine: continuous batching equals single-sequence decoding, chunked prefill, abort/free, bounded queue,
sampling parameters, stop strings, prompt logprobs against the model's own forward."""

import pytest
import torch

from k3.model.tokenizer import IncrementalDecoder
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine, QueueFull
from k3.serve.generate import generate_tokens
from k3.serve.request import SamplingParams, Sequence, find_stop, holdback
from k3.serve.sampling import pick_token


def _engine(model_tok, **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": 6, "max_num_batched_tokens": 128, "max_model_len": 512, "warmup": False, **kw}
    return Engine(model, tok, ServeConfig(**cfg))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (L,), generator=g).tolist() for L in lengths]


def _run_staggered(eng, prompts, params):
    """Submit one prompt per engine step so requests join a running batch; collect token ids per prompt."""
    out = {i: [] for i in range(len(prompts))}
    reasons = {}

    def sink_for(i):
        def sink(ev):
            out[i].extend(ev.token_ids)
            if ev.finish_reason:
                reasons[i] = ev.finish_reason
        return sink

    for i, p in enumerate(prompts):
        eng.submit(p, params[i] if isinstance(params, list) else params, sink_for(i))
        eng.step()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    return out, reasons


@pytest.mark.parametrize("budget", [64, 256])
def test_batched_greedy_equals_single_sequence(model_tok, budget):
    model, _ = model_tok
    lengths = [1, 5, 63, 64, 65, 130, 200, 17]
    prompts = _prompts(lengths)
    max_tokens = [12, 20, 7, 20, 15, 20, 9, 20]  # sequences leave at different steps
    ref = [list(generate_tokens(model, p, max_tokens=m, temperature=0)) for p, m in zip(prompts, max_tokens)]
    eng = _engine(model_tok, max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    out, reasons = _run_staggered(eng, prompts, params)
    for i in range(len(prompts)):
        assert out[i] == ref[i], f"prompt of {lengths[i]} tokens diverged"
        assert reasons[i] == "length"
    # everything was freed
    assert len(eng.states.free) == eng.states.num_slots
    assert eng.pages.num_free == eng.pages.num_pages and eng.scheduler.reserved == 0


def test_more_requests_than_slots_queue_and_finish(model_tok):
    eng = _engine(model_tok, max_num_seqs=2)
    prompts = _prompts([10, 20, 30, 40, 50])
    out, reasons = _run_staggered(eng, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(out[i]) == 5 for i in range(5)) and set(reasons.values()) == {"length"}


def test_abort_frees_slot_and_pages(model_tok):
    eng = _engine(model_tok)
    events = []
    (sid,) = eng.submit(_prompts([100])[0], SamplingParams(temperature=0, max_tokens=50), events.append)
    for _ in range(3):
        eng.step()
    assert len(eng.running) == 1 and eng.pages.num_free < eng.pages.num_pages
    eng.abort([sid])
    eng.step()
    assert events[-1].finish_reason == "abort"
    assert not eng.running and len(eng.states.free) == eng.states.num_slots
    assert eng.pages.usage() == 0.0 and eng.scheduler.reserved == 0


def test_bounded_queue(model_tok):
    eng = _engine(model_tok, max_queue=3)
    p = SamplingParams(max_tokens=2)
    eng.submit([1, 2], p, lambda ev: None, n=2)
    eng.submit([1, 2], p, lambda ev: None)
    with pytest.raises(QueueFull):
        eng.submit([1, 2], p, lambda ev: None)
    while eng.has_work():
        eng.step()
    eng.submit([1, 2], p, lambda ev: None)  # room again once the queue drained


def test_seeded_sampling_is_reproducible_and_n_choices_differ(model_tok):
    eng = _engine(model_tok)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, max_tokens=12, seed=7, ignore_eos=True)
    a = eng.generate([3, 4, 5], p, n=3)
    b = eng.generate([3, 4, 5], p, n=3)
    toks = lambda evs: [[t for e in c for t in e.token_ids] for c in evs]
    assert toks(a) == toks(b)
    assert len({tuple(c) for c in toks(a)}) > 1


def test_penalties_follow_openai_formula(model_tok):
    eng = _engine(model_tok)
    V = eng.model.config.vocab_size
    row = torch.zeros(V)
    row[3], row[9] = 2.0, 1.5
    seq = Sequence(seq_id="s", index=0, prompt=[1], sink=None, decoder=IncrementalDecoder(eng.tok),
                   params=SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.0))
    seq.counts = {3: 2}  # 2.0 - 2 * 0.2 = 1.6 > 1.5: still token 3
    assert pick_token(seq, row)[0] == 3
    seq.counts = {3: 3}  # 2.0 - 0.6 = 1.4 < 1.5
    assert pick_token(seq, row)[0] == 9
    seq.params = SamplingParams(temperature=0, presence_penalty=0.6)
    seq.counts = {3: 1}
    assert pick_token(seq, row)[0] == 9
    seq.params = SamplingParams(temperature=0, repetition_penalty=1.5)
    seq.counts, seq.prompt = {}, [3]  # 2.0 / 1.5 = 1.33 < 1.5
    assert pick_token(seq, row)[0] == 9
    seq.params = SamplingParams(temperature=0, logprobs=2)
    tok, lp = pick_token(seq, row)
    ref = torch.log_softmax(row.double(), -1)
    assert tok == 3 and lp.logprob == pytest.approx(ref[3].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == [3, 9]


def test_prompt_logprobs_match_full_forward(model_tok):
    model, _ = model_tok
    prompt = _prompts([150])[0]
    eng = _engine(model_tok, max_num_batched_tokens=64)  # three prefill chunks
    evs = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3))[0]
    plp = evs[0].prompt_logprobs
    assert evs[-1].finish_reason == "length" and evs[-1].num_output_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        assert plp[i].token_id == prompt[i]
        assert plp[i].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert [t for t, _ in plp[i].top] == ref[i - 1].topk(3).indices.tolist()


def test_stop_strings_and_stop_ids(model_tok):
    _, tok = model_tok
    eng = _engine(model_tok)
    prompt = tok.encode("def f(x):\n    return", add_bos=True)
    free = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = "".join(e.text for e in free)
    ids = [t for e in free for t in e.token_ids]
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) == 5
    cut = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert "".join(e.text for e in cut) == text[:5] and cut[-1].finish_reason == "stop"
    by_id = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[ids[4]]))[0]
    got = [t for e in by_id for t in e.token_ids]
    assert got == ids[:ids.index(ids[4]) + 1] and by_id[-1].finish_reason == "stop"


def test_stop_helpers():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["wor", "llo"], 0) == 2
    assert find_stop("abc", ["x"], 0) is None
    assert holdback("hello wo", ["world"]) == 2
    assert holdback("hello", ["xyz"]) == 0


def test_context_limit_finishes_with_length(model_tok):
    eng = _engine(model_tok, max_model_len=128)
    evs = eng.generate(list(range(4, 124)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert evs[-1].finish_reason == "length" and evs[-1].num_output_tokens == 8
    with pytest.raises(ValueError, match="max_model_len"):
        eng.submit(list(range(4, 124)), SamplingParams(max_tokens=9), lambda ev: None)


def test_token_budget_default_depends_on_the_device(model_tok):
    """max_num_batched_tokens 0 (the default) = 256 tokens per step on a CPU (2048 on a GPU); an explicit value wins;
    a budget below one 64-token block is a clear error."""
    model, tok = model_tok
    assert Engine(model, tok, ServeConfig(max_model_len=256, warmup=False)).scheduler.token_budget == 256
    assert Engine(model, tok, ServeConfig(max_model_len=256, max_num_batched_tokens=128)).scheduler.token_budget == 128
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 must be >= kv_block_size=64"):
        Engine(model, tok, ServeConfig(max_model_len=256, max_num_batched_tokens=32))
