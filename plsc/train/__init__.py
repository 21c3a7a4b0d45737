"""Training: the loop (data-parallel backbone, model-parallel head), loss scaling, the parts a
config builds, logging to the console, train.log and VisualDL, and preemption."""
from .trainer import Trainer

__all__ = ["Trainer"]
