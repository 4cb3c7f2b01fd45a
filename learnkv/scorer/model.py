"""Scorer: a lightweight per-layer MLP over the trace features. No Lightning here: this is what gets exported,
loaded by the `learned` policy and by the serving runtime.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from learnkv import kernels
from learnkv.features import N_FEATURES


class Scorer(nn.Module):
    """One small MLP per decoder layer, shared by the layer's KV heads; higher score = keep.

    Features are standardised with statistics fitted on the training split (buffers ``mean``/``std``, saved with
    the weights). The per-layer weights are stacked tensors, so scoring every cached token of a layer is two
    batched matmuls.

    Parameters
    ----------
    n_layers : int
        Decoder layers of the model the scorer is for.
    n_features : int
        Length of the feature list.
    hidden : int
        Hidden width.
    content_dim : int
        0, or the head dimension D of the tokens' value vectors: a linear gate per layer and KV head on each token's
        value (its content at creation, a projection of its hidden state: TRIM-KV's signal) is added to the score.
    n_heads : int
        KV heads (for the content gate and the head bias).
    head_bias : bool
        A learned offset per layer and KV head added to every score of the head (``bh [n_layers, n_heads]``,
        starting at zero): the KV head's identity, for a scorer trained with the global objective
        (`learnkv.scorer.module`, ``objective="global"``), whose scores must compare across heads. The per-layer
        weights already know the layer; heads of a layer share them, and differ in how much utility they hold. It
        moves no token within a head, so a per-head ranking (``uniform``) is the same with or without it.
    """

    def __init__(self, n_layers: int, n_features: int = N_FEATURES, hidden: int = 32, content_dim: int = 0,
                 n_heads: int = 0, head_bias: bool = False):
        super().__init__()
        self.n_layers, self.n_features, self.hidden = n_layers, n_features, hidden
        self.content_dim, self.n_heads, self.head_bias = content_dim, n_heads, head_bias
        if (content_dim or head_bias) and n_heads < 1:
            raise ValueError("a scorer with content features or a head bias needs n_heads >= 1")
        if content_dim:
            self.wc = nn.Parameter(torch.zeros(n_layers, n_heads, content_dim))
        if head_bias:
            self.bh = nn.Parameter(torch.zeros(n_layers, n_heads))
        self.w1 = nn.Parameter(torch.randn(n_layers, n_features, hidden) * n_features**-0.5)
        self.b1 = nn.Parameter(torch.zeros(n_layers, hidden))
        self.w2 = nn.Parameter(torch.randn(n_layers, hidden) * hidden**-0.5)
        self.b2 = nn.Parameter(torch.zeros(n_layers))
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))

    def config(self) -> dict:
        cfg = {"n_layers": self.n_layers, "n_features": self.n_features, "hidden": self.hidden}
        if self.content_dim or self.head_bias:
            cfg.update(content_dim=self.content_dim, n_heads=self.n_heads)
        if self.head_bias:
            cfg.update(head_bias=True)
        return cfg

    def set_normalization(self, mean: Tensor, std: Tensor) -> None:
        self.mean.copy_(mean)
        self.std.copy_(std.clamp(min=1e-6))

    def forward(self, features: Tensor, layer: int | Tensor, values: Tensor | None = None,
                content: Tensor | None = None, consume: bool = False) -> Tensor:
        """``features [..., F]`` of tokens of ``layer`` (an int, or a LongTensor broadcastable to ``[...]``) -> ``[...]``.

        A scorer with content features also needs ``values [B, H, T, D]`` (features then ``[B, H, T, F]``; ``layer``
        an int, or ``[B, 1, 1]`` in training), or their `content_term` computed earlier (``content [B, H, T]``:
        a token's value never changes, so the serving runtime computes it once, when the token is written). A
        scorer with a head bias needs features ``[..., H, T, F]`` too. With ``consume`` (a caller that owns
        ``features`` and reads them no more: the learned policy's fresh read-out) an fp32 ``features`` is
        standardised in place at inference: the same scores, bit for bit, without a second ``[..., F]`` tensor."""
        score = self._mlp(features, layer, consume)
        if self.head_bias:
            bias = self.bh[layer] if isinstance(layer, int) else self.bh[layer.reshape(-1)][:, :, None]
            score = score + (bias[:, None] if isinstance(layer, int) else bias)
        if not self.content_dim:
            return score
        if content is None:
            if values is None:
                raise ValueError("this scorer reads the tokens' value vectors (content features): pass values")
            content = self.content_term(values, layer)
        return score + content

    def content_term(self, values: Tensor, layer: int | Tensor) -> Tensor:
        """The content gate's score of each token: ``values [..., H, T, D]`` -> ``[..., H, T]`` for an int ``layer``
        (``[N, H, T, D]`` with ``layer [N, ...]`` in training)."""
        if isinstance(layer, int):
            # a product summed over D, not a matmul: a token's term must not depend on the tokens beside it (the
            # learned policy caches each token's, computed with the step's new tokens alone, `learned.cached_content`),
            # and a matmul of one token takes another kernel than of several, which rounds otherwise on some CPUs
            # (AVX-512: ~1e-6 apart)
            return (values.float() * self.wc[layer][:, None, :]).sum(-1)
        return torch.einsum("nhtd,nhd->nht", values.float(), self.wc[layer.reshape(-1)])

    def _mlp(self, features: Tensor, layer: int | Tensor, consume: bool = False) -> Tensor:
        if isinstance(layer, int) and not torch.is_grad_enabled() and kernels.use_triton(features):
            # inference on the kernel path (the learned policy on GPU): one fused launch; the kernel has no backward
            w = (self.mean, self.std, self.w1[layer], self.b1[layer], self.w2[layer], self.b2[layer])
            return kernels.scorer_mlp(features.reshape(-1, features.shape[-1]), *w).view(features.shape[:-1])
        if isinstance(layer, int) and not torch.is_grad_enabled():
            # inference: the ops below, element for element, in place where they would allocate (the standardised
            # copy of the features, the hidden layer's temporaries; bench/RESULTS.md). Folding the standardisation
            # into w1 would save its pass too, but rounds otherwise (scores ~2e-6 apart at 1.5k slots x 24 rows, not
            # bit for bit), so it is not done.
            own = consume and features.dtype == torch.float32
            x = (features.sub_(self.mean) if own else features.float() - self.mean).div_(self.std)
            # ``torch.addmm`` would add b1 in the matmul's output pass, but rounds otherwise at a few rows. ``features``
            # may be the learned policy's feature-major view: the matmul reads it with the same bits
            h = torch.matmul(x, self.w1[layer]).add_(self.b1[layer]).relu_()
            return h @ self.w2[layer] + self.b2[layer]
        x = (features.float() - self.mean) / self.std
        if isinstance(layer, int):
            h = torch.relu(x @ self.w1[layer] + self.b1[layer])
            return h @ self.w2[layer] + self.b2[layer]
        layer = layer.expand(x.shape[:-1])
        h = torch.relu(torch.einsum("...f,...fh->...h", x, self.w1[layer]) + self.b1[layer])
        return (h * self.w2[layer]).sum(-1) + self.b2[layer]

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
