#!/bin/sh
# The container testbed's NAT router (service `natrouter`, profile nat, in docker-compose.yml):
# what a home router does for the "site" network behind it. Outbound connections from the site are
# masqueraded to this container's wan address; answers come back (conntrack); new connections from
# the wan side are dropped — so a node on the site can dial out and nothing can dial it.
# Needs cap NET_ADMIN and net.ipv4.ip_forward=1 (compose sets both). tests/natbed/ does the same
# with network namespaces.
set -eu
wan_ip="${NAT_WAN_IP:?NAT_WAN_IP: this router's address on the wan network}"
site="${NAT_SITE_SUBNET:?NAT_SITE_SUBNET: the site network behind this router}"
# interfaces by address (docker names them eth0/eth1 in an order we do not choose)
wan_if=$(ip -o -4 addr show | awk -v ip="$wan_ip" '{split($4, a, "/")} a[1] == ip {print $2}')
site_if=$(ip -o -4 route show "$site" | awk '{for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1)}' | head -n1)
[ -n "$wan_if" ] && [ -n "$site_if" ] || { echo "nat-router: no interface for $wan_ip or $site" >&2; ip -o -4 addr show >&2; exit 1; }
[ "$(cat /proc/sys/net/ipv4/ip_forward)" = 1 ] || { echo "nat-router: net.ipv4.ip_forward is off" >&2; exit 1; }

iptables -t nat -A POSTROUTING -s "$site" -o "$wan_if" -j MASQUERADE
iptables -P FORWARD DROP
iptables -A FORWARD -i "$site_if" -o "$wan_if" -j ACCEPT                                   # out: anything
iptables -A FORWARD -i "$wan_if" -o "$site_if" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT  # in: answers only
iptables -A INPUT -i "$wan_if" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
iptables -A INPUT -i "$wan_if" -j DROP
echo "nat-router: $site masqueraded out of $wan_if ($wan_ip); new inbound connections dropped" >&2
touch /tmp/nat-ready
# stay up (PID 1's child under init: true), answering SIGTERM at once
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
