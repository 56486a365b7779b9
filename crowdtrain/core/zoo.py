"""Built-in model architectures. Clients run only these (no code travels over the wire).

Every builder takes the dataset's `input_shape` (without the batch axis) and `num_classes`,
plus its own keyword options from the job spec's `model.options`.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo_experts import MixtureTrunk


class MLP(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = int(np.prod(input_shape))
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(x)  # a Module's __call__ is typed Any
        return logits


class CNN1D(nn.Module):
    """A small 1-D CNN for sequences shaped (length,) or (channels, length), e.g. mnist1d.

    Convolutions with max-pooling between them, then a global max over the length: on mnist1d the
    global pool learns far faster from small shards than flattening does.
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, channels: int = 32, kernel_size: int = 5, layers: int = 3
    ):
        super().__init__()
        in_ch = 1 if len(input_shape) == 1 else int(input_shape[0])
        convs: list[nn.Module] = []
        for i in range(layers):
            convs += [
                nn.Conv1d(in_ch if i == 0 else channels, channels, kernel_size, padding=kernel_size // 2),
                nn.ReLU(),
            ]
            if i < layers - 1:
                convs.append(nn.MaxPool1d(2))
        self.features = nn.Sequential(*convs)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.unsqueeze(1)
        logits: torch.Tensor = self.head(self.features(x).amax(dim=2))
        return logits


class PreActBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(in_ch, out_ch, 1, stride, bias=False) if stride != 1 or in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        summed: torch.Tensor = out + skip
        return summed


class PreActResNet(nn.Module):
    """Pre-activation ResNet for 32x32x3 images: three stages of `blocks` blocks, widths w, 2w, 4w.

    `width=86, blocks=2` gives 5.01M parameters, the size of the largest network (4.97M) of the
    VC-ASGD paper's CIFAR-10 runs; the default (16, 2) has 0.18M.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 16, blocks: int = 2):
        super().__init__()
        # Images come channels-first (C, H, W) or channels-last (H, W, C) with 1 or 3 channels.
        channels_last = input_shape[-1] in (1, 3) and input_shape[0] not in (1, 3)
        in_ch = int(input_shape[-1] if channels_last else input_shape[0])
        self.stem = nn.Conv2d(in_ch, width, 3, 1, 1, bias=False)
        stages: list[nn.Module] = []
        ch = width
        for stage, mult in enumerate((1, 2, 4)):
            for b in range(blocks):
                stride = 2 if stage > 0 and b == 0 else 1
                stages.append(PreActBlock(ch, width * mult, stride))
                ch = width * mult
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(ch)
        self.fc = nn.Linear(ch, num_classes)
        # Channels-last memory (NHWC strides; the tensors' shapes and state_dict are unchanged): PyTorch's
        # CPU convolutions evaluate the images benchmark task's width-8 network about 20% faster this way
        # (5,000 16x16 images, one thread: 0.50 s against 0.64 s), and train it as fast.
        self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # documented, not in the stubs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            x = x.permute(0, 3, 1, 2)  # NHWC arrays from npz files
        x = x.contiguous(memory_format=torch.channels_last)
        out = torch.relu(self.bn(self.stages(self.stem(x))))
        logits: torch.Tensor = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))
        return logits


# "moe" is the dense trunk of a mixture-of-experts model (mode moe); its experts live on expert hosts.
_BUILDERS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn1d": CNN1D, "resnet": PreActResNet, "moe": MixtureTrunk}


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, seed: int | None = None, **options: Any
) -> nn.Module:
    """Instantiate a zoo model; with `seed`, its initial weights are reproducible."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; the zoo has {sorted(_BUILDERS)}")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return _BUILDERS[name](list(input_shape), int(num_classes), **options)
    except TypeError as exc:
        raise ValueError(f"bad options for model {name!r}: {exc}") from exc


def check_model(
    name: str, input_shape: Sequence[int], num_classes: int, options: dict[str, Any], max_bytes: int
) -> int:
    """The bytes of a zoo model's parameters (its state_dict as float32), after checking that they
    are at most `max_bytes` and that the model maps a batch of `input_shape` examples to
    `num_classes` logits; raises ValueError naming the problem.

    The size is read off a model built on PyTorch's meta device (shapes without memory), so a model
    of a terabyte is refused without allocating it. Only a model within `max_bytes` is then built
    for real and given a batch of two zero examples: a forward pass on the meta device would compute
    nothing, but its first use in a process costs seconds of CPU, which every submission would pay.
    """
    try:
        with torch.device("meta"):
            model = build_model(name, input_shape, num_classes, **options)
    except ValueError:
        raise
    except Exception as exc:  # a builder's own refusal of its arguments
        raise ValueError(f"model: {name!r} cannot be built with options {options}: {_first_line(exc)}") from None
    nbytes: int = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if nbytes > max_bytes:
        raise ValueError(
            f"model: {name!r} with options {options} has {nbytes:,} bytes of parameters, more than "
            f"the scheduler accepts in one upload ({max_bytes:,} bytes, upload_max_bytes)"
        )
    try:
        with torch.inference_mode():
            out = build_model(name, input_shape, num_classes, **options)(torch.zeros((2, *input_shape)))
    except Exception as exc:
        raise ValueError(
            f"model: {name!r} with options {options} cannot take the dataset's examples shaped "
            f"{tuple(input_shape)}: {_first_line(exc)}"
        ) from None
    if tuple(out.shape) != (2, num_classes):
        raise ValueError(f"model: {name!r} outputs shape {tuple(out.shape)[1:]}, the dataset needs ({num_classes},)")
    return nbytes


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def state_to_numpy(model: nn.Module) -> Params:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_numpy_state(model: nn.Module, params: Params) -> None:
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in params.items()}, strict=True)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def training_flops_per_example(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Floating-point operations to train `model` on one example: its forward pass counted by PyTorch's
    FlopCounterMode (matrix products and convolutions, 2 per multiply-add), times 3 for the backward
    pass, which costs about twice the forward (gradients of the activations and of the weights)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(torch.zeros((1, *input_shape)))
    return 3 * int(counter.get_total_flops())
