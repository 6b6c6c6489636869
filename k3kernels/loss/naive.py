"""The LM head + cross-entropy in plain PyTorch, whole: the reference twin of the chunked op (chunked.py).

Legend: N tokens, D width, V vocab.

    loss = mean over counted i of ( logsumexp_v z_iv - z_i,t_i ),   z = h W^T,   targets t_i = -100 not counted

The logits z [N, V] exist whole: in W's dtype (the autocast dtype under autocast), the softmax in fp32 at least
(float64 stays float64). This is what the train loop computed before the fused op.
"""

import torch
import torch.nn.functional as F


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Mean CE of F.linear(h, weight) [N, V] against targets [N] (-100 ignored): a scalar in fp32 (float64 for
    float64 inputs); NaN when no target is counted, as F.cross_entropy.

    Example: linear_cross_entropy(torch.zeros(3, 8), torch.randn(5, 8), torch.tensor([0, 4, -100])) == log(5).
    """
    z_NV = F.linear(h_ND, weight_VD)
    return F.cross_entropy(z_NV.to(torch.promote_types(z_NV.dtype, torch.float32)), targets_N, ignore_index=-100)
