# syntax=docker/dockerfile:1
# Two images from one file (no build-time downloads beyond package installs):
#   docker build --target operator -t dwdp-k8s:operator-0.1.0 .
#   docker build --target worker   -t dwdp-k8s:worker-0.1.0 .
# The worker base must ship CUDA + torch (override TORCH_BASE to pin your cluster's CUDA/torch).
ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG TORCH_BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

# --- build: one wheel of this project (runtime + worker + operator packages) ---------------
FROM ${PYTHON_BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dwdp_runtime ./dwdp_runtime
COPY worker ./worker
COPY operator ./operator
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /wheels .

# --- operator: slim Python, kopf, non-root ---------------------------------------------------
FROM ${PYTHON_BASE} AS operator
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin dwdp
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir "$(ls /tmp/wheels/*.whl)[operator]" && rm -rf /tmp/wheels
USER 10001:10001
ENTRYPOINT ["dwdp-operator"]

# --- worker: CUDA + torch base, this project with its worker extras, non-root -----------------
FROM ${TORCH_BASE} AS worker
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin dwdp
COPY --from=build /wheels /tmp/wheels
# torch comes from the base image (pip keeps it: it satisfies the requirement). nixl (KV handoff,
# docs/KV_TRANSFER.md): the meta package, which picks nixl-cu12/-cu13 by the CUDA it finds at import.
# cuda: cuda-python for the CUDA memory backend; sm-gather: nvidia-cutlass-dsl (~100 MB) for the CuTe DSL
# kernels — the FP8 experts' default on H100/H200 (docs/MODELS.md) and the opt-in sm_gather transfer.
RUN pip install --no-cache-dir "$(ls /tmp/wheels/*.whl)[worker,cuda,sm-gather]" "nixl>=1.5.1" && rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /home/dwdp
EXPOSE 8000 29500
ENTRYPOINT ["dwdp-worker"]
CMD ["pod"]
