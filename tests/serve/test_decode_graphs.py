"""Decode fast path (k3.serve.graphs): the static-buffer decode step, run eagerly on the CPU (the function CUDA
captures), equals ModelRunner.step; padded rows touch no real state; it does no host sync; the engine's text is
unchanged with it on; on CUDA a captured graph's replay equals the eager step.

Legend: B sequences in a step, Bb batch bucket, L layers."""

import copy
import math

import pytest
import torch

from k3.kernels.kda import fused_recurrent_kda
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_pool_trusted
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.graphs import DecodeBuffers, bucket, warm_buckets
from k3.serve.request import SamplingParams
from k3.serve.runner import StepSeq

MAX_SEQS, MAX_LEN, PAGE = 8, 512, 64


def _engine(model_tok, **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False,
           "enable_prefix_caching": False, **kw}
    return Engine(model, tok, ServeConfig(**cfg))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


class _Seqs:
    """B decoding sequences driven by hand through one engine's runner (no scheduler), plus one idle bystander
    that owns slot 0 and a page but is never scheduled."""

    def __init__(self, eng, prompts, steps):
        self.eng = eng
        bystander = eng.states.allocate()  # slot 0: padded rows must never write it
        eng.runner.step([StepSeq(tokens=[5, 6, 7], start=0, slot=bystander, block_table=[eng.pages.allocate()])])
        self.slots = [eng.states.allocate() for _ in prompts]
        self.tables = [[eng.pages.allocate() for _ in range(math.ceil((len(p) + steps) / PAGE))] for p in prompts]
        self.pos = [len(p) for p in prompts]
        self.next = []
        for p, s, bt in zip(prompts, self.slots, self.tables):
            out = eng.runner.step([StepSeq(tokens=p, start=0, slot=s, block_table=bt[:math.ceil(len(p) / PAGE)])])
            self.next.append(int(out.logits[0][-1].argmax()))

    def batch(self):
        """This step's StepSeqs; block tables cover exactly positions [0, pos] as the engine's _grow does."""
        return [StepSeq(tokens=[t], start=p, slot=s, block_table=bt[:p // PAGE + 1])
                for t, p, s, bt in zip(self.next, self.pos, self.slots, self.tables)]

    def advance(self, logits):
        self.next = [int(lg[-1].argmax()) for lg in logits]
        self.pos = [p + 1 for p in self.pos]


def _twin_decode(model_tok, caches, lengths, steps, capture=False, device="cpu", tol=1e-5, prepare=None):
    """Run the same decode steps through ModelRunner.step (engine A) and the decode fast path (engine B); compare
    greedy tokens and logits every step, cache contents at the end, and check that nothing outside the batch's
    own slots and new latent rows changed in B (prepare(engine B), if given, runs before the first step). Returns
    engine B."""
    model, tok = model_tok
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    eng_a = _engine((model, tok), cuda_graphs=False)
    eng_b = _engine((model, tok), cuda_graphs=False)
    eng_b.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=capture)
    if prepare is not None:
        prepare(eng_b)
    prompts = _prompts(lengths)
    a, b = _Seqs(eng_a, prompts, steps), _Seqs(eng_b, prompts, steps)
    assert a.slots == b.slots and 0 not in b.slots
    for _ in range(steps):
        batch = b.batch()
        assert eng_b.runner.graphs.accepts(batch)
        before = caches.pools(eng_b)
        out_a, out_b = eng_a.runner.step(a.batch()), eng_b.runner.graphs.step(batch)
        assert out_b is not None
        for la, lb in zip(out_a.logits, out_b.logits):
            assert lb.shape == la.shape == (1, model.config.vocab_size) and lb.dtype == torch.float32
            torch.testing.assert_close(lb, la, atol=tol, rtol=0)
        torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=tol, rtol=0)
        a.advance(out_a.logits)
        b.advance(out_b.logits)
        assert a.next == b.next  # greedy tokens identical
        caches.untouched(eng_b, before, batch, PAGE)
    for x, y in zip(caches.pools(eng_a), caches.pools(eng_b)):
        torch.testing.assert_close(y, x, atol=tol, rtol=0)
    return eng_b


# ------------------------------------------------------------------------------------------------------------ tests


def test_buckets():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(5, 6) == 6 and bucket(3, 3) == 3
    assert warm_buckets([1, 8, 32], 64) == [1, 2, 4, 8, 16, 32] and warm_buckets([3], 2) == [1, 2]
    assert warm_buckets([5], 6) == [1, 2, 4, 6] and warm_buckets([], 8) == []


def _recurrent_case(seed: int, B: int, T: int, P: int, H: int = 2, K: int = 8):
    """Random q, k, v, z [B, T, H, K], beta [B, T, H], a pool [P, H, K, K] and the in-kernel gate settings."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, z = (torch.randn(B, T, H, K, generator=g) for _ in range(4))
    beta = torch.randn(B, T, H, generator=g)
    pool = torch.randn(P, H, K, K, generator=g)
    kw = {"A_log": torch.randn(H, generator=g), "dt_bias": torch.randn(H * K, generator=g), "lower_bound": -5.0,
          "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    return (q, k, v, z, beta), pool, kw


def test_trusted_recurrent_equals_public_function():
    """fused_recurrent_kda_pool_trusted == fused_recurrent_kda on a pool, unnamed (-1) rows included, and slots
    not named stay bit-identical."""
    P = 6
    (q, k, v, z, beta), pool, kw = _recurrent_case(0, B=4, T=2, P=P)
    for idx in ([3, -1, 0, -1], [-1, -1, -1, -1], [5, 1, 2, 4]):
        idx = torch.tensor(idx)
        ref_pool, new_pool = pool.clone(), pool.clone()
        o_ref, _ = fused_recurrent_kda(q, k, v, z, beta, initial_state=ref_pool, ssm_state_indices=idx, **kw)
        o_new = fused_recurrent_kda_pool_trusted(q, k, v, z, beta, pool=new_pool, ssm_state_indices=idx, **kw)
        assert torch.equal(o_new, o_ref) and torch.equal(new_pool, ref_pool)
        untouched = torch.ones(P, dtype=torch.bool)
        untouched[idx[idx >= 0]] = False
        assert torch.equal(new_pool[untouched], pool[untouched])


def test_trusted_recurrent_per_token_slots_equal_public_function():
    """Per-token slots [B, T] (speculative verification): the trusted entry == the public function with
    num_accepted_tokens = 1 (start from slot [:, 0], the state after token t in slot [:, t]), unnamed rows included;
    other slots bit-identical."""
    B, P = 3, 12
    (q, k, v, z, beta), pool, kw = _recurrent_case(1, B=B, T=3, P=P)
    for idx in ([[0, 6, 7], [1, 8, 9], [2, 10, 11]], [[4, 5, 3], [-1, -1, -1], [2, 10, 11]]):
        idx = torch.tensor(idx)
        ref_pool, new_pool = pool.clone(), pool.clone()
        o_ref, _ = fused_recurrent_kda(q, k, v, z, beta, initial_state=ref_pool, ssm_state_indices=idx,
                                       num_accepted_tokens=torch.ones(B, dtype=torch.long), **kw)
        o_new = fused_recurrent_kda_pool_trusted(q, k, v, z, beta, pool=new_pool, ssm_state_indices=idx, **kw)
        torch.testing.assert_close(o_new, o_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(new_pool, ref_pool, atol=1e-6, rtol=1e-6)
        untouched = torch.ones(P, dtype=torch.bool)
        untouched[idx[idx >= 0]] = False
        assert torch.equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("lengths", [[62], [63, 120, 10], [60, 62, 127, 5, 64]], ids=["B1", "B3-pad4", "B5-pad8"])
def test_decode_path_equals_runner_step(model_tok, lengths, caches):
    """Batch 1, 3 (bucket 4), 5 (bucket 8); positions crossing page boundaries 64 and 128 (page buckets 1, 2, 4);
    greedy tokens identical and fp32 logits within 1e-5 over 20 steps; padded rows leave other slots, tails and
    pages bit-identical (checked every step)."""
    eng = _twin_decode(model_tok, caches, lengths, steps=20)
    Bb = bucket(len(lengths), MAX_SEQS)
    assert {key[0] for key in eng.runner.graphs.shapes} == {Bb}
    assert len({key[1] for key in eng.runner.graphs.shapes}) >= 2  # a page-bucket change happened


def test_steps_run_on_the_smallest_larger_compiled_bucket(model_tok, caches, monkeypatch):
    """With compile on, a step whose own bucket has no compiled graph runs the smallest larger compiled bucket of its
    page width (padded rows inert): 3 sequences (bucket 4) run on the compiled bucket 8, not on a bucket 4 of their
    own, and their greedy tokens, logits and caches equal the eager runner's (_twin_decode's checks). Here "compiled"
    is a flag set on shapes of the plain function (no GPU, no inductor)."""
    routed = []

    def prepare(eng):
        g = eng.runner.graphs
        monkeypatch.setattr(g, "_compiled_fn", lambda buf: g.decode_forward(buf))  # compile "on"
        for Gb in (1, 2, 4, 8):
            for Bb in (1, 8):
                g._buffers(Bb, Gb).compiled = True
        real = g._buffers
        monkeypatch.setattr(g, "_buffers", lambda *key: routed.append(key) or real(*key))

    eng = _twin_decode(model_tok, caches, [63, 120, 10], steps=6, prepare=prepare)
    g = eng.runner.graphs
    assert routed and {key[0] for key in routed} == {8} and not any(key[0] == 4 for key in g.shapes)
    assert g.compiled_bucket((1, 1)) == (1, 1) and g.compiled_bucket((2, 2)) == (8, 2)
    assert g.compiled_bucket((16, 1)) == (16, 1)  # no larger compiled bucket: its own
    g.shapes[(8, 4)].failed = True
    assert g.compiled_bucket((4, 4)) == (4, 4)  # a failed capture is no target


def test_padded_rows_copy_row_zero(model_tok):
    """Host-side layout of a padded step (module docstring of k3.serve.graphs): padded rows repeat row 0's token,
    position, tail slot, latent row and block table, write row 0's values (src_rows 0) and name no recurrent slot
    (-1: a duplicate slot would race inside the Triton kernel); real rows are live."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    graphs = eng.runner.graphs
    seqs = [StepSeq(tokens=[11], start=70, slot=3, block_table=[4, 9]),
            StepSeq(tokens=[12], start=5, slot=1, block_table=[2])]
    buf = DecodeBuffers(4, 2, eng.device)
    buf.ints.copy_(graphs._host_inputs(seqs, 4, 2))
    assert buf.tokens.tolist() == [11, 12, 11, 11] and buf.positions.tolist() == [70, 5, 70, 70]
    assert buf.kda_slots.tolist() == [3, 1, -1, -1] and buf.tail_slots.tolist() == [3, 1, 3, 3]
    assert buf.src_rows.tolist() == [0, 1, 0, 0] and buf.live.tolist() == [1, 1, 1, 1]
    assert buf.slot_mapping.tolist() == [9 * PAGE + 6, 2 * PAGE + 5, 9 * PAGE + 6, 9 * PAGE + 6]
    assert buf.block_table.tolist() == [[4, 9], [2, 0], [4, 9], [4, 9]]
    with pytest.raises(ValueError, match="distinct"):
        graphs._host_inputs([seqs[0], seqs[0]], 2, 2)
    with pytest.raises(ValueError, match="outside"):
        graphs._host_inputs([StepSeq(tokens=[1], start=64, slot=0, block_table=[0])], 1, 1)


def test_inert_run_changes_nothing(model_tok, caches):
    """The warm-up inputs used before a capture (live = 0, no recurrent slot) leave every cache bit-identical."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    seqs = _Seqs(eng, _prompts([70, 3]), steps=1)
    assert seqs.slots
    buf = DecodeBuffers(8, 2, eng.device)
    before = caches.pools(eng)
    eng.runner.graphs._fill_inert(buf)
    eng.runner.graphs.decode_forward(buf)
    assert all(torch.equal(x, y) for x, y in zip(before, caches.pools(eng)))


def test_decode_forward_does_no_host_sync(model_tok, monkeypatch, forbid_host_sync):
    """decode_forward must be capturable: any Tensor -> Python conversion (.item, .tolist, bool, int, float,
    index, numpy) raises inside it."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    seqs = _Seqs(eng, _prompts([70, 3, 9]), steps=1)
    graphs = eng.runner.graphs
    buf = graphs._buffers(4, 2)
    buf.ints.copy_(graphs._host_inputs(seqs.batch(), 4, 2))
    ref_logits, _ = graphs.decode_forward(buf)  # first run outside the patch: one-time probes (MoE) may sync
    buf.ints.copy_(graphs._host_inputs(seqs.batch(), 4, 2))

    forbid_host_sync("decode_forward")
    logits, _ = graphs.decode_forward(buf)
    monkeypatch.undo()
    assert logits.shape == (4, eng.model.config.vocab_size) and torch.isfinite(logits).all()
    assert not torch.equal(logits[:3], ref_logits[:3])  # the second step really ran (states moved on)


def test_engine_text_unchanged_with_fast_path(model_tok):
    """Concurrent requests joining at different steps: same text and token ids with the fast path forced on (CPU
    eager, prefix caching on so snapshot steps fall back to the eager path) as with it off."""
    prompts = _prompts([5, 63, 64, 100, 30])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _serve(_engine(model_tok, enable_prefix_caching=True), prompts, params)
    eng = _engine(model_tok, enable_prefix_caching=True)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    calls, real = [], eng.runner.graphs.step
    eng.runner.graphs.step = lambda seqs: calls.append(len(seqs)) or real(seqs)
    fast = _serve(eng, prompts, params)
    assert fast == plain
    assert all(len(ids) == 24 for _, ids in fast.values())
    assert max(calls) >= 3 and len(calls) >= 15  # the fast path served the batched decode steps


def _serve(eng, prompts, params):
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
    eng = _engine(model_tok, cuda_graphs=True)  # on a CPU model the option is a no-op
    assert eng.runner.graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        eng.runner.enable_decode_graphs(8, capture=True)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [[62], [60, 62, 127, 5, 64]], ids=["B1", "B5-pad8"])
def test_cuda_graph_replay_equals_eager(model_tok, lengths, caches):
    """Captured graphs (one per batch x page bucket; on the Triton backend one page width serves every context, so
    one per batch bucket) replay the eager runner's step: greedy tokens identical, logits close, padded rows inert,
    no capture failure."""
    eng = _twin_decode(model_tok, caches, lengths, steps=20, capture=True, device="cuda", tol=1e-4)
    graphs = eng.runner.graphs
    assert graphs.num_graphs == len(graphs.shapes) >= 1 and not any(b.failed for b in graphs.shapes.values())
    assert all(b.graph is not None for b in graphs.shapes.values())


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
            shapes = eng.runner.graphs.shapes
            g1 = eng.runner.graphs.page_bucket(1)
            assert {(1, g1), (8, g1)} <= set(shapes) and not any(b.failed for b in shapes.values())
        texts.append([[t for e in eng.generate(p, params)[0] for t in e.token_ids] for p in prompts])
    assert texts[0] == texts[1]


def test_page_bucket_is_one_width_with_the_triton_paged_kernel(model_tok, monkeypatch):
    """With PyTorch attention the block-table width follows the longest sequence in powers of two; with the
    Triton paged kernel on CUDA (which reads keys up to each row's position only) it is always max_pages, so one
    graph per batch bucket serves every context length."""
    import k3.serve.graphs as graphs_mod

    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    g = eng.runner.graphs
    assert [g.page_bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    monkeypatch.setattr(graphs_mod, "kernel_backend", lambda: "triton")
    monkeypatch.setattr(eng.runner, "device", torch.device("cuda"))
    assert {g.page_bucket(n) for n in (1, 3, 8)} == {MAX_LEN // PAGE}


def test_warmup_captures_the_configured_batch_sizes(model_tok, monkeypatch):
    """ServeConfig.cuda_graph_batches (`k3 serve --cuda-graph-batches`) is what the warm-up captures: the buckets of
    those sizes, capped at max_num_seqs. On a CPU nothing is captured, so the capture of a shape is observed by
    pretending to capture and recording the buffers requested."""
    with pytest.raises(ValueError, match="cuda_graph_batches"):
        ServeConfig(cuda_graph_batches=[0, 8])
    eng = _engine(model_tok, cuda_graph_batches=[1, 3, 64])
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    asked = []
    real = eng.runner.capture_decode_graphs
    monkeypatch.setattr(eng.runner, "capture_decode_graphs", lambda batches=None: asked.append(batches) or real(batches))
    eng.warmup()
    assert asked == [[1, 3, 64]]
    g, seen = eng.runner.graphs, []
    monkeypatch.setattr(g, "capture", True)
    monkeypatch.setattr(g, "_buffers", lambda *key: seen.append(key))
    eng.runner.capture_decode_graphs([1, 3, 64])
    # the configured sizes first (3 -> bucket 4; 64 > max_num_seqs is skipped), then, uncompiled, every bucket up to
    # the largest the pool can run (64 capped at MAX_SEQS = 8); shapes already captured are not captured again
    assert seen == [(1, 1), (4, 1), (1, 1), (2, 1), (4, 1), (8, 1)]


def test_compile_applies_to_warmup_shapes_only(model_tok, monkeypatch):
    """With compile_decode, the warm-up's shapes are captured from the compiled step; a shape first met while serving
    is captured from the plain step (a request never waits for a compile)."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False, compile=True)
    g, used = eng.runner.graphs, {}
    monkeypatch.setattr(g, "capture", True)
    monkeypatch.setattr(g, "_capture", lambda buf, key, fn=None, inert=None: used.__setitem__(key, fn or g.forward))
    g.capture_common((1,))
    g._buffers(2, 1)
    assert used[(1, 1)] == g._compiled and used[(2, 1)] == g.decode_forward


def test_warmup_compiles_its_shapes_before_serving_any(model_tok, monkeypatch):
    """Engine.warmup captures the configured batch sizes first, so with compile_decode those shapes are the compiled
    ones, although the warm-up's own requests (n = 2) decode at batch 2 too (a shape first met by a step is captured
    plain). Captures are recorded, then marked failed so the steps run eagerly on this CPU."""
    eng = _engine(model_tok, cuda_graph_batches=[1, 2])
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False, compile=True)
    g, used = eng.runner.graphs, {}

    def fake_capture(buf, key, fn=None, inert=None):
        used.setdefault(key, fn or g.forward)
        buf.failed = True

    monkeypatch.setattr(g, "capture", True)
    monkeypatch.setattr(g, "_capture", fake_capture)
    eng.warmup()
    g1 = g.page_bucket(1)
    assert used[(1, g1)] == g._compiled and used[(2, g1)] == g._compiled
