# syntax=docker/dockerfile:1
#
# The epguard image: runs the admission webhook (default) and the controller
# (`epguard-controller`), and carries the in-image probe at /opt/epguard/probe so the
# injection webhook can copy it into worker pods.
#
#   docker build -t epguard:dev .     # BuildKit (the default) or buildah: RUN --mount
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm@sha256:<digest> \
#                --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
#
# Base pinning: both stages use BASE_IMAGE, so the interpreter the venv was built with
# is the one it runs with. The default is the tag; a release build passes the digest of
# that tag (`docker buildx imagetools inspect python:3.11-slim-bookworm`) so the build
# is reproducible. tests/chart/test_image.py checks that both stages share the argument.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- builder: build epguard's wheel, install it with its dependencies into a venv ------
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UV_NATIVE_TLS=1 \
    UV_CACHE_DIR=/root/.cache/uv \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never
# The installer: uv, pinned (scripts/venv.sh pins the same), in a directory of its own that
# the final stage never sees.
ARG UV_VERSION=0.13.9
# Where uv and what it installs come from (uv reads no pip.conf):
# --build-arg UV_DEFAULT_INDEX=<mirror>.
ARG UV_DEFAULT_INDEX=https://pypi.org/simple
RUN python -m pip install --quiet --root-user-action=ignore --index-url "${UV_DEFAULT_INDEX}" \
        --target /opt/uv "uv==${UV_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY webhook ./webhook
COPY probe ./probe
# epguard's wheel, then a venv of it and its dependencies. Every dependency ships manylinux
# wheels for CPython 3.11 (amd64, arm64); --only-binary keeps it that way, so no compiler
# is ever needed, here or later. The venv has no pip, and its modules are compiled
# (UV_COMPILE_BYTECODE): the final image's user cannot write __pycache__.
# uv's cache is a build cache mount (BuildKit, buildah): kept between builds and never in
# a layer, so a rebuild after a source change fetches and unpacks nothing twice.
RUN --mount=type=cache,target=/root/.cache/uv,sharing=locked \
    /opt/uv/bin/uv build --quiet --wheel --out-dir /wheels . \
 && python -m venv --without-pip /opt/epguard/venv \
 && /opt/uv/bin/uv pip install --quiet --python /opt/epguard/venv/bin/python \
        --only-binary :all: /wheels/epguard-*.whl

# --- final: the venv and the probe on a fresh base, no build tools ---------------------
FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG BASE_IMAGE
LABEL org.opencontainers.image.title="epguard" \
      org.opencontainers.image.description="Refuses SGLang elastic-EP (--elastic-ep-backend mooncake) workers whose image cannot serve it: admission webhook, controller and in-image probe" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/epguard/epguard" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.epguard.probe.path="/opt/epguard/probe"

# The venv's interpreter is a symlink to this base's /usr/local/bin/python3.11.
COPY --from=builder /opt/epguard/venv /opt/epguard/venv
# The probe as plain files (stdlib only): `python3 /opt/epguard/probe -- <argv>` runs it
# with whatever Python the worker image has. Root-owned and read-only for the user.
COPY probe /opt/epguard/probe

ENV PATH="/opt/epguard/venv/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

# A fixed non-root UID/GID (the chart's runAsUser), with no passwd entry needed.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["epguard-webhook"]
CMD []
