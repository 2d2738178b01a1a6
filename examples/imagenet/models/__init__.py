"""The ImageNet example's networks, registered by ``--arch`` name."""
from .resnet18 import ResNet18
from .resnet50 import ResNet50
from .resnet_small import ResNetSmall

# A registry rather than an if/elif chain, so that adding an architecture is
# one line here and ``--arch`` lists it automatically.
ARCHS = {
    'resnet18': ResNet18,
    'resnet50': ResNet50,
    'resnet_small': ResNetSmall,
}
