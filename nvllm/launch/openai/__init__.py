"""``nvllm-serve``: an OpenAI-compatible HTTP gateway in front of a running nvllm leader.

The gateway is its own process: it attaches to the leader's client endpoint as an ordinary
ZMQ client (``AsyncClient``, protocol in docs/protocol.md), so a crashing or restarted HTTP
server never takes the engine down, and the engine never runs HTTP code. Routes:

- ``POST /v1/completions``: prompt as a string, a token-id list, or a batch of either;
  ``n``; ``stream`` as server-sent events (``data: {...}`` ... ``data: [DONE]``).
- ``POST /v1/chat/completions``: the model's chat template (from its tokenizer) is applied
  here and the prompt is sent as token ids; tools and tool calls.
- ``GET /v1/models``, ``GET /health`` (200 once the leader says it is ready, else 503),
  ``GET /metrics`` (the leader's Prometheus text plus the gateway's own counters).

Every request becomes one leader request per prompt (``n`` completions each). A client
that disconnects aborts its leader requests, so an abandoned request frees its KV blocks.

Binding HTTP to anything but loopback requires ``--api-key``; a leader started with
``--curve-key-dir`` needs the same option here (the gateway is one of its clients).

Modules: ``app`` (the app factory: /health, /metrics, /v1/models, auth, mounting the
routes), ``completions`` and ``chat`` (the two generation routes), ``schemas`` (request
bodies), ``structured`` (output constraints), ``tools``, ``tool_calls`` and
``tool_parsers`` (tool calling), ``state`` (the leader connection, its info, the
tokenizer), ``fanout`` (leader requests per prompt, disconnect watching), ``sse``
(streaming a fan-out as server-sent events), ``logprobs`` and ``tokens`` (logprobs in
OpenAI's shapes), ``errors`` (OpenAI error objects), ``metrics`` (the gateway's own
counters) and ``cli`` (``nvllm-serve``, and starting the gateway as a child process).
``python -m nvllm.launch.openai`` runs it.
"""
