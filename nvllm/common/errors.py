"""Errors shared by the leader, the workers and the clients."""


class NvllmError(Exception):
    """Base class of nvllm's own errors."""


class RequestRejected(NvllmError, ValueError):
    """A request that can never be served as asked (too long, bad token ids, ...)."""


class EngineDeadError(NvllmError, RuntimeError):
    """The worker group died or failed; in-flight requests cannot finish."""


class ProtocolError(NvllmError, ValueError):
    """A message that does not decode to a known, well-formed message."""


class Overloaded(RequestRejected):
    """Too many requests are waiting (max_queued_requests); try again later."""
