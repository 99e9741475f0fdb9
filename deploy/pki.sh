#!/bin/sh
# The testbed's throwaway CA (service `pki` in docker-compose.yml): one certificate per node id in
# TESTBED_PKI_IDS, written to the shared volume at TESTBED_PKI_DIR (/pki/<id>/: node.pem,
# node.key, ca.pem). The CA key is deleted once they are issued, so no node container can mint
# another identity. A new run (`docker compose down -v && up`) gets a new CA.
set -eu
dir="${TESTBED_PKI_DIR:-/pki}"
# the admin API token all testbed nodes share (COTERIE_SECURITY__ADMIN_TOKEN_FILE=/pki/admin.token
# in docker-compose.yml); tests/testbed/check.py reads it with `compose exec node1 cat`
if [ ! -s "$dir/admin.token" ]; then
    mkdir -p "$dir"
    (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$dir/admin.token.tmp")
    mv "$dir/admin.token.tmp" "$dir/admin.token"
fi
if [ -f "$dir/ca/ca.pem" ]; then
    echo "pki: the CA in $dir/ca exists already; keeping its certificates" >&2
    exit 0
fi
rm -rf "$dir/ca.tmp"
coterie ca init "$dir/ca.tmp" --name "coterie testbed CA (throwaway)"
for id in ${TESTBED_PKI_IDS:?TESTBED_PKI_IDS: the node ids to certify}; do
    coterie cert issue --ca "$dir/ca.tmp" --node-id "$id" --out "$dir/$id"
done
rm -f "$dir/ca.tmp/ca.key"
mv "$dir/ca.tmp" "$dir/ca"
echo "pki: certificates for $TESTBED_PKI_IDS in $dir; CA key deleted" >&2
