# syntax=docker/dockerfile:1.7
#
# Images of ringwright, one target each:
#   operator          the kopf operator; base install only, no torch (slim)
#   training          training base image: the runtime with torch
#   training-horovod  the same plus Horovod, compiled from source against that torch
#
#   docker build --target operator         -t ringwright/operator:0.1.0 .
#   docker build --target training         -t ringwright/training:0.1.0 .
#   docker build --target training-horovod -t ringwright/training:0.1.0-horovod .
#
# Every final image runs as an unprivileged numeric user (10001), so Kubernetes can
# enforce runAsNonRoot. Each one copies a finished virtual environment from a
# builder stage: compilers, pip caches and the project sources stay behind.

# Debian bookworm: its cmake is 3.x, which the Horovod build requires (cmake 4
# refuses Horovod's bundled third-party projects).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Optional torch wheel index, e.g. https://download.pytorch.org/whl/cpu for a
# CPU-only training image; empty: PyPI's default torch (CUDA on x86_64).
ARG TORCH_INDEX_URL=""

# ---------------------------------------------------------------- the wheel
# Built once and installed by the stages below, so no image needs the sources.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src/ src/
COPY operator/ operator/
COPY runtime/ runtime/
COPY devcluster/ devcluster/
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- operator
FROM ${PYTHON_IMAGE} AS operator-venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
COPY --from=wheel /wheels/ /wheels/
# The base install only (kopf, pydantic, ...). The check makes the build fail if a
# dependency ever drags torch into the operator image.
RUN python -m venv /opt/ringwright \
 && /opt/ringwright/bin/pip install /wheels/ringwright-*.whl \
 && /opt/ringwright/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE} AS operator
RUN groupadd --system --gid 10001 ringwright \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin ringwright
COPY --from=operator-venv /opt/ringwright /opt/ringwright
# No bytecode writes: the chart mounts the root filesystem read-only.
ENV PATH=/opt/ringwright/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# `/` holds no `operator` folder that could shadow the standard library module.
WORKDIR /
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "ringwright.operator"]

# ---------------------------------------------------------------- training
FROM ${PYTHON_IMAGE} AS training-venv
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
COPY --from=wheel /wheels/ /wheels/
RUN python -m venv /opt/ringwright \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
      /opt/ringwright/bin/pip install --index-url "$TORCH_INDEX_URL" torch; \
    fi \
 && /opt/ringwright/bin/pip install "$(ls /wheels/ringwright-*.whl)[runtime]"

# The image users start their training containers from.
FROM ${PYTHON_IMAGE} AS training
RUN groupadd --system --gid 10001 ringwright \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/ringwright \
      --shell /bin/bash ringwright
COPY --from=training-venv /opt/ringwright /opt/ringwright
# HOME is writable: torch and its compilers keep caches under ~/.cache.
ENV PATH=/opt/ringwright/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/ringwright
WORKDIR /home/ringwright
USER 10001:10001
# A plain command: pods set their own (`command:`/`args:`).
CMD ["python"]

# ---------------------------------------------------------------- horovod
# Compiles Horovod (gloo controller, torch extension) against the torch of the
# training venv with the repository's build script, installs the wheel into that
# venv and checks it (import, hvd.init(), an allreduce). The cache mount keeps the
# wheel between builds: the script's cache key covers Horovod, torch, Python and
# the script itself, so a warm build only reinstalls it.
FROM training-venv AS horovod-venv
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake g++ gcc make \
 && rm -rf /var/lib/apt/lists/*
COPY scripts/build_horovod.sh /src/scripts/build_horovod.sh
RUN --mount=type=cache,target=/var/cache/ringwright \
    bash /src/scripts/build_horovod.sh --venv /opt/ringwright --cache /var/cache/ringwright \
 && /opt/ringwright/bin/pip install "$(ls /wheels/ringwright-*.whl)[horovod]"

FROM ${PYTHON_IMAGE} AS training-horovod
RUN groupadd --system --gid 10001 ringwright \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/ringwright \
      --shell /bin/bash ringwright
COPY --from=horovod-venv /opt/ringwright /opt/ringwright
ENV PATH=/opt/ringwright/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/ringwright
WORKDIR /home/ringwright
USER 10001:10001
CMD ["python"]
