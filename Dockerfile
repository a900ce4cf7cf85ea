# syntax=docker/dockerfile:1.7
# One image for every pagedkv role: block-manager, cache-host, worker (and loadtest).
#
#   GPU (default):  docker build -t pagedkv:latest .
#   CPU only:       docker build -t pagedkv:cpu --build-arg TORCH_VARIANT=cpu --build-arg BASE_IMAGE=ubuntu:24.04 .
#
# Why a CUDA *runtime* base for the GPU image: torch's wheels bring their own CUDA libraries, but
# CuPy (the CUDA IPC path of the cache host) loads the system CUDA runtime (libcudart, NVRTC). ONE
# CUDA major throughout (tests/deploy/test_compose.py checks it): the base's CUDA 13, torch's cu130
# wheel from the PyTorch index (a plain PyPI torch may be built for another major), and the extra
# `gpu-cuda13` (cupy-cuda13x). Two runtimes of different majors in one process keep separate state,
# and an IPC handle made through one is not the other's. The driver comes from the host through the
# NVIDIA container toolkit and must support CUDA 13 (R580+). The CPU image needs none of that: any
# Ubuntu 24.04 base works.
ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# cuda = torch's CUDA 13 wheel from the PyTorch cu130 index + extras worker,gpu-cuda13,text (text: the
#        tokenizer `pagedkv serve` reads from --model); the build fails if torch's CUDA is another major
# cpu  = torch's CPU wheel from the PyTorch index first (a bare `torch` pulls a multi-GB CUDA
#        build), then extras worker,text (no CuPy: it is useless without a GPU).
ARG TORCH_VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA_MAJOR=13
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# libtcmalloc-minimal4: the allocator CPU workers are preloaded with (docker-compose.cpu.yml, docs/worker.md).
# gcc: `pip install .` below compiles the native CPU kernels (setup.py: x86_64/avx2/avx512 variants,
# chosen at run time by CPU features). gcc + python3-dev: Triton compiles a small C launcher (against
# Python.h) the first time a kernel runs, at run time, so the compiler stays in the image. tini reaps children and forwards signals.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev tini ca-certificates \
      libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# The heavy layer first, so that source changes do not reinstall torch.
RUN --mount=type=cache,target=/root/.cache/pip \
    case "${TORCH_VARIANT}" in \
      cpu)  pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" ;; \
      cuda) pip install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}" \
         && python -c "import sys, torch; v = torch.version.cuda or ''; sys.exit(0 if v.split('.')[0] == '${CUDA_MAJOR}' else f'torch is built for CUDA {v!r}, the image for CUDA ${CUDA_MAJOR}')" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, got ${TORCH_VARIANT}" >&2; exit 1 ;; \
    esac

WORKDIR /app
COPY pyproject.toml setup.py MANIFEST.in README.md constraints.txt ./
COPY pagedkv ./pagedkv
COPY block_manager_svc ./block_manager_svc
COPY worker_svc ./worker_svc
COPY kernels ./kernels
COPY frontend ./frontend
COPY protos ./protos
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "${TORCH_VARIANT}" = cpu ]; then extras=worker,text; else extras="worker,gpu-cuda${CUDA_MAJOR},text"; fi \
 && pip install -c constraints.txt ".[${extras}]" \
 && python -c "import torch, pagedkv.cli; from pagedkv.kernels import cpu_native; print('torch', torch.__version__, 'cpu kernels built:', cpu_native.built_variants())"

# Unprivileged at run time. Triton's kernel cache goes to $HOME. The block manager's state dir
# (PAGEDKV_STATE_DIR in docker-compose.yml) exists owned by that user, so a named volume mounted
# there starts with that owner and is writable.
RUN useradd --create-home --uid 10001 pagedkv \
 && mkdir -p /var/lib/pagedkv/state && chown pagedkv:pagedkv /var/lib/pagedkv/state
USER pagedkv
ENV HOME=/home/pagedkv

# Every setting is a PAGEDKV_* variable (see docs/deploy.md). Services listen on 127.0.0.1 by
# default, which nothing outside the container can reach: run with -e PAGEDKV_HOST=0.0.0.0 and
# publish the port on the host address you choose (docker-compose.yml does both).
EXPOSE 50051 50052 50053
# Checks the role's own port (PAGEDKV_PORT, default 50051) through grpc.health.v1.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "pagedkv.healthcheck", "-q"]
ENTRYPOINT ["tini", "--", "pagedkv"]
CMD ["block-manager"]
