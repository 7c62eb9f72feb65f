# clipd: the gRPC clipping service and its admin API.
FROM python:3.11-slim

# (`clipd serve` sets glibc's mmap threshold and OPENBLAS_NUM_THREADS itself: clipd/_process.py.)
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CLIPD_HOST=0.0.0.0 \
    CLIPD_GRPC_PORT=50051 \
    CLIPD_ADMIN_PORT=8080 \
    CLIPD_COMPILATION_CACHE_DIR=/var/cache/clipd/jax \
    CLIPD_DATA_DIR=/var/lib/clipd

# The extras to install: server alone (one host), or server,postgres,ray to scale out (deploy/).
ARG CLIPD_EXTRAS=server

WORKDIR /app
COPY pyproject.toml README.md ./
COPY clipd ./clipd
RUN pip install --no-cache-dir ".[${CLIPD_EXTRAS}]" && useradd --system --create-home clipd \
    && mkdir -p /var/cache/clipd/jax /var/lib/clipd && chown clipd /var/cache/clipd/jax /var/lib/clipd
USER clipd

VOLUME /var/lib/clipd
EXPOSE 50051 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
# The server refuses to listen on 0.0.0.0 without an admin token: run with -e CLIPD_ADMIN_TOKEN=...
CMD ["clipd", "serve"]
