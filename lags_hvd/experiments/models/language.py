"""Language models: the 2-layer LSTM of the paper's Penn Treebank experiment."""

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
