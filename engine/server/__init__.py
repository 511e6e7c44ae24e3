"""HTTP serving: the OpenAI-style API (app.py), request parsing and response bodies
(protocol.py), the engine loop thread (worker.py) and Prometheus metrics (metrics.py)."""
