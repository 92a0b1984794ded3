"""Training on packed documents through `flashgen.attention_varlen`.

Documents of different lengths are concatenated into one row with no padding; position ids
restart at 0 with each document (so rotary embeddings see every document from its start),
and `cu_seqlens` tells attention where documents begin, so none attends across a boundary.
Every token is a real token: no FLOPs go to padding.

    python examples/packed_training.py            # a GPU: bf16, a few hundred tokens a step
    TRITON_INTERPRET=1 python examples/packed_training.py --steps 3 --device cpu   # CPU
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
from torch import nn

import flashgen

#: (q (T, Hq, D), k, v (T, Hkv, D), cu_seqlens, longest) -> (T, Hq, D), causal per document
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def flashgen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                    longest: int) -> torch.Tensor:
    return flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)


def pack(docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(tokens (T,), position ids restarting per document (T,), cu_seqlens int32, longest)."""
    tokens = torch.cat(list(docs))
    positions = torch.cat([torch.arange(len(d), device=d.device) for d in docs])
    lens = torch.tensor([len(d) for d in docs], device=tokens.device)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    return tokens, positions, cu, int(lens.max())


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (T, H, D) at `positions` (T,)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor,
                longest: int, attend: Attend) -> torch.Tensor:
        h = self.norm1(x)
        q = self.q(h).view(len(x), self.heads, self.head_dim)
        k, v = self.kv(h).view(len(x), 2, self.kv_heads, self.head_dim).unbind(1)
        q, k = rotary(q, positions), rotary(k, positions)
        x = x + self.out(attend(q, k, v, cu, longest).reshape(len(x), -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor,
                longest: int, attend: Attend = flashgen_attend) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, cu, longest, attend)
        return self.head(x)


def packed_loss(logits: torch.Tensor, tokens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Next-token loss that never predicts across a document boundary: a document's last
    token has no target."""
    last = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
    last[cu[1:].long() - 1] = True
    targets = tokens.roll(-1).masked_fill(last, -100)
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = TinyLM().to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        # A repeating pattern per document, so the loss has something to learn.
        docs = [torch.arange(n, device=device) * (d + 1) % 128
                for d, n in enumerate(torch.randint(3, 40, (6,)).tolist())]
        tokens, positions, cu, longest = pack(docs)
        loss = packed_loss(model(tokens, positions, cu, longest), tokens, cu)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: {len(tokens)} tokens in {len(docs)} documents, loss "
              f"{loss.item():.3f}")


if __name__ == "__main__":
    main()
