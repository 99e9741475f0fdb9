#!/usr/bin/env bash
# Build the local base image `coterie-base:bookworm` without any registry:
# debootstrap a minimal Debian bookworm from the same mirror apt uses on this host,
# add python3 + venv + pip + iproute2 (tc) + iptables (NAT router) + ca-certificates, then `docker import`.
#
# Idempotent: does nothing when the image already exists (FORCE=1 rebuilds).
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail

IMAGE="${BASE_IMAGE:-coterie-base:bookworm}"
SUITE=bookworm
PKGS="python3,python3-venv,python3-pip,iproute2,iptables,ca-certificates,curl"

if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    # an image from an older recipe lacks iptables (the NAT router of profile nat needs it)
    if docker run --rm "$IMAGE" sh -c 'command -v iptables' >/dev/null 2>&1; then
        echo "base-image: $IMAGE already present"
        exit 0
    fi
    echo "base-image: $IMAGE has no iptables (an older recipe); rebuilding"
fi

# The mirror apt uses here (deb822 "URIs:" or one-line "deb URL suite ...") for the Debian main archive.
mirror_from_apt() {
    local f line
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r "$f" ]] || continue
        if [[ "$f" == *.sources ]]; then
            # first URIs: of a stanza whose Suites contain the bare suite name
            awk -v s="$SUITE" '
                /^[[:space:]]*$/ { if (u != "" && ok) { print u; exit } u=""; ok=0; next }
                /^URIs:/ { u=$2 }
                /^Suites:/ { for (i=2;i<=NF;i++) if ($i==s) ok=1 }
                END { if (u != "" && ok) print u }' "$f" | head -n1
        else
            grep -E "^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?[a-z]+://[^[:space:]]+[[:space:]]+$SUITE[[:space:]]" "$f" \
                | sed -E 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/' | head -n1
        fi
    done | grep -v -e security -e '^$' | head -n1
}

MIRROR="${DEBIAN_MIRROR:-$(mirror_from_apt)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
echo "base-image: debootstrap $SUITE from $MIRROR"

t0=$(date +%s)
ROOT="$(mktemp -d /tmp/coterie-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT

debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOT" "$MIRROR" >/tmp/coterie-debootstrap.log 2>&1 || {
    tail -n 30 /tmp/coterie-debootstrap.log >&2
    exit 1
}
# Trust whatever CA the host trusts (an intercepting HTTPS proxy here) for pip inside the image.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
# Slim it: apt lists, caches, docs.
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
EOF

tar -C "$ROOT" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' \
    -c 'CMD ["/bin/bash"]' \
    - "$IMAGE" >/dev/null
echo "base-image: built $IMAGE in $(( $(date +%s) - t0 ))s"
