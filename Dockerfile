# syntax=docker/dockerfile:1.7
# LLaVA session server for SageMaker stateful endpoints (GPU).
#
#   docker build -t llava-sessions .                        # or ./build_and_push.sh (ECR)
#   docker build --build-arg BAKE_MODEL_ID=llava-hf/llava-1.5-7b-hf \
#                --build-arg BAKE_MODEL_REVISION=<40-hex commit> -t llava-sessions:7b .
#   docker run --gpus all -p 8080:8080 -v "$PWD/models/7b:/opt/ml/model:ro" llava-sessions serve
#
# SageMaker runs `docker run IMAGE serve`: tini (PID 1, forwards SIGTERM, reaps orphans) runs
# /usr/local/bin/serve -> llava-container-serve, which starts TorchServe on 0.0.0.0:8080 with the
# model from /opt/ml/model (else the baked /opt/llava/model), restarts it when a worker dies, and
# on SIGTERM stops it and exits 0 within 30 s (handler/llava_tools/container.py).

# An AWS Deep Learning Container for PyTorch inference (CUDA torch, Java 17 for TorchServe).
# Overridable: another region's registry (same 763104351884 account), a newer tag from
# https://github.com/aws/deep-learning-containers/blob/master/available_images.md, or any image
# with CUDA torch >= 2.4, Python >= 3.10 and a Java 17 runtime.
ARG BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-inference:2.6.0-gpu-py312-cu124-ubuntu22.04-sagemaker
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini from Ubuntu 22.04 (the base image's distribution).
ARG TINI_VERSION=0.19.0-1
RUN apt-get update \
    && apt-get install -y --no-install-recommends "tini=${TINI_VERSION}" \
    && rm -rf /var/lib/apt/lists/*

# Runtime dependencies, pinned. The base image's CUDA torch (and torchvision/torchaudio) are held
# at their installed versions by a constraints file: pip fails rather than replace them.
RUN pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' > /tmp/torch-constraints.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraints.txt \
        torchserve==0.12.0 \
        torch-model-archiver==0.12.0 \
        transformers==5.23.0 \
        tokenizers==0.23.3 \
        safetensors==0.8.0 \
        huggingface-hub==2.4.0 \
        pydantic==2.14.3 \
        pillow==13.0.0 \
        pyyaml==6.0.3 \
        requests==2.34.2 \
        boto3==1.44.5 \
        psutil==7.2.2 \
        packaging==26.3 \
    && pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' | diff /tmp/torch-constraints.txt - \
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
    && python -c "import llava_tools.container, llava_sessions.worker, ts"
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
