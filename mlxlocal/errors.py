"""Errors a user can act on. Each message names the file, field or limit at fault."""


class MlxLocalError(Exception):
    """Base class: the CLI prints these as one clean line, never a traceback."""


class ModelNotFoundError(MlxLocalError):
    """A --model spec that is no local dir, alias, cached/downloadable repo or preset."""


class ModelLoadError(MlxLocalError):
    """A model directory that cannot be loaded (bad config, missing files)."""


class WeightFileError(ModelLoadError):
    """A weight file that is malformed; the message names the file and the tensor."""


class ConfigError(ModelLoadError):
    """A config.json field that is missing, malformed, or changes the math in a way we do not implement."""


class UnsupportedModelError(ModelLoadError):
    """A model_type neither the native models nor mlx-lm support."""


class ContextLengthError(MlxLocalError):
    """A prompt (plus requested tokens) that does not fit the model's context."""

    def __init__(self, prompt_tokens: int, context_length: int, what: str = "prompt"):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        super().__init__(
            f"{what} is {prompt_tokens} tokens but the model's context length is "
            f"{context_length} tokens (at least one must stay free for the reply)"
        )


class EndpointBenchError(MlxLocalError):
    """A bench setup problem the user can fix (bad prompt file, missing matplotlib, bad URL)."""


class InputTooLongError(MlxLocalError):
    """An embedding input longer than the encoder's maximum length, with truncation off."""

    def __init__(self, index: int, tokens: int, max_length: int):
        self.index, self.tokens, self.max_length = index, tokens, max_length
        super().__init__(f"input {index} is {tokens} tokens but the embedding model takes at most "
                         f"{max_length}; shorten it or allow truncation")


class TokenBudgetError(MlxLocalError, ValueError):
    """A request with more tokens than the caller's budget for one request."""

    def __init__(self, tokens: int, budget: int):
        self.tokens, self.budget = tokens, budget
        super().__init__(f"the inputs are {tokens} tokens (after truncation); at most {budget} per request")


class EmbeddingBusyError(MlxLocalError):
    """The engine already has its maximum of requests running or waiting."""

    def __init__(self, queued: int):
        super().__init__(f"the embedding engine has {queued} requests running or waiting (its maximum)")


class EmbeddingCancelled(MlxLocalError):
    """Work stopped between batches: its client went away, or the engine shut down."""


class EngineOptionError(MlxLocalError, ValueError):
    """An engine option the model cannot take (e.g. --kv-bits on the dense engine): one line."""


class FatalEngineError(MlxLocalError):
    """An error after which the engine cannot go on (it stops, with this as its reason),
    unlike a request's own error, which fails that request alone."""


class ClusterError(FatalEngineError):
    """A rank of a multi-rank (tensor-parallel) run is gone or unreachable."""


class NonFiniteLogitsError(MlxLocalError):
    """A request's logits went NaN or infinite (a numerical overflow in the model or in its
    penalties): that request ends with this error, the engine and the others go on."""

    def __init__(self, generated: int):
        self.generated = generated
        super().__init__(f"the model's logits became non-finite (NaN or infinity) after {generated} "
                         f"generated tokens, so no token could be sampled; the request was stopped "
                         f"(a numerical overflow in the model or in this request's sampling parameters)")
