"""selfspec: faster generation from a Hugging Face causal LM by drafting with its own layers.

Quick start::

    import selfspec
    model = selfspec.load()                       # SmolLM2-135M-Instruct, built in
    out = selfspec.generate(model, "The capital of France is", method="asd", max_new_tokens=32)
    print(out.text, out.stats.mean_generated_length, out.stats.acceptance_rate)
"""

from .api import GenerationResult, Session, generate, stream
from .core.skipset import SkipSet
from .decoding import grammar
from .decoding.loop import GenerationStats
from .errors import InvalidInputError, ModelNotFoundError, SelfspecError, UnsupportedModelError
from .methods import METHODS
from .model.models import DEFAULT_MODEL, Model, list_models, load, model_from_hf

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "METHODS",
    "GenerationResult",
    "GenerationStats",
    "InvalidInputError",
    "Model",
    "ModelNotFoundError",
    "SelfspecError",
    "Session",
    "SkipSet",
    "UnsupportedModelError",
    "generate",
    "grammar",
    "list_models",
    "load",
    "model_from_hf",
    "stream",
]
