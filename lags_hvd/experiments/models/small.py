"""Small models for real-data runs on CPUs: the Fashion-MNIST CNN."""

from torch import nn


class FashionCNN(nn.Module):
    """Two conv blocks and two linear layers: about 0.4M parameters."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x):
        return self.classifier(self.features(x))
