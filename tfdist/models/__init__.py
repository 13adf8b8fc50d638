"""Models. `GPT` is the Keras 3 GPT; the pipeline wrapper arrives with model parallelism."""
from tfdist.models.gpt import GPT, loss_fn  # noqa: F401
