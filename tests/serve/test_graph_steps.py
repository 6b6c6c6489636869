"""The graph runner's plain steps (k3.serve.graphs, k3.serve.static): a decode (T = 1) or a prefill chunk (T = 2..64)
of B sequences as the model's forward over static buffers, run eagerly on the CPU (the function CUDA captures),
equals the runner's eager step (logits, greedy tokens, hidden rows, every cache afterwards); padded rows touch
nothing else; the function does no host sync; only qualifying steps are taken; the capture caps, compile routing and
warm-up shapes hold; engines with the static path give the eager engine's tokens; on CUDA a captured graph's replay
equals the eager step.

Legend: B sequences in a step, Bb batch bucket, T tokens per sequence, Gb page bucket."""

import copy
import math

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.graphs import CHUNK_LENGTHS, MAX_TAIL_GRAPHS, bucket, warm_buckets
from k3.serve.request import SamplingParams
from k3.serve.static import fill_inert, step_forward, step_layout
from k3.serve.step import StepSeq

MAX_SEQS, MAX_LEN, PAGE = 8, 512, 64


def _engine(model_tok, device="cpu", **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False,
           "enable_prefix_caching": False, "cuda_graphs": False, **kw}
    return Engine(model if device == "cpu" else model.to(device), tok, ServeConfig(**cfg))


def _static(model_tok, capture=False, compile=False, **kw):
    eng = _engine(model_tok, **kw)
    eng.runner.enable_static_steps(capture=capture, compile=compile)
    return eng


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


class _Seqs:
    """B sequences prefilled by hand through one engine's runner (no scheduler), plus one idle bystander that owns
    slot 0 and a page but is never scheduled; `batch(tails)` gives a step of tails[n] new tokens per sequence."""

    def __init__(self, eng, prompts, extra):
        bystander = eng.states.allocate()  # slot 0: padded rows must never write it
        eng.runner._eager([StepSeq(tokens=[5, 6, 7], start=0, slot=bystander, block_table=[eng.pages.allocate()])])
        self.slots = [eng.states.allocate() for _ in prompts]
        self.tables = [[eng.pages.allocate() for _ in range(math.ceil((len(p) + extra) / PAGE))] for p in prompts]
        self.pos = [len(p) for p in prompts]
        self.next = []
        for p, s, bt in zip(prompts, self.slots, self.tables):
            out = eng.runner._eager([StepSeq(tokens=p, start=0, slot=s, block_table=bt[:math.ceil(len(p) / PAGE)])])
            self.next.append(int(out.logits[0][-1].argmax()))

    def batch(self, tails):
        """This step's StepSeqs; block tables cover exactly positions [0, pos + T) as the scheduler's grow does."""
        return [StepSeq(tokens=t, start=p, slot=s, block_table=bt[:math.ceil((p + len(t)) / PAGE)])
                for t, p, s, bt in zip(tails, self.pos, self.slots, self.tables)]

    def decodes(self):
        return self.batch([[t] for t in self.next])

    def advance(self, tails, logits=None):
        self.pos = [p + len(t) for p, t in zip(self.pos, tails)]
        if logits is not None:
            self.next = [int(lg[-1].argmax()) for lg in logits]


def _twin(model_tok, caches, lengths, T, steps, capture=False, device="cpu", prepare=None):
    """Run the same steps (T new tokens per sequence: greedy decodes for T = 1, random tokens otherwise) through the
    eager step (engine A) and the static step (engine B, `prepare(engine B)` first); compare logits (1e-4 relative
    to their scale), greedy tokens, hidden rows and offsets every step, the caches at the end (1e-5; 1e-4 on CUDA),
    and check that nothing outside the batch's own slots and new latent rows changed in B. Returns engine B."""
    model, tok = model_tok
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    eng_a, eng_b = _engine((model, tok)), _static((model, tok), capture=capture)
    if prepare is not None:
        prepare(eng_b)
    g = eng_b.runner.graphs
    prompts = _prompts(lengths)
    a, b = _Seqs(eng_a, prompts, steps * T), _Seqs(eng_b, prompts, steps * T)
    assert a.slots == b.slots and 0 not in b.slots
    for step in range(steps):
        tails = [[t] for t in b.next] if T == 1 else _prompts([T] * len(lengths), seed=1 + step)
        batch = b.batch(tails)
        assert g.accepts_step(batch)
        before, calls = caches.pools(eng_b), g.calls["step"]
        out_a, out_b = eng_a.runner.step(a.batch(tails)), eng_b.runner.step(batch)
        assert g.calls["step"] == calls + 1  # the runner dispatched the step to the static path
        for la, lb in zip(out_a.logits, out_b.logits, strict=True):
            assert lb.shape == la.shape == (1, model.config.vocab_size) and lb.dtype == torch.float32
            torch.testing.assert_close(lb, la, atol=1e-4 * max(1.0, la.abs().max().item()), rtol=0)
            assert int(lb.argmax()) == int(la.argmax())  # greedy tokens identical
        assert out_b.cu == out_a.cu == list(range(0, len(lengths) * T + 1, T))
        torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=1e-4, rtol=0)
        caches.untouched(eng_b, before, batch, PAGE)
        a.advance(tails, out_a.logits)
        b.advance(tails, out_b.logits)
        assert a.next == b.next
    for x, y in zip(caches.pools(eng_a), caches.pools(eng_b), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5 if device == "cpu" else 1e-4, rtol=0)
    return eng_b


# ------------------------------------------------------------------------------------------------------------ tests


def test_buckets():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(5, 6) == 6 and bucket(3, 3) == 3
    assert warm_buckets([1, 8, 32], 64) == [1, 2, 4, 8, 16, 32] and warm_buckets([3], 2) == [1, 2]
    assert warm_buckets([5], 6) == [1, 2, 4, 6] and warm_buckets([], 8) == []


@pytest.mark.parametrize("lengths", [[62], [63, 120, 10], [60, 62, 127, 5, 64]], ids=["B1", "B3-pad4", "B5-pad8"])
def test_decode_step_equals_eager_step(model_tok, lengths, caches):
    """Batch 1, 3 (bucket 4), 5 (bucket 8); positions crossing page boundaries 64 and 128 (page buckets 1, 2, 4);
    greedy tokens identical and logits close over 20 steps; padded rows leave other slots, tails and pages
    bit-identical (checked every step)."""
    eng = _twin(model_tok, caches, lengths, T=1, steps=20)
    Bb = bucket(len(lengths), MAX_SEQS)
    shapes = eng.runner.graphs.shapes
    assert {key[:3] for key in shapes} == {("step", Bb, 1)}
    assert len({key[3] for key in shapes}) >= 2  # a page-bucket change happened


@pytest.mark.parametrize("T", [2, 7, 64])
@pytest.mark.parametrize("lengths", [[62], [63, 120, 10]], ids=["B1", "B3-pad4"])
def test_prefill_chunk_step_equals_eager_step(model_tok, lengths, T, caches):
    """Batch 1 and 3 (bucket 4), chunks crossing page boundaries (62 + 7 > 64; 120 + 64 > 128), two chunk steps in a
    row (the second starts from the first's states, tails and latents): the static step gives the eager step's
    logits, greedy tokens, hidden rows and caches; padded rows inert."""
    eng = _twin(model_tok, caches, lengths, T, steps=2)
    assert {key[:3] for key in eng.runner.graphs.shapes} == {("step", bucket(len(lengths), MAX_SEQS), T)}


def test_padded_rows_copy_row_zero(model_tok):
    """Host layout of a padded step: padded rows repeat row 0's tokens, positions, latent rows, latent sources, tail
    slot and block table, write row 0's tails (src_rows 0) and name no recurrent slot (-1: a duplicate slot would
    race inside the Triton kernel); no T padding. Bad inputs are refused on the host (the kernels trust them)."""
    eng = _static(model_tok)
    g = eng.runner.graphs
    seqs = [StepSeq(tokens=[11, 12, 13], start=62, slot=3, block_table=[4, 9]),
            StepSeq(tokens=[21, 22, 23], start=5, slot=1, block_table=[2])]
    buf = g.buffers("step", 4, 3, 2)
    buf.ints.copy_(step_layout(seqs, buf, g.geom, g.max_seqs, None))
    row0 = [11, 12, 13]
    assert buf.tokens.tolist() == row0 + [21, 22, 23] + row0 * 2
    assert buf.positions.tolist() == [62, 63, 64, 5, 6, 7] + [62, 63, 64] * 2
    smap0 = [4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE + 0]
    assert buf.slot_mapping.tolist() == smap0 + [2 * PAGE + 5, 2 * PAGE + 6, 2 * PAGE + 7] + smap0 * 2
    assert buf.src_tok.tolist() == [0, 1, 2, 3, 4, 5] + [0, 1, 2] * 2 and buf.live.tolist() == [1] * 12
    assert buf.row_slots.tolist() == [3, 1, -1, -1] and buf.tail_slots.tolist() == [3, 1, 3, 3]
    assert buf.src_rows.tolist() == [0, 1, 0, 0] and buf.kda_slots.tolist() == [-1] * 12
    assert buf.block_table.tolist() == [[4, 9], [2, 0], [4, 9], [4, 9]]
    dec = g.buffers("step", 4, 1, 2)  # a decode: the same layout at T = 1
    dec.ints.copy_(step_layout([StepSeq(tokens=[11], start=70, slot=3, block_table=[4, 9]),
                                StepSeq(tokens=[12], start=5, slot=1, block_table=[2])], dec, g.geom, g.max_seqs, None))
    assert dec.tokens.tolist() == [11, 12, 11, 11] and dec.positions.tolist() == [70, 5, 70, 70]
    assert dec.row_slots.tolist() == [3, 1, -1, -1] and dec.src_tok.tolist() == [0, 1, 0, 0]
    assert dec.slot_mapping.tolist() == [9 * PAGE + 6, 2 * PAGE + 5, 9 * PAGE + 6, 9 * PAGE + 6]

    def layout(s):
        return step_layout(s, buf, g.geom, g.max_seqs, None)

    with pytest.raises(ValueError, match="distinct"):
        layout([seqs[0], seqs[0]])
    with pytest.raises(ValueError, match="outside"):  # position 64 is past a one-page table
        layout([StepSeq(tokens=[1, 2, 3], start=62, slot=0, block_table=[0])])
    with pytest.raises(ValueError, match="vocabulary"):
        layout([StepSeq(tokens=[1, 10 ** 6, 2], start=0, slot=0, block_table=[0])])
    with pytest.raises(ValueError, match="3 tokens"):
        layout([seqs[0], StepSeq(tokens=[1, 2], start=0, slot=0, block_table=[0])])


def test_accepts_only_equal_short_chunks(model_tok):
    """accepts_step(): equal lengths 1..64, "last" or "none" logits, no verify, snapshots only at the end of the
    chunk, at most max_num_seqs sequences."""
    g = _static(model_tok).runner.graphs

    def seq(n, slot=0, **kw):
        return StepSeq(tokens=[7] * n, start=0, slot=slot, block_table=[0, 1], **kw)

    assert g.accepts_step([seq(1)]) and g.accepts_step([seq(2)]) and g.accepts_step([seq(64), seq(64, 1)])
    assert g.accepts_step([seq(7, i) for i in range(8)])
    assert not g.accepts_step([seq(65)])  # past the recurrent kernel's range: the eager chunk kernel
    assert not g.accepts_step([seq(3), seq(4, 1)])  # unequal lengths
    assert g.accepts_step([seq(64, snapshots=[(64, 0)])])  # at the chunk's end: copied from the pools after the run
    assert not g.accepts_step([seq(40, snapshots=[(32, 0)])])  # inside the chunk: needs the chunk kernel's states
    assert not g.accepts_step([seq(3, spec=True)])  # a verify step
    assert not g.accepts_step([seq(3, logits="all")])  # prompt logprobs: the eager path
    assert g.accepts_step([seq(64, logits="none"), seq(64, 1)])  # a prefill chunk that is not the prompt's last
    assert not g.accepts_step([seq(3, i) for i in range(MAX_SEQS + 1)]) and not g.accepts_step([])


@pytest.mark.parametrize("T", [1, 5])
def test_inert_run_changes_nothing(model_tok, caches, T):
    """The warm-up inputs used before a capture (live = 0, no recurrent slot) leave every cache bit-identical."""
    eng = _static(model_tok)
    _Seqs(eng, _prompts([70, 3]), extra=8)
    buf = eng.runner.graphs.buffers("step", 4, T, 2)
    before = caches.pools(eng)
    fill_inert(buf)
    step_forward(eng.runner, buf)
    assert all(torch.equal(x, y) for x, y in zip(before, caches.pools(eng)))


@pytest.mark.parametrize("T", [1, 5])
def test_step_forward_does_no_host_sync(model_tok, monkeypatch, forbid_host_sync, T):
    """step_forward must be capturable: any Tensor -> Python conversion (.item, .tolist, bool, int, float, index,
    numpy) raises inside it."""
    eng = _static(model_tok)
    seqs = _Seqs(eng, _prompts([70, 3, 9]), extra=10)
    g = eng.runner.graphs
    buf = g.buffers("step", 4, T, 2)
    buf.ints.copy_(step_layout(seqs.batch(_prompts([T] * 3, seed=1)), buf, g.geom, g.max_seqs, None))
    ref_logits, _ = step_forward(eng.runner, buf)  # first run outside the patch: one-time probes (MoE) may sync
    seqs.advance([[0] * T] * 3)
    buf.ints.copy_(step_layout(seqs.batch(_prompts([T] * 3, seed=2)), buf, g.geom, g.max_seqs, None))

    forbid_host_sync("step_forward")
    logits, _ = step_forward(eng.runner, buf)
    monkeypatch.undo()
    assert logits.shape == (4, eng.model.config.vocab_size) and torch.isfinite(logits).all()
    assert not torch.equal(logits[:3], ref_logits[:3])  # the second step really ran (states moved on)


def test_steps_run_on_the_smallest_larger_compiled_bucket(model_tok, caches, monkeypatch):
    """With compile on, a decode step whose own bucket has no compiled graph runs the smallest larger compiled bucket
    of its page width (padded rows inert): 3 sequences (bucket 4) run on the compiled bucket 8, not on a bucket 4 of
    their own, and their greedy tokens, logits and caches equal the eager runner's. Here "compiled" is a flag set on
    shapes of the plain function (no GPU, no inductor)."""
    routed = []

    def prepare(eng):
        g = eng.runner.graphs
        monkeypatch.setattr(g, "compile", True)
        monkeypatch.setattr(g, "_compiled", {"step": lambda b: step_forward(eng.runner, b)})  # no inductor here
        for Gb in (1, 2, 4, 8):
            for Bb in (1, 8):
                g.buffers("step", Bb, 1, Gb).compiled = True
        real = g.buffers
        monkeypatch.setattr(g, "buffers", lambda *key: routed.append(key) or real(*key))

    eng = _twin(model_tok, caches, [63, 120, 10], T=1, steps=6, prepare=prepare)
    g = eng.runner.graphs
    assert routed and {key[1] for key in routed} == {8} and not any(key[1] == 4 for key in g.shapes)
    assert g._compiled_bucket(("step", 1, 1, 1)) == ("step", 1, 1, 1)
    assert g._compiled_bucket(("step", 2, 1, 2)) == ("step", 8, 1, 2)
    assert g._compiled_bucket(("step", 16, 1, 1)) == ("step", 16, 1, 1)  # no larger compiled bucket: its own
    g.shapes[("step", 8, 1, 4)].failed = True
    assert g._compiled_bucket(("step", 4, 1, 4)) == ("step", 4, 1, 4)  # a failed capture is no target


def test_page_bucket_is_one_width_with_the_triton_paged_kernel(model_tok, monkeypatch):
    """With PyTorch attention the block-table width follows the longest sequence in powers of two; with the Triton
    paged kernel on CUDA (which reads keys up to each row's position only) it is always max_pages, so one graph per
    batch bucket serves every context length."""
    import k3.serve.graphs as graphs_mod

    g = _static(model_tok).runner.graphs
    assert [g.page_bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    monkeypatch.setattr(graphs_mod, "paged_attention_bounded", lambda dev: True)
    assert {g.page_bucket(n) for n in (1, 3, 8)} == {MAX_LEN // PAGE}


def _record_captures(g, monkeypatch):
    """Pretend to capture (no GPU here): every capture_fn call is recorded as (key, compiled) and counted."""
    used = []

    def fake(buf, key, fn, inert):
        used.append((key, fn is g._compiled.get("step")))
        buf.graph = "captured"  # a graph stands in; launch() must not be reached in these tests
        g.used += 1

    monkeypatch.setattr(g, "capture", True)
    monkeypatch.setattr(g, "capture_fn", fake)
    return used


def test_warmup_captures_the_configured_batch_sizes(model_tok, monkeypatch):
    """ServeConfig.cuda_graph_batches (`k3 serve --cuda-graph-batches`) is what the warm-up captures: the decode
    buckets of those sizes (capped at max_num_seqs), then, uncompiled, every bucket up to the largest, then the
    prefill-chunk lengths 64..2 of every bucket up to the largest; nothing else."""
    with pytest.raises(ValueError, match="cuda_graph_batches"):
        ServeConfig(cuda_graph_batches=[0, 8])
    eng = _static(model_tok, cuda_graph_batches=[1, 3, 64])
    asked = []
    real = eng.runner.capture_graphs
    monkeypatch.setattr(eng.runner, "capture_graphs", lambda batches=None: asked.append(batches) or real(batches))
    eng.warmup()
    assert asked == [[1, 3, 64]]
    eng = _static(model_tok)
    used = _record_captures(eng.runner.graphs, monkeypatch)
    eng.runner.graphs.capture_common((1, 3, 64))
    decodes = [("step", Bb, 1, 1) for Bb in (1, 4, 2, 8)]  # 1, 3 -> 4, 64 -> 8 (capped), then 2 (every bucket)
    chunks = [("step", Bb, T, 1) for Bb in (1, 2, 4, 8) for T in (64, 32, 16, 8, 4, 2)]
    assert [key for key, _ in used] == decodes + chunks and CHUNK_LENGTHS == (2, 4, 8, 16, 32, 64)
    assert not any(compiled for _, compiled in used)


def test_compile_applies_to_warmup_decode_and_verify_shapes_only(model_tok, monkeypatch):
    """With compile_decode, the warm-up's decode and verify shapes are captured from the compiled function; chunk
    shapes, MTP shapes and any shape first met while serving are captured from the plain function (a request never
    waits for a compile)."""
    eng = _engine(model_tok, num_speculative_tokens=2)
    eng.runner.enable_static_steps(compile=True)
    g = eng.runner.graphs
    monkeypatch.setattr(g, "_compiled", {"step": lambda b: step_forward(eng.runner, b)})  # no inductor here
    used_list = _record_captures(g, monkeypatch)
    g.capture_common((1,))
    g.buffers("step", 2, 1, 1)
    used = dict(used_list)
    assert used[("step", 1, 1, 1)] and used[("verify", 1, 3, 1)]
    assert not used[("step", 2, 1, 1)] and not used[("step", 1, 64, 1)] and not used[("mtp", 1, 4, 1)]
    assert {k for k in used if k[0] == "mtp"} == {("mtp", 1, T, 1) for T in (1, 2, 3, 4)}


def test_warmup_compiles_its_shapes_before_serving_any(model_tok, monkeypatch):
    """Engine.warmup captures the configured batch sizes first, so with compile_decode those shapes are the compiled
    ones, although the warm-up's own requests (n = 2) decode at batch 2 too. Captures are recorded, then marked
    failed so the steps run eagerly on this CPU."""
    eng = _engine(model_tok, cuda_graph_batches=[1, 2])
    eng.runner.enable_static_steps(compile=True)
    g, used = eng.runner.graphs, {}
    monkeypatch.setattr(g, "_compiled", {"step": lambda b: step_forward(eng.runner, b)})

    def fake_capture(buf, key, fn, inert):
        used.setdefault(key, fn is g._compiled["step"])
        buf.failed = True

    monkeypatch.setattr(g, "capture", True)
    monkeypatch.setattr(g, "capture_fn", fake_capture)
    eng.warmup()
    assert used[("step", 1, 1, 1)] and used[("step", 2, 1, 1)]


def test_chunks_of_odd_lengths_under_both_caps(model_tok, monkeypatch):
    """Chunk shapes share the graph budget; beyond MAX_TAIL_GRAPHS captured chunks of lengths other than
    CHUNK_LENGTHS (or the shared cap) a new shape is not captured (it runs eagerly on its buffers) while the captured
    ones keep their graphs; the chunk lengths stay outside the tail cap."""
    g = _static(model_tok).runner.graphs
    used = _record_captures(g, monkeypatch)
    odd = [n for n in range(3, 64) if n & (n - 1)][:MAX_TAIL_GRAPHS]  # lengths that are not powers of two
    for T in odd:
        assert g.buffers("step", 1, T, 1).graph is not None
    assert [key for key, _ in used] == [("step", 1, T, 1) for T in odd]
    assert g.buffers("step", 2, 3, 1).graph is None and len(used) == MAX_TAIL_GRAPHS  # over the tail cap: eager
    assert g.buffers("step", 1, 3, 1).graph is not None  # captured shapes still serve
    for T in CHUNK_LENGTHS:  # chunk lengths: outside that cap
        assert g.buffers("step", 8, T, 1).graph is not None
    assert len(used) == MAX_TAIL_GRAPHS + len(CHUNK_LENGTHS)
    monkeypatch.setattr(g, "max_tail_graphs", 64)
    g.used = g.max_graphs  # the shared cap reached (by any kind of graph)
    assert g.buffers("step", 4, 3, 1).graph is None and g.buffers("step", 8, 64, 2).graph is None
    assert g.buffers("step", 1, 1, 4).graph is None
    assert len(used) == MAX_TAIL_GRAPHS + len(CHUNK_LENGTHS)


def test_engine_text_unchanged_with_static_steps(model_tok):
    """Concurrent requests joining at different steps: same text and token ids with the static path on (CPU eager,
    prefix caching on so snapshot steps take the eager path where a boundary falls inside a chunk) as off."""
    prompts = _prompts([5, 63, 64, 100, 30])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _serve_joining(_engine(model_tok, enable_prefix_caching=True), prompts, params)
    eng = _static(model_tok, enable_prefix_caching=True)
    g = eng.runner.graphs
    calls, real = [], g.step
    g.step = lambda seqs: calls.append(len(seqs)) or real(seqs)
    fast = _serve_joining(eng, prompts, params)
    assert fast == plain
    assert all(len(ids) == 24 for _, ids in fast.values())
    assert max(calls) >= 3 and len(calls) >= 15  # the static path served the batched decode steps


def _serve_joining(eng, prompts, params):
    """Submit one prompt per engine step (requests join a running batch); {prompt index: (text, token ids)}."""
    out = {i: ([], []) for i in range(len(prompts))}

    def sink_for(i):
        return lambda ev: (out[i][0].append(ev.text), out[i][1].extend(ev.token_ids))

    for i, p in enumerate(prompts):
        eng.submit(p, params, sink_for(i))
        eng.step()
    while eng.has_work():
        eng.step()
    return {i: ("".join(t), ids) for i, (t, ids) in out.items()}


def test_capture_refused_without_cuda(model_tok):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    eng = _engine(model_tok, cuda_graphs=True)  # on a CPU model the option captures nothing
    assert not eng.runner.graphs.capture and not eng.runner.static_steps
    with pytest.raises(ValueError, match="CUDA device"):
        eng.runner.enable_static_steps(capture=True)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [[62], [60, 62, 127, 5, 64]], ids=["B1", "B5-pad8"])
def test_cuda_decode_replay_equals_eager(model_tok, lengths, caches):
    """Captured decode graphs (one per batch x page bucket; on the Triton backend one page width serves every
    context) replay the eager step: greedy tokens identical, logits close, padded rows inert, no capture failure."""
    eng = _twin(model_tok, caches, lengths, T=1, steps=20, capture=True, device="cuda")
    g = eng.runner.graphs
    assert g.used == len(g.shapes) >= 1 and not any(b.failed for b in g.shapes.values())
    assert all(b.graph is not None for b in g.shapes.values())


@pytest.mark.cuda
@pytest.mark.parametrize("T", [7, 64])
@pytest.mark.parametrize("lengths", [[62], [63, 120, 10]], ids=["B1", "B3-pad4"])
def test_cuda_chunk_replay_equals_eager(model_tok, lengths, T, caches):
    """Captured prefill-chunk graphs replay the eager step: logits close, greedy tokens identical, caches equal,
    padded rows inert, no capture failure."""
    eng = _twin(model_tok, caches, lengths, T, steps=2, capture=True, device="cuda")
    g = eng.runner.graphs
    assert g.used == len(g.shapes) >= 1 and not any(b.failed for b in g.shapes.values())


@pytest.mark.cuda
def test_cuda_engine_warmup_captures_and_serves(model_tok):
    model, tok = model_tok
    gpu = (copy.deepcopy(model).to("cuda"), tok)
    prompts = _prompts([5, 70, 33])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = []
    for on in (False, True):
        eng = _engine(gpu, cuda_graphs=on)
        eng.warmup()
        if on:
            g = eng.runner.graphs
            g1 = g.page_bucket(1)
            assert {("step", 1, 1, g1), ("step", 8, 1, g1)} <= set(g.shapes)
            assert not any(b.failed for b in g.shapes.values())
        texts.append([[t for e in eng.generate(p, params)[0] for t in e.token_ids] for p in prompts])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("B,Bb", [(1, 1), (3, 4), (32, 32), (5, 64)])
def test_decode_layout_equals_the_array_layout(B, Bb):
    """The list-built T = 1 layout (decode's host path) is the numpy layout of the same step, field for field."""
    from k3.serve.static import _chunk_layout, _decode_layout

    g = torch.Generator().manual_seed(B * 100 + Bb)
    Gb, ps = 3, 16
    tokens = torch.randint(0, 500, (B,), generator=g).tolist()
    starts = torch.randint(0, Gb * ps, (B,), generator=g).tolist()
    slots = torch.randperm(128, generator=g)[:B].tolist()
    table = torch.randint(0, 40, (B * Gb,), generator=g).tolist()
    got = _decode_layout(tokens, starts, slots, table, Bb, Gb, ps)
    want = _chunk_layout(tokens, starts, slots, table, Bb, 1, Gb, ps)
    assert got.dtype == want.dtype == torch.long and torch.equal(got, want)
