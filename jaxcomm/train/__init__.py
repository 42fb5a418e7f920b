"""Training steps: placing the global batch, bounding the steps in flight."""

from jaxcomm.train.placement import place_batch
from jaxcomm.train.step import TrainStep

__all__ = ["TrainStep", "place_batch"]
