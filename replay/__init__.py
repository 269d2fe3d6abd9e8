"""The bundled load-test client: traces and synthetic workloads replayed open-loop, measured and reported."""
