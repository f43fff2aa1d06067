"""`mola validate`: what an adapter is and whether a base model would take it.

    describe.py   format, ranks, scales, targets, layers, dtypes, size, declared base
    offline.py    a base model's LoRA targets, without reading its weights
    command.py    the command: the report, as text or JSON, and the exit status
"""

from .command import Report, run, validate
from .describe import AdapterInfo, describe
from .offline import ModelShape, model_shape

__all__ = ["AdapterInfo", "ModelShape", "Report", "describe", "model_shape", "run", "validate"]
