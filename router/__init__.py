"""kvroute's gateway: the OpenAI-compatible router that picks a pod by predicted time to first token."""

__version__ = "0.1.0"
