"""``hydragen serve``: an OpenAI-compatible HTTP server on the serving engine (docs/server.md).

``protocol`` (request bodies, the error format), ``detokenize`` (incremental text),
``bridge`` (OpenAI requests to engine requests and back), ``metrics`` (Prometheus), ``app``
(the FastAPI routes), ``launch`` (uvicorn: foreground or a thread). Needs the ``serve``
extra (fastapi, uvicorn, prometheus_client); nothing else in ``models`` imports it.
"""
