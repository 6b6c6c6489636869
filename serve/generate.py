"""In-process generation for `k3 generate`: one prefill, then one recurrent decode step per token.

The prompt is consumed once (chunked KDA + MHA-mode MLA filling the inference state); each new token then costs
one decode forward against the state (recurrent KDA step, absorbed MLA over the latent cache), never a re-run of
the prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from k3.model.transformer import K3Model

from .sampling import sample


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
