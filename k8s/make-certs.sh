#!/usr/bin/env bash
# Make the TLS material and API token the chart (tls.enabled, apiToken.enabled)
# and the gpu overlay expect, without cert-manager:
#
#   <name>-tls          server certificate of coordinator, draft and target
#                       (server auth only), its key, and ca.crt
#   <name>-client-tls   the coordinator's client certificate for mutual TLS to
#                       draft and target (client auth only), its key, and ca.crt
#   <name>-api-token    key "token": the bearer token of the public API
#
# Usage: k8s/make-certs.sh [-n NAMESPACE] [-r NAME] [-o DIR] [--apply]
#   NAME is the chart's full name (default "specd": release "specd"); DIR
#   (default ./specd-certs) receives the files; --apply creates or updates the
#   three Secrets with kubectl, otherwise the kubectl commands are printed.
# The server certificate names <NAME>-{coordinator,draft,target} and the
# headless <NAME>-{draft,target}-headless (short,
# .NAMESPACE, .svc, .svc.cluster.local), localhost and 127.0.0.1 (port-forward).
set -euo pipefail

NAMESPACE=default
NAME=specd
OUT=./specd-certs
APPLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) NAMESPACE=$2; shift 2 ;;
    -r) NAME=$2; shift 2 ;;
    -o) OUT=$2; shift 2 ;;
    --apply) APPLY=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "make-certs: unknown argument $1" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT"
cd "$OUT"
umask 077
days=825

if [ ! -f ca.key ]; then
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout ca.key -out ca.crt -days 3650 -subj "/CN=$NAME CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

sans="DNS:localhost,IP:127.0.0.1"
for component in coordinator draft target draft-headless target-headless; do
  svc="$NAME-$component"
  sans="$sans,DNS:$svc,DNS:$svc.$NAMESPACE,DNS:$svc.$NAMESPACE.svc,DNS:$svc.$NAMESPACE.svc.cluster.local"
done

issue() {  # issue FILE_PREFIX CN EXTENDED_KEY_USAGE [SANS]
  local prefix=$1 cn=$2 eku=$3 san=${4:-}
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$prefix.key" -out "$prefix.csr" -subj "/CN=$cn" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } > "$prefix.ext"
  openssl x509 -req -in "$prefix.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "$prefix.crt" -days "$days" -extfile "$prefix.ext" 2>/dev/null
  rm -f "$prefix.csr" "$prefix.ext"
}
issue server "$NAME-server" serverAuth "$sans"
issue client "$NAME-coordinator" clientAuth
[ -f token ] || openssl rand -hex 32 > token

cmds=(
  "kubectl -n $NAMESPACE create secret generic $NAME-tls --type=kubernetes.io/tls --from-file=tls.crt=server.crt --from-file=tls.key=server.key --from-file=ca.crt=ca.crt --dry-run=client -o yaml | kubectl apply -f -"
  "kubectl -n $NAMESPACE create secret generic $NAME-client-tls --type=kubernetes.io/tls --from-file=tls.crt=client.crt --from-file=tls.key=client.key --from-file=ca.crt=ca.crt --dry-run=client -o yaml | kubectl apply -f -"
  "kubectl -n $NAMESPACE create secret generic $NAME-api-token --from-file=token=token --dry-run=client -o yaml | kubectl apply -f -"
)
echo "make-certs: wrote ca.crt, server.{crt,key}, client.{crt,key} and token in $(pwd)"
if [ "$APPLY" = 1 ]; then
  for c in "${cmds[@]}"; do bash -c "$c"; done
else
  echo "make-certs: create the Secrets with (from $(pwd)):"
  printf '  %s\n' "${cmds[@]}"
fi
