# kvroute: one image for the router, the P/D sidecar, the simulated pod and the replay client.
#
#   docker build -t kvroute:0.1.0 .
#   docker run --rm -p 8000:8000 kvroute:0.1.0 serve --config /etc/kvroute/router.yaml
#   docker run --rm -p 8000:8000 -p 5557:5557 -p 5558:5558 kvroute:0.1.0 sim --host 0.0.0.0 --port 8000 --kv-events-port 5557
#
# The entrypoint is the `kvroute` command; the first argument picks the service
# (serve | sidecar | sim | replay | events | demo), the rest are its flags (`--help` lists them).
#
# Ports (all configurable by flags; these are the defaults the Kubernetes manifests use):
#   8000/tcp  HTTP: router (OpenAI API, /health, /metrics); sidecar in a decode pod (vLLM itself
#             then listens on 8001 in the same pod); simulated pod (OpenAI API, /metrics)
#   5557/tcp  KV-cache events, ZeroMQ PUB (simulated pod; vLLM uses the same port)
#   5558/tcp  KV-cache event replay, ZeroMQ ROUTER
#   5570/tcp  router: the booking bus, ZeroMQ PUB (replicas share their bookings; booking_bus_bind)
# Prometheus metrics are served on each service's HTTP port at /metrics.
#
# The build stage installs the pinned dependencies from deploy/requirements.lock, then kvroute
# itself without dependencies, into a virtual environment at $VENV that the runtime stage copies.
# deploy/check-dockerfile-install.sh runs this stage's COPY and RUN steps in a fresh venv, so CI
# proves they work without a container engine.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV VENV=/opt/kvroute \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY deploy/requirements.lock deploy/requirements.lock
RUN python -m venv "$VENV" \
 && "$VENV/bin/pip" install --no-cache-dir --require-virtualenv -r deploy/requirements.lock
COPY pyproject.toml README.md ./
COPY kvcommon kvcommon
COPY router router
COPY indexer indexer
COPY sidecar sidecar
COPY simulator simulator
COPY replay replay
COPY fleet fleet
COPY whatif whatif
RUN "$VENV/bin/pip" install --no-cache-dir --require-virtualenv --no-deps . \
 && "$VENV/bin/pip" check \
 && "$VENV/bin/kvroute" --version

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="KV-cache-aware router for vLLM fleets, its P/D sidecar, a simulated vLLM pod and a replay client" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid kvroute --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
COPY data /opt/kvroute/share/data
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVROUTE_HEALTH_URL=http://127.0.0.1:8000/health
WORKDIR /opt/kvroute/share
USER 10001:10001
EXPOSE 8000/tcp 5557/tcp 5558/tcp 5570/tcp
# Probes the service's own /health (override KVROUTE_HEALTH_URL when it listens elsewhere; the
# replay client has no HTTP port, so run it with --no-healthcheck). Kubernetes ignores this and
# uses the probes in deploy/kubernetes.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen(os.environ['KVROUTE_HEALTH_URL'], timeout=2).status < 300 else 1)"]
ENTRYPOINT ["kvroute"]
CMD ["serve"]
