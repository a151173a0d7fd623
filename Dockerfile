# The EPD image for CPU hosts (deploy/overlays/cpu-demo): every service is `epd <service>`.
# Not built in CI (no Docker there); it runs the same install script CI runs.
FROM python:3.11-slim-bookworm
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends git build-essential libibverbs1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/epd
COPY . .
RUN ./scripts/install-cpu.sh
ENV PATH=/opt/epd/.venv/bin:$PATH
ENTRYPOINT ["epd"]
