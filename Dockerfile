# syntax=docker/dockerfile:1.7
#
# Images of ringwright, one target each:
#   operator          the kopf operator; base install only, no torch (slim)
#   training          training base image: the runtime with torch, examples in /app/examples
#   training-horovod  the same plus Horovod, compiled from source against that torch
#
#   docker build --target operator         -t ringwright/operator:0.1.0 .
#   docker build --target training         -t ringwright/training:0.1.0 .
#   docker build --target training-horovod -t ringwright/training:0.1.0-horovod .
#
# Without Docker or a registry: `python -m ringwright.devcluster.images build` builds
# them with buildah on a Debian base made by mmdebstrap, from the wheels of the
# project's venv (the build arguments WHEELHOUSE and HOROVOD_WHEEL below).
#
# Every final image runs as an unprivileged numeric user (10001), so Kubernetes can
# enforce runAsNonRoot. Compilers, pip caches and the project sources stay behind in
# builder stages.

# Debian bookworm: its cmake is 3.x, which the Horovod build requires (cmake 4
# refuses Horovod's bundled third-party projects). Another bookworm base does as well
# if it has python, pip, the venv module, groupadd, useradd and apt-get.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Optional torch wheel index, e.g. https://download.pytorch.org/whl/cpu for a
# CPU-only training image; empty: PyPI's default torch (CUDA on x86_64).
ARG TORCH_INDEX_URL=""
# Optional: a folder of the `wheelhouse` build context (--build-context wheelhouse=DIR)
# that pip installs every distribution from instead of a package index. Its name is
# part of each step's cache key, so name a changed set of wheels anew (a digest).
# Empty: PyPI.
ARG WHEELHOUSE=""
# Optional: a prebuilt Horovod wheel (its path in the `wheelhouse` build context, next
# to the wheels it depends on) installed instead of compiling Horovod.
ARG HOROVOD_WHEEL=""

# Empty unless the build supplies the `wheelhouse` context.
FROM scratch AS wheelhouse

# ---------------------------------------------------------------- the wheel
# Built once and installed by the stages below, so no image needs the sources.
FROM ${PYTHON_IMAGE} AS wheel
ARG WHEELHOUSE
# Zip entries dated 1980: the same sources make the same wheel file, so a rebuilt
# stage leaves the layers that copy and install it as they were.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
    SOURCE_DATE_EPOCH=315532800
WORKDIR /build
COPY pyproject.toml README.md ./
# The training image's dependencies, apart from the sources: it installs them (torch)
# in a layer that a change to the sources leaves alone.
RUN mkdir /deps && python -c "import tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
open('/deps/runtime.txt', 'w').write('\n'.join(p['dependencies'] + p['optional-dependencies']['runtime']) + '\n')"
COPY src/ src/
COPY operator/ operator/
COPY runtime/ runtime/
COPY devcluster/ devcluster/
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="/wheelhouse/$WHEELHOUSE"; fi \
 && pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- operator
FROM ${PYTHON_IMAGE} AS operator-venv
ARG WHEELHOUSE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
COPY --from=wheel /wheels/ /wheels/
# The base install only (kopf, pydantic, ...). The check makes the build fail if a
# dependency ever drags torch into the operator image.
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="/wheelhouse/$WHEELHOUSE"; fi \
 && python -m venv /opt/ringwright \
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
# The image users start their training containers from. The venv is made in place, in
# two layers: the dependencies (torch: gigabytes, rebuilt only when they change), then
# ringwright itself (the wheel it installs stays behind in a layer: a few hundred KB).
FROM ${PYTHON_IMAGE} AS training
ARG TORCH_INDEX_URL
ARG WHEELHOUSE
RUN groupadd --system --gid 10001 ringwright \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/ringwright \
      --shell /bin/bash ringwright
COPY --from=wheel /deps/runtime.txt /tmp/requirements.txt
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
 && if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="/wheelhouse/$WHEELHOUSE"; fi \
 && python -m venv /opt/ringwright \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
      /opt/ringwright/bin/pip install --index-url "$TORCH_INDEX_URL" torch; \
    fi \
 && /opt/ringwright/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY --from=wheel /wheels/ /tmp/wheels/
RUN /opt/ringwright/bin/pip install --no-cache-dir --disable-pip-version-check --no-input \
      --no-deps /tmp/wheels/ringwright-*.whl \
 && rm -r /tmp/wheels
# The example scripts the manifests in examples/ run.
COPY examples/ /app/examples/
# HOME is writable: torch and its compilers keep caches under ~/.cache.
ENV PATH=/opt/ringwright/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/ringwright
WORKDIR /home/ringwright
USER 10001:10001
# A plain command: pods set their own (`command:`/`args:`).
CMD ["python"]

# ---------------------------------------------------------------- horovod
# Compiles Horovod (gloo controller, torch extension) against the torch of the
# training venv with the repository's build script, which also installs it into this
# stage's copy of the venv and checks it (import, hvd.init(), an allreduce). The cache
# mount keeps the wheel between builds: the script's cache key covers Horovod, torch,
# Python, the script and its patches. With HOROVOD_WHEEL, that wheel is used instead.
FROM training AS horovod-build
ARG HOROVOD_WHEEL
USER root
COPY scripts/build_horovod.sh /src/scripts/build_horovod.sh
COPY scripts/horovod-patches/ /src/scripts/horovod-patches/
RUN --mount=type=cache,target=/var/cache/ringwright \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    if [ -n "$HOROVOD_WHEEL" ]; then \
      mkdir /horovod && cp "/wheelhouse/$HOROVOD_WHEEL" /horovod/; \
    else \
      apt-get update \
      && apt-get install -y --no-install-recommends cmake g++ gcc make \
      && rm -rf /var/lib/apt/lists/* \
      && bash /src/scripts/build_horovod.sh --venv /opt/ringwright \
           --cache /var/cache/ringwright --wheel-dir /horovod; \
    fi

# The training image plus one layer: Horovod and what it depends on.
FROM training AS training-horovod
ARG HOROVOD_WHEEL
USER root
RUN --mount=type=bind,from=horovod-build,source=/horovod,target=/tmp/horovod \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
 && if [ -n "$HOROVOD_WHEEL" ]; then \
      export PIP_NO_INDEX=1 PIP_FIND_LINKS="/wheelhouse/$(dirname "$HOROVOD_WHEEL")"; \
    fi \
 && pip install /tmp/horovod/horovod-*.whl
USER 10001:10001
