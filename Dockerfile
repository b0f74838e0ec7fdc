# syntax=docker/dockerfile:1.7
# vLLM's OpenAI server image with fuselane installed next to it.
#
#   docker build -t fuselane:0.1.0 --build-arg VLLM_VERSION=v0.33.0 .
#   docker run --gpus all -p 8000:8000 -e FUSELANE_KERNELS=all \
#       -v ~/.cache/huggingface:/root/.cache/huggingface fuselane:0.1.0 --model MODEL
#   docker run --gpus all -v $PWD/out:/out --entrypoint fuselane fuselane:0.1.0 \
#       bench kernels --out /out        # fuselane's kernels against vLLM's and FlashInfer's
#
# The image's entry point is vLLM's own (`vllm serve`); fuselane is loaded through its
# `vllm.general_plugins` entry point in every vLLM process, and FUSELANE_KERNELS picks the
# kernel families (default none: stock vLLM). FUSELANE_TELEMETRY=1 adds per-kernel metrics to
# the /metrics endpoint.
ARG VLLM_VERSION=v0.33.0
FROM vllm/vllm-openai:${VLLM_VERSION}

# One shared directory for the Prometheus multiprocess collector, wiped at start (a reused
# directory double-counts): vLLM serves worker-side metrics from it.
ENV PROMETHEUS_MULTIPROC_DIR=/tmp/fuselane-prometheus \
    FUSELANE_KERNELS=none

COPY pyproject.toml README.md /opt/fuselane/
COPY kernels /opt/fuselane/kernels
COPY plugin /opt/fuselane/plugin
COPY serving /opt/fuselane/serving
COPY benchmarks /opt/fuselane/benchmarks
COPY grafana /opt/fuselane/grafana

# --no-deps: torch, triton and prometheus-client are the image's own; fuselane must not
# replace the torch that vLLM was built against.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/fuselane \
 && python3 -c "import fuselane.plugin, fuselane.kernels.kv_cache"

COPY <<'SH' /usr/local/bin/fuselane-entrypoint
#!/bin/sh
set -e
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
exec vllm serve "$@"
SH
RUN chmod +x /usr/local/bin/fuselane-entrypoint
ENTRYPOINT ["/usr/local/bin/fuselane-entrypoint"]
