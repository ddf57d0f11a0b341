"""The data-parallel router: one ZMQ client endpoint in front of several engine replicas
(docs/data-parallel.md)."""
