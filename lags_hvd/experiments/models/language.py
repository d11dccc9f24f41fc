"""Language models: the 2-layer LSTM of the paper's Penn Treebank experiment, and a small GPT."""

import torch
from torch import nn

# Penn Treebank word-level sizes as in Zaremba et al.: vocabulary 10,000, 35 steps;
# hidden 1500 ("large", the paper's LSTM-PTB, 66M parameters) or 200 ("small", 4.6M).
PTB_VOCAB, PTB_HIDDEN, PTB_SMALL_HIDDEN, PTB_SEQ_LEN = 10_000, 1500, 200, 35


class LSTMLanguageModel(nn.Module):
    """Embedding -> L-layer LSTM -> linear decoder over the vocabulary."""

    def __init__(self, vocab: int, hidden: int, layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens, state=None):
        out, state = self.lstm(self.dropout(self.embedding(tokens)), state)
        return self.decoder(self.dropout(out)), state


def lstm_ptb(dropout: float = 0.0) -> LSTMLanguageModel:
    return LSTMLanguageModel(PTB_VOCAB, PTB_HIDDEN, 2, dropout)


def lstm_ptb_small(dropout: float = 0.0) -> LSTMLanguageModel:
    return LSTMLanguageModel(PTB_VOCAB, PTB_SMALL_HIDDEN, 2, dropout)


class CharGPT(nn.Module):
    """A small GPT-style decoder: token and position embeddings, ``layers`` pre-norm blocks
    (causal multi-head self-attention, then a 4x MLP with GELU), a final norm and a linear head."""

    def __init__(self, vocab: int, width: int = 128, layers: int = 2, heads: int = 4, context: int = 128):
        super().__init__()
        self.context = context
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens, state=None):
        """``(logits, None)`` for ``tokens`` of shape (batch, time <= context); no state is
        carried between calls (the interface of ``LSTMLanguageModel``)."""
        if tokens.shape[1] > self.context:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the context of {self.context}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)), None


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, time, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.norm2(x))
