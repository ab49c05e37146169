# trajgate: the gateway, the pool's CLI and the trainer bridge in one image.
# torch comes from PyPI (its Linux wheels carry CUDA), so the same image trains on a GPU.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY datapool ./datapool
COPY trainer_bridge ./trainer_bridge
COPY trajgate ./trajgate
COPY migrations ./migrations
# [train]: the trainer service runs this image too (torch, transformers, peft).
RUN pip install --no-cache-dir '.[train]'

RUN useradd --create-home --uid 1000 trajgate && mkdir -p /data /weights /home/trajgate/.cache/huggingface \
    && chown -R trajgate /data /weights /home/trajgate/.cache
USER trajgate
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --retries=6 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
CMD ["trajgate", "serve"]
