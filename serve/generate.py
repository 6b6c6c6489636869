"""In-process generation for `k3 generate`.

`stream_text` runs one prompt through the serving engine (k3.serve.engine: chunked prefill, then one decode step per
token over the paged latent cache and the KDA state pool; on a GPU each decode step replays a CUDA graph) and yields
text pieces as they are detokenized. `generate_tokens` is the plain reference loop over `K3Model.forward` with an
InferenceState (one prefill, then one recurrent step per token), kept as the independent check of the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from k3.model.tokenizer import K3Tokenizer
from k3.model.transformer import K3Model

from .config import ServeConfig
from .engine import Engine
from .request import SamplingParams, SeqEvent
from .sampling import sample


def stream_text(model: K3Model, tok: K3Tokenizer, prompt_ids: list[int], *, max_tokens: int = 128,
                temperature: float = 0.8, top_p: float = 0.95, top_k: int = 0,
                seed: int | None = None) -> Iterator[SeqEvent]:
    """Yield the engine's events (new text, token ids, finish reason) for one prompt, stopping at EOS or
    `max_tokens`. The engine is sized for this one sequence; on a GPU its decode steps run as CUDA graphs."""
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token (e.g. a BOS token)")
    block = 64
    max_len = -(-(len(prompt_ids) + max_tokens) // block) * block
    dev = next(model.parameters()).device
    cfg = ServeConfig(device=dev.type, max_num_seqs=1, max_model_len=max_len, enable_prefix_caching=False,
                      warmup=False, cuda_graphs=dev.type == "cuda")
    engine = Engine(model, tok, cfg)
    events: list[SeqEvent] = []
    engine.submit(prompt_ids, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                             max_tokens=max_tokens), events.append)
    done = False
    while not done:
        engine.step()
        while events:
            ev = events.pop(0)
            done = done or ev.finish_reason is not None
            yield ev


@torch.no_grad()
def generate_tokens(model: K3Model, prompt_ids: list[int], *, max_tokens: int = 128, temperature: float = 0.8,
                    top_p: float = 0.95, top_k: int = 0, seed: int | None = None,
                    stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids for one prompt; stops after emitting a token in `stop_ids`."""
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token (e.g. a BOS token)")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    device = next(model.parameters()).device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    state = model.new_state(1)
    logits = model(torch.tensor([prompt_ids], device=device), state=state).logits[:, -1]
    for _ in range(max_tokens):
        tok = sample(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=gen)
        t = int(tok.item())
        yield t
        if t in stop_ids:
            return
        logits = model(tok.view(1, 1), state=state).logits[:, -1]


def generate_batch(model: K3Model, tok: K3Tokenizer, prompts: list[list[int]], *, max_tokens: int,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 0,
                   on_finish: Callable[[int], None] | None = None, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seeds: list[int] | None = None) -> list[list[int]]:
    """Completions of many prompts through one engine (continuous batching: chunked prefill, then batched
    recurrent decode): the new token ids of each prompt, in order, each ending at EOS or `max_tokens`. Greedy by
    default; temperature > 0 samples, prompt i with its own generator seeded by seeds[i] (reproducible whatever
    the batch). on_finish(i) is called as prompt i completes (progress bars). Example:
    generate_batch(model, tok, [tok.encode("def ", add_bos=True)] * 4, max_tokens=8)"""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt")
    block = 64
    max_len = -(-(max(len(p) for p in prompts) + max_tokens) // block) * block
    dev = next(model.parameters()).device
    cfg = ServeConfig(device=dev.type, max_num_seqs=min(max_num_seqs, len(prompts)), max_model_len=max_len,
                      max_num_batched_tokens=max_num_batched_tokens, max_queue=max(512, len(prompts)),
                      enable_prefix_caching=False, warmup=False, cuda_graphs=dev.type == "cuda",
                      request_timeout_s=0)  # offline: the last of many queued prompts may wait past a server's limit
    engine = Engine(model, tok, cfg)
    outs: list[list[int]] = [[] for _ in prompts]
    errors: list[str] = []

    def sink_for(i: int):
        def sink(ev: SeqEvent) -> None:
            outs[i].extend(ev.token_ids)
            if ev.error:
                errors.append(ev.error)
            if ev.finish_reason is not None and on_finish is not None:
                on_finish(i)
        return sink

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=None if seeds is None else seeds[i])
        engine.submit(p, params, sink_for(i))
    while engine.has_work():
        engine.step()
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
    return outs
