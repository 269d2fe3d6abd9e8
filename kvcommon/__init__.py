"""What the router, the sidecar and the simulated pod share, so none of them imports another.

- ``settings``: the settings loader (defaults < YAML file < env < CLI flags), ``ConfigError``.
- ``listener``: the guarded uvicorn HTTP protocol (header/body timeouts, header size limit).
- ``errors``: ``APIError`` and the one OpenAI-style error body builder.
- ``asgi``: reading a request body under a size limit and a deadline; waiting for a disconnect.
"""
