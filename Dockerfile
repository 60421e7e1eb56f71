# syntax=docker/dockerfile:1.7
# LLaVA session server for SageMaker stateful endpoints (GPU).
#
#   docker build -t llava-sessions .                        # or ./build_and_push.sh (ECR)
#   docker build --build-arg BAKE_MODEL_ID=llava-hf/llava-1.5-7b-hf \
#                --build-arg BAKE_MODEL_REVISION=<40-hex commit> -t llava-sessions:7b .
#   docker run --gpus all -p 8080:8080 -v "$PWD/models/7b:/opt/ml/model:ro" llava-sessions serve
#
# SageMaker runs `docker run IMAGE serve`: tini (PID 1, forwards SIGTERM, reaps orphans) runs
# /usr/local/bin/serve -> llava-container-serve, which starts TorchServe (on loopback, behind its
# proxy on 0.0.0.0:8080: a /ping that is 200 only while the model serves) with the model from
# /opt/ml/model (else the baked /opt/llava/model), restarts it when a worker dies, and on SIGTERM
# stops it and exits 0 within 30 s (handler/llava_tools/serve/container.py).

# The stack the tests run (config/constraints.txt, `make test-container-stack`): Python 3.11 on Debian
# bookworm, torch 2.13's CUDA build from PyPI (its CUDA libraries come as wheels; the host needs only
# the NVIDIA driver, as SageMaker's GPU hosts have), the same transformers, TorchServe and the rest.
# Overridable with any Debian bookworm image with Python 3.11 (docs/decisions/39-one-stack.md).
ARG BASE_IMAGE=python:3.11.7-slim-bookworm
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini (PID 1) pinned; Java 17 for TorchServe's frontend follows Debian's security updates (an old
# openjdk build leaves the mirror when a new one lands, so a pin would break the build). gcc and the C
# library's headers: on a GPU the `compile` setting's Inductor kernels go through Triton, which builds
# its kernel launcher with a C compiler at run time (without one the layers run as loaded).
ARG TINI_VERSION=0.19.0-1+b3
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "tini=${TINI_VERSION}" openjdk-17-jre-headless gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Runtime dependencies: every version from config/constraints.txt, the file the tests install from.
COPY config/constraints.txt /opt/llava/config/constraints.txt
RUN pip install --no-cache-dir --constraint /opt/llava/config/constraints.txt \
        torch \
        torchserve \
        torch-model-archiver \
        transformers \
        tokenizers \
        safetensors \
        huggingface-hub \
        pydantic \
        pillow \
        pyyaml \
        requests \
        boto3 \
        llguidance \
        av \
        psutil \
        packaging \
    && java -version

# Optional: bake a checkpoint into the image at a pinned commit (before the code is copied, so a
# code change does not download it again). A gated repository's token: --secret id=hf_token,src=FILE.
ARG BAKE_MODEL_ID=""
ARG BAKE_MODEL_REVISION=""
COPY docker/bake_model.py /opt/llava/docker/bake_model.py
RUN --mount=type=secret,id=hf_token,required=false \
    if [ -n "${BAKE_MODEL_ID}" ]; then \
        python /opt/llava/docker/bake_model.py --model-id "${BAKE_MODEL_ID}" \
            --revision "${BAKE_MODEL_REVISION}" --dest /opt/llava/model; \
    fi

# The project: worker core (llava_sessions) and tools (llava_tools), TorchServe entry, configs.
WORKDIR /opt/llava
COPY pyproject.toml README.md model-config.yaml /opt/llava/
COPY config/ /opt/llava/config/
COPY handler/ /opt/llava/handler/
COPY client/ /opt/llava/client/
RUN pip install --no-cache-dir --no-deps /opt/llava \
    && python -c "import llava_tools.serve.container, llava_sessions.worker, ts"
COPY --chmod=0755 docker/serve /usr/local/bin/serve

# LLAVA_HOME: where the entrypoint finds config/, model-config.yaml and handler/. The sequence
# header names are exported by the entrypoint too (TorchServe's Python side reads them from env).
# No hub downloads at run time: the model comes from /opt/ml/model or the image.
ENV LLAVA_HOME=/opt/llava \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TS_REQUEST_SEQUENCE_ID=X-Amzn-SageMaker-Session-Id \
    TS_REQUEST_SEQUENCE_START=X-Amzn-SageMaker-New-Session-Id \
    TS_REQUEST_SEQUENCE_END=X-Llava-Sequence-End

# SAGEMAKER_BIND_TO_PORT is honoured (multi-container endpoints).
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
EXPOSE 8080
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["serve"]
