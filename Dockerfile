# asyncengine on a CUDA runtime image: `docker build -t asyncengine .`, then
#   docker run --gpus all -p 50051:50051 -p 9090:9090 -v /path/to/model:/models/model:ro \
#     asyncengine --model /models/model --host 0.0.0.0 --port 50051 --metrics-port 9090
# Arguments after the image name replace CMD and go to `asyncengine serve` (the entrypoint).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch's CUDA build first (it brings triton), from the index matching the image's CUDA
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncengine ./asyncengine
RUN pip install . && rm -rf /src

# an unprivileged user whose home holds triton's kernel cache
RUN useradd --create-home --uid 1000 engine
USER 1000
WORKDIR /home/engine

EXPOSE 50051 9090
# SIGTERM drains (--drain-grace-period) and exits 0; give `docker stop -t` at least that long
STOPSIGNAL SIGTERM
ENTRYPOINT ["asyncengine", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090"]
