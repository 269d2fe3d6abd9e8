"""The decode-side prefill/decode sidecar: runs the NIXL prefill leg, then the local decode leg."""
