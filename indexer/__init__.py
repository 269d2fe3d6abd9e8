"""KV-cache events from vLLM pods and the approximate per-pod prefix index built from them."""
