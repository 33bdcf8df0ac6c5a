#!/usr/bin/env bash
# Makes the local Debian base image that every kvledger image can be built on where registry
# images cannot be pulled: `debootstrap --variant=minbase` from Debian's mirror, then
# `docker import`. The base trusts what this machine trusts: ca-certificates plus the machine's
# local CAs (/usr/local/share/ca-certificates, e.g. an egress proxy's), with pip pointed at that
# bundle, so builds on it reach PyPI wherever this machine does. Starts dockerd first when no engine answers (root only; its log goes to
# $KVLEDGER_DOCKERD_LOG). Idempotent: an existing image is kept.
#
#   docker/build-base.sh                 # kvledger/debian-base:bookworm
#   KVLEDGER_BASE_IMAGE=... DEBIAN_SUITE=... DEBIAN_MIRROR=... docker/build-base.sh
#
# Then: docker build --build-arg BASE_IMAGE=kvledger/debian-base:bookworm -f docker/Dockerfile .
set -euo pipefail

IMAGE=${KVLEDGER_BASE_IMAGE:-kvledger/debian-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKERD_LOG=${KVLEDGER_DOCKERD_LOG:-/var/log/kvledger-dockerd.log}
DOCKERD_START_TIMEOUT_S=${KVLEDGER_DOCKERD_START_TIMEOUT_S:-60}

sudo=$([ "$(id -u)" -eq 0 ] || echo sudo)

install_missing() {  # apt packages for the commands that are missing
  local packages=()
  command -v dockerd >/dev/null || packages+=(docker.io)
  command -v debootstrap >/dev/null || packages+=(debootstrap)
  if [ ${#packages[@]} -gt 0 ]; then
    $sudo apt-get update -qq && $sudo apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
}

ensure_dockerd() {  # an engine that answers, or start one and wait for it
  docker info >/dev/null 2>&1 && return 0
  echo "starting dockerd (log: $DOCKERD_LOG)" >&2
  $sudo sh -c "setsid dockerd >>'$DOCKERD_LOG' 2>&1 < /dev/null &"
  local deadline=$((SECONDS + DOCKERD_START_TIMEOUT_S))
  until docker info >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "dockerd did not answer within ${DOCKERD_START_TIMEOUT_S}s; log tail:" >&2
      $sudo tail -n 20 "$DOCKERD_LOG" >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

install_missing
ensure_dockerd
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE exists" >&2
  exit 0
fi
root=$(mktemp -d /tmp/kvledger-debian-base.XXXXXX)
trap '$sudo rm -rf "$root"' EXIT
echo "debootstrap $SUITE from $MIRROR" >&2
$sudo debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$root" "$MIRROR" >/dev/null
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  $sudo cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  $sudo chroot "$root" update-ca-certificates >/dev/null
fi
# the images' apt reaches the same mirror, security updates included
$sudo tee "$root/etc/apt/sources.list" >/dev/null <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SOURCES
$sudo rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
$sudo tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$IMAGE" >/dev/null
echo "$IMAGE imported" >&2
