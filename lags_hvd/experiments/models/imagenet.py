"""ImageNet-shaped networks: ResNet-50 (He et al. 2016) and Inception-v4 (Szegedy et al. 2017)."""

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, kernel, stride=1, padding=0) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.body = nn.Sequential(
            _conv_bn(cin, planes, 1),
            _conv_bn(planes, planes, 3, stride, 1),
            nn.Conv2d(planes, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                stages.append(_Bottleneck(cin, planes, stride if i == 0 else 1))
                cin = planes * _Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet50(num_classes: int = 1000) -> ResNet50:
    return ResNet50(num_classes)


class _Branches(nn.Module):
    """Runs parallel branches on the same input and concatenates them on channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


def _stem() -> nn.Sequential:
    return nn.Sequential(
        _conv_bn(3, 32, 3, 2),
        _conv_bn(32, 32, 3),
        _conv_bn(32, 64, 3, padding=1),
        _Branches(nn.MaxPool2d(3, 2), _conv_bn(64, 96, 3, 2)),  # 160
        _Branches(
            nn.Sequential(_conv_bn(160, 64, 1), _conv_bn(64, 96, 3)),
            nn.Sequential(
                _conv_bn(160, 64, 1),
                _conv_bn(64, 64, (1, 7), padding=(0, 3)),
                _conv_bn(64, 64, (7, 1), padding=(3, 0)),
                _conv_bn(64, 96, 3),
            ),
        ),  # 192
        _Branches(_conv_bn(192, 192, 3, 2), nn.MaxPool2d(3, 2)),
    )  # 384


def _inception_a() -> _Branches:
    return _Branches(
        nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), _conv_bn(384, 96, 1)),
        _conv_bn(384, 96, 1),
        nn.Sequential(_conv_bn(384, 64, 1), _conv_bn(64, 96, 3, padding=1)),
        nn.Sequential(_conv_bn(384, 64, 1), _conv_bn(64, 96, 3, padding=1), _conv_bn(96, 96, 3, padding=1)),
    )


def _reduction_a() -> _Branches:
    return _Branches(
        _conv_bn(384, 384, 3, 2),
        nn.Sequential(_conv_bn(384, 192, 1), _conv_bn(192, 224, 3, padding=1), _conv_bn(224, 256, 3, 2)),
        nn.MaxPool2d(3, 2),
    )  # 1024


def _inception_b() -> _Branches:
    def c17(cin, cout, horizontal):
        return _conv_bn(cin, cout, (1, 7) if horizontal else (7, 1), padding=(0, 3) if horizontal else (3, 0))

    return _Branches(
        nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), _conv_bn(1024, 128, 1)),
        _conv_bn(1024, 384, 1),
        nn.Sequential(_conv_bn(1024, 192, 1), c17(192, 224, True), c17(224, 256, False)),
        nn.Sequential(
            _conv_bn(1024, 192, 1), c17(192, 192, False), c17(192, 224, True), c17(224, 224, False), c17(224, 256, True)
        ),
    )


def _reduction_b() -> _Branches:
    return _Branches(
        nn.Sequential(_conv_bn(1024, 192, 1), _conv_bn(192, 192, 3, 2)),
        nn.Sequential(
            _conv_bn(1024, 256, 1),
            _conv_bn(256, 256, (1, 7), padding=(0, 3)),
            _conv_bn(256, 320, (7, 1), padding=(3, 0)),
            _conv_bn(320, 320, 3, 2),
        ),
        nn.MaxPool2d(3, 2),
    )  # 1536


class _InceptionC(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), _conv_bn(1536, 256, 1))
        self.single = _conv_bn(1536, 256, 1)
        self.split = _conv_bn(1536, 384, 1)
        self.split_a = _conv_bn(384, 256, (1, 3), padding=(0, 1))
        self.split_b = _conv_bn(384, 256, (3, 1), padding=(1, 0))
        self.deep = nn.Sequential(
            _conv_bn(1536, 384, 1),
            _conv_bn(384, 448, (3, 1), padding=(1, 0)),
            _conv_bn(448, 512, (1, 3), padding=(0, 1)),
        )
        self.deep_a = _conv_bn(512, 256, (1, 3), padding=(0, 1))
        self.deep_b = _conv_bn(512, 256, (3, 1), padding=(1, 0))

    def forward(self, x):
        s, d = self.split(x), self.deep(x)
        return torch.cat(
            [self.pool(x), self.single(x), self.split_a(s), self.split_b(s), self.deep_a(d), self.deep_b(d)], 1
        )


class InceptionV4(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(
            _stem(),
            *[_inception_a() for _ in range(4)],
            _reduction_a(),
            *[_inception_b() for _ in range(7)],
            _reduction_b(),
            *[_InceptionC() for _ in range(3)],
        )
        self.fc = nn.Linear(1536, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def inception_v4(num_classes: int = 1000) -> InceptionV4:
    return InceptionV4(num_classes)
