# syntax=docker/dockerfile:1
#
# Targets:
#   runtime   (default) the daemon:     docker build -t sqs-ingest .
#   reconcile the PySpark reconciler:   docker build --target reconcile -t sqs-ingest-reconcile .
#
# Pinned to bookworm, not the floating python:3.11-slim: the reconcile target needs
# openjdk-17-jre-headless, which Debian 13 (trixie) no longer ships.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ----------------------------------------------------------- dependencies
FROM ${PYTHON_IMAGE} AS deps
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv
# Dependencies alone, before any code is copied: a code edit rebuilds one small layer, not
# the dependency install (nor pyspark's half-gigabyte download). Exactly the locked
# versions, each file checked against its hash (requirements/, `make lock`).
COPY requirements/runtime.txt requirements/otel.txt requirements/reconcile.txt \
     requirements/build.txt /src/requirements/
RUN pip install --require-hashes -r /src/requirements/runtime.txt
# Tracing (INGEST_TRACING=true, OTEL_* variables) works in the image; nothing of it is
# imported while tracing is off. --build-arg WITH_OTEL=0 leaves it out (about 10 MB).
ARG WITH_OTEL=1
RUN if [ "${WITH_OTEL}" = 1 ]; then pip install --require-hashes -r /src/requirements/otel.txt; fi

# ---------------------------------------------------------------- builder
FROM deps AS builder
COPY pyproject.toml hatch_build.py README.md ./
COPY migrations ./migrations
COPY service ./service
# Our own wheel (migrations are force-included as service/migrations), into the venv that
# is copied to the runtime. Built by the locked backend (requirements/build.txt, hashed) in
# a venv of its own, without build isolation: nothing is fetched unhashed, and the backend
# never reaches the runtime image. SQS_INGEST_WHEEL=runtime: the wheel without the handler
# author's test kit and its pytest plugin (service/testing, hatch_build.py).
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install --require-hashes -r /src/requirements/build.txt \
    && SQS_INGEST_WHEEL=runtime /opt/build/bin/pip wheel --no-deps --no-build-isolation \
       --wheel-dir /dist . \
    && pip install --no-deps /dist/*.whl
# Cut what the daemon never runs (README "Container figures"): pip and setuptools
# (~26 MB) only install, and botocore ships a model for every AWS service (~27 MB) where
# the daemon calls SQS, S3 (large payloads), SNS (results) and the credential chain's STS,
# SSO and sign-in. The services your handlers call are kept too: --build-arg
# HANDLER_AWS_SERVICES="dynamodb kms" (docs/getting-started/ship-it.md); every one:
# --build-arg BOTOCORE_SERVICES=all.
ARG BOTOCORE_SERVICES="sqs s3 sns sts sso sso-oidc signin"
ARG HANDLER_AWS_SERVICES=""
RUN if [ "${BOTOCORE_SERVICES}" != all ]; then \
        data="$(python -c 'import botocore, os; print(os.path.dirname(botocore.__file__))')/data" \
        && keep=" ${BOTOCORE_SERVICES} ${HANDLER_AWS_SERVICES} " \
        && for d in "${data}"/*/; do \
             name="$(basename "${d}")"; \
             case "${keep}" in *" ${name} "*) ;; *) rm -rf "${d}" ;; esac; \
           done; \
    fi \
    && python -m pip uninstall -y -q pip setuptools

# ------------------------------------------------------- reconcile builder
FROM deps AS builder-reconcile
# The `reconcile` extra (pyspark) is large: kept out of the daemon image, installed in its
# own layer that only a pyproject.toml change rebuilds.
RUN pip install --require-hashes -r /src/requirements/reconcile.txt
COPY --from=builder /dist /dist
RUN pip install --no-deps /dist/*.whl

# -------------------------------------------------------------- reconcile
FROM ${PYTHON_IMAGE} AS reconcile
# Debian packages pinned to bookworm's versions (main, the suite the base image is made
# from): the same JRE and JDBC driver in every build. Debian keeps only the current version
# of a package in the archive, so a point release that updates one makes this build fail
# loudly instead of drifting: bump the ARG (apt-cache policy PACKAGE on bookworm).
ARG OPENJDK_VERSION=17.0.19+10-1~deb12u2
ARG PGJDBC_VERSION=42.5.5-0+deb12u1
# Slim images delete /usr/share/man; the JRE's postinst fails without man1.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
       "openjdk-17-jre-headless=${OPENJDK_VERSION}" "libpostgresql-jdbc-java=${PGJDBC_VERSION}" \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 ingest \
    && useradd --system --uid 10001 --gid ingest --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin ingest
COPY --from=builder-reconcile /opt/venv /opt/venv
# The sidecar's metrics listen on every interface here (the scraper is outside the
# container); run outside an image, they default to 127.0.0.1.
# PYTHONSAFEPATH: the working directory (/tmp, the one writable place, shared with the daemon
# in the ECS sidecar task) is never on the import path, not even for `python -c` probes.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONSAFEPATH=1 \
    HOME=/tmp \
    INGEST_RECONCILE_METRICS_HOST=0.0.0.0
# Spark writes scratch files under the working directory and java.io.tmpdir:
# /tmp is the one writable place when the root filesystem is read-only.
# The lock the image was built from: sha256 of requirements/runtime.txt, otel.txt and
# reconcile.txt concatenated (scripts/image.sh passes it; `docker image inspect` shows it).
ARG LOCK_SHA256=unset
LABEL io.sqs-ingest.lock-sha256=${LOCK_SHA256}
WORKDIR /tmp
USER 10001:10001
EXPOSE 9103
ENTRYPOINT ["sqs-ingest"]
CMD ["reconcile"]

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 ingest \
    && useradd --system --uid 10001 --gid ingest --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin ingest
COPY --from=builder /opt/venv /opt/venv
# Probes and scrapes come from outside the container: every interface here (the daemon's
# own default, outside an image, is 127.0.0.1).
# PYTHONSAFEPATH: the working directory (/tmp, writable) is never on the import path, not
# even for the health check's `python -c`: a file written there is not code that runs.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONSAFEPATH=1 \
    INGEST_HTTP_PORT=9102 \
    INGEST_HTTP_HOST=0.0.0.0
# The lock the image was built from: sha256 of requirements/runtime.txt, otel.txt and
# reconcile.txt concatenated (scripts/image.sh passes it; `docker image inspect` shows it).
ARG LOCK_SHA256=unset
LABEL io.sqs-ingest.lock-sha256=${LOCK_SHA256}
WORKDIR /tmp
# Numeric ids so Kubernetes' runAsNonRoot can verify the user without /etc/passwd.
USER 10001:10001
EXPOSE 9102
# slim has no curl: probe /healthz (liveness, not /readyz) with the interpreter we ship.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('INGEST_HTTP_PORT', '9102'), timeout=4)"]
# Exec form: the daemon is PID 1 and receives SIGTERM itself, so it can drain
# in-flight batches and exit 0 (a shell wrapper would swallow the signal).
ENTRYPOINT ["sqs-ingest"]
CMD ["run"]
