"""nvllm: a multi-process, tensor-parallel LLM inference engine."""

from nvllm.common.outputs import CompletionOutput, RequestOutput
from nvllm.common.sampling_params import SamplingParams

__all__ = ["LLM", "Client", "AsyncClient", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in transformers and zmq; import it only when asked for.
    if name == "LLM":
        from nvllm.llm import LLM

        return LLM
    if name in ("Client", "AsyncClient"):
        from nvllm.common import client

        return getattr(client, name)
    raise AttributeError(name)
